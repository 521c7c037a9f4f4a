"""transformers' universal assisted generation (UAG) as the comparison method of a draft with another tokenizer:
certify's hf-assisted and bench e2e's hf-assisted pass tokenizer= and assistant_tokenizer= when the tokenizers
differ (certify.methods.hf_assistant_kwargs), on the tiny cross-tokenizer pair (tests/helpers/cross_tok.py).

What holds in transformers 5.24, and is asserted here:
- greedy UAG (AssistedCandidateGeneratorDifferentTokenizers: the draft's text re-encoded, candidates kept up to the
  target's first argmax mismatch) is the target's own greedy decoding, token for token;
- sampling UAG (UniversalSpeculativeDecodingGenerator) returns the requested number of target tokens, but is NOT
  lossless: the assistant's pruned LM head lists the intersection in its tokenizer's get_vocab() order while the
  translator places those logits by ascending assistant id, so a drafted token is accepted with another token's
  probability. Its exact first-token law (computed from the two models and the translator) is far from the
  target's whenever the two orders differ (the draft tokenizer's get_vocab() is a hash map: its order changes
  from process to process), and equals it with the right placement;
- the sampling path prunes the assistant in place: the shared draft model is left as it was (it gets a copy).
"""

from __future__ import annotations

import pytest
import torch

from verispec.bench import e2e
from verispec.certify.methods import MethodSpec, _load, build_method, hf_assistant_kwargs
from verispec.sampling import SamplingParams

from ..helpers.cross_tok import SAMPLES, cross_pair, save_cross_pair

LENGTH = 8
SEEDS = [0, 1, 2]


@pytest.fixture(scope="module")
def saved_pair(tmp_path_factory):
    target, draft = save_cross_pair(tmp_path_factory.mktemp("cross-pair"))
    return str(target), str(draft)


@pytest.fixture(scope="module")
def uag(saved_pair):
    target, draft = saved_pair
    spec = MethodSpec(method="hf-assisted", target=target, config=f"draft=model,model={draft},gamma=3")
    return spec, build_method(spec)


def _greedy(model, prompt: list[int], n: int) -> list[int]:
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=n,
            do_sample=False,
            pad_token_id=0,
            eos_token_id=None,
        )
    return out[0, ids.shape[1] :].tolist()


def test_certify_hf_assisted_runs_uag(saved_pair, uag):
    """The certificate's hf-assisted on a draft with another tokenizer: the label names UAG, every seed gets
    `length` target ids at T=1 and T=0, greedy equals the target's own greedy decoding, and the cached draft model
    (shared with every other method of the process) is not pruned."""
    target_path, draft_path = saved_pair
    spec, sample = uag
    assert "universal assisted generation" in spec.label()
    target, draft = _load(target_path, "float32"), _load(draft_path, "float32")
    head, emb = draft.model.get_output_embeddings(), draft.model.get_input_embeddings()
    vocab = len(target.tokenizer)
    for text in SAMPLES[:3]:
        prompt = target.tokenizer(text)["input_ids"]
        tokens, stats = sample(prompt, SamplingParams(temperature=1.0), SEEDS, LENGTH)
        assert stats is None and [len(t) for t in tokens] == [LENGTH] * len(SEEDS)
        assert all(0 <= t < vocab for seq in tokens for t in seq)
        greedy, _ = sample(prompt, SamplingParams(temperature=0.0), SEEDS, LENGTH)
        assert greedy == [_greedy(target.model, prompt, LENGTH)] * len(SEEDS)
    assert draft.model.get_output_embeddings() is head and draft.model.get_input_embeddings() is emb
    assert type(head) is torch.nn.Linear and head.weight.shape[0] == draft.model.config.vocab_size


def test_same_tokenizer_stays_plain_assisted_generation():
    """A draft with the target's tokenizer gets assistant_model alone (transformers refuses assistant_tokenizer
    when the vocab sizes match)."""
    target, draft = cross_pair(0)
    twin = type(target)(draft.model, target.tokenizer, "twin")
    assert hf_assistant_kwargs(target, twin, sample=True) == {"assistant_model": draft.model}
    kw = hf_assistant_kwargs(target, draft, sample=False)
    assert kw == {"assistant_model": draft.model, "tokenizer": target.tokenizer, "assistant_tokenizer": draft.tokenizer}


def test_uag_sampling_first_token_law_is_not_the_targets():
    """The exact law of UAG's first sampled token (one speculative step: the draft samples from its pruned head,
    the target checks with the logits as the translator placed them) against the target's: with the translator's
    placement it is off whenever the pruned head's order is not ascending; with the right placement it is exact."""
    from transformers.generation.candidate_generator import AssistantVocabTranslatorCache

    target, draft = cross_pair(0)
    prompt = target.tokenizer(SAMPLES[0])["input_ids"]
    ids = torch.tensor([prompt])
    kw = hf_assistant_kwargs(target, draft, sample=True)
    with torch.no_grad():  # one call builds (and caches) the translator and prunes the assistant copy
        target.model.generate(ids, max_new_tokens=2, do_sample=True, pad_token_id=0, eos_token_id=None, **kw)
        tr = AssistantVocabTranslatorCache._cache[target.tokenizer][draft.tokenizer]
        p = target.model(ids).logits[0, -1].double().softmax(-1)
        text = target.tokenizer.decode(prompt, skip_special_tokens=True)
        d_ids = draft.tokenizer(text, add_special_tokens=False)["input_ids"]
        d_logits = draft.model(torch.tensor([d_ids])).logits[0, -1].double()
    rows = tr.assistant_overlap_token_ids  # assistant id of each row of the pruned head
    pruned = d_logits[rows]
    drafted = torch.zeros_like(p)
    drafted[tr._assistant_to_target_input_ids[rows]] = pruned.softmax(-1)  # what the draft proposes
    placed = tr.get_target_logits(pruned[None].float())[0].double().softmax(-1)  # what the check uses

    def law(q):
        keep = drafted * torch.clamp(p / q, max=1)
        residual = torch.clamp(p - q, min=0)
        return keep + (1 - keep.sum()) * residual / residual.sum()

    tv = 0.5 * (law(placed) - p).abs().sum().item()
    assert 0.5 * (law(drafted) - p).abs().sum().item() < 1e-6
    if rows.tolist() == sorted(rows.tolist()):
        assert tv < 1e-6
    else:
        assert tv > 0.01, tv


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_bench_hf_generate_runs_uag(temperature):
    """bench e2e's hf-assisted runs the pair (universal assisted generation) and hf-plain the target alone:
    exactly max_new tokens per prompt; greedy UAG takes fewer target passes than tokens."""
    target, draft = cross_pair(0)
    prompts = [target.tokenizer(t)["input_ids"] for t in SAMPLES[:2]]
    tokens, seconds, calls = e2e._hf_generate(target, draft, prompts, temperature, LENGTH, seed=0)
    assert tokens == LENGTH * len(prompts) and seconds > 0 and 0 < calls <= tokens
    if temperature == 0:
        assert calls < tokens
    assert type(draft.model.get_output_embeddings()) is torch.nn.Linear


def test_bench_run_e2e_takes_a_draft_with_another_tokenizer():
    """run_e2e with verispec-plain and hf-assisted: nothing before the methods refuses the pair."""
    target, draft = cross_pair(0)
    cfg = e2e.E2EConfig(max_new_tokens=4, temperatures=(1.0,), num_prompts=1, batch=(1,), chat=False,
                        methods=("verispec-plain", "hf-assisted"))  # fmt: skip
    result = e2e.run_e2e(target, draft, {"code": [SAMPLES[0]]}, cfg, log=lambda m: None)
    assert {r["method"]: r["tokens"] for r in result["records"]} == {"verispec-plain": 4, "hf-assisted": 4}
