"""SpeculativeGenerator on tiny random models: greedy equality, seeds, batches, stops, streaming, errors."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from verispec.engine.config import SpecConfig
from verispec.engine.drafters import describe_drafter
from verispec.engine.generator import SpeculativeGenerator
from verispec.model.loading import LoadedModel
from verispec.sampling import SamplingParams

from ..helpers.tiny import EOS, greedy_reference, loaded, make_model, make_tokenizer

PROMPTS = [[3, 4, 5, 3, 4, 5, 3, 4], [9, 10], [20, 21, 22, 23, 24, 25, 20, 21, 22, 23, 24], [7]]
GREEDY = SamplingParams(temperature=0)


@pytest.mark.parametrize("draft", ["ngram", "model", "noisy", "self"])
@pytest.mark.parametrize("batch", [1, 4])
def test_greedy_equals_target_greedy(draft, batch, tiny_target, tiny_draft, tiny_noisy):
    d = {"ngram": None, "model": tiny_draft, "noisy": tiny_noisy, "self": tiny_target}[draft]  # self: the target
    gen = SpeculativeGenerator(tiny_target, d, config=SpecConfig(draft="ngram" if d is None else "model", gamma=3))
    prompts = PROMPTS[:batch]
    outs = gen.generate(prompts, GREEDY, max_new_tokens=24)
    for prompt, out in zip(prompts, outs):
        assert out.token_ids == greedy_reference(tiny_target.model, prompt, 24)
    if draft == "noisy":  # partial acceptance: both caches were rolled back mid-chain
        assert 0.2 < gen.last_stats.acceptance_rate < 1.0
    if draft == "self":  # a perfect draft: every draft accepted, tau = gamma + 1 until the budget binds
        assert gen.last_stats.acceptance_rate == 1.0


@pytest.mark.parametrize("gamma", [3, "auto"])
def test_greedy_with_prompt_lookup_or_a_draft_model_per_row(gamma, tiny_target, tiny_noisy):
    """draft=ngram+model: each row drafts from prompt lookup where it matches, the draft model elsewhere (a fixed
    gamma; auto: by measured gain, after a calibration so it drafts from the first step); greedy output is the
    target's, and both sources drafted tokens that were kept."""
    gen = SpeculativeGenerator(tiny_target, tiny_noisy, config=SpecConfig(draft="ngram+model", gamma=gamma))
    if gamma == "auto":
        gen.calibrate((4,), context=8, repeats=1)
    outs = gen.generate(PROMPTS, GREEDY, max_new_tokens=24)
    for prompt, out in zip(PROMPTS, outs):
        assert out.token_ids == greedy_reference(tiny_target.model, prompt, 24)
    kept = gen.core.proposer.kept  # per source: its tokens kept (auto's choices depend on timings: any split)
    assert sum(kept) == gen.last_stats.accepted > 0 and (gamma == "auto" or min(kept) > 0)
    assert describe_drafter(gen.core.proposer) == "prompt lookup or draft model"


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3", "mistral"])
def test_greedy_equals_target_greedy_per_family(family):
    target = loaded(3, family)
    gen = SpeculativeGenerator(target, loaded(4, family, layers=1), config=SpecConfig(draft="model", gamma=4))
    outs = gen.generate(PROMPTS, GREEDY, max_new_tokens=16)
    for prompt, out in zip(PROMPTS, outs):
        assert out.token_ids == greedy_reference(target.model, prompt, 16)


@pytest.mark.parametrize("draft", ["ngram", "model", "noisy", "none"])
def test_seeded_rows_are_batch_invariant(draft, tiny_target, tiny_draft, tiny_noisy):
    d = {"model": tiny_draft, "noisy": tiny_noisy}.get(draft)
    gen = SpeculativeGenerator(tiny_target, d, config=SpecConfig(draft="model" if d else draft, gamma=3))
    params = [SamplingParams(temperature=1.0, top_p=0.95, seed=s) for s in (11, 12, 13, 14)]
    batch = gen.generate(PROMPTS, params, max_new_tokens=20, ignore_eos=True)
    alone = [gen.generate([p], [sp], max_new_tokens=20, ignore_eos=True)[0] for p, sp in zip(PROMPTS, params)]
    reordered = gen.generate(PROMPTS[::-1], params[::-1], max_new_tokens=20, ignore_eos=True)[::-1]
    for a, b, c in zip(batch, alone, reordered):
        assert a.token_ids == b.token_ids == c.token_ids
        assert a.logprobs == pytest.approx(b.logprobs, abs=1e-5)


def test_same_seed_same_output_other_seed_other_output(tiny_target, tiny_draft):
    gen = SpeculativeGenerator(tiny_target, tiny_draft, config=SpecConfig(draft="model", gamma=2))
    sp = SamplingParams(temperature=1.0, seed=7)
    a = gen.generate(PROMPTS[0], sp, max_new_tokens=30, ignore_eos=True)[0]
    b = gen.generate(PROMPTS[0], sp, max_new_tokens=30, ignore_eos=True)[0]
    c = gen.generate(PROMPTS[0], replace(sp, seed=8), max_new_tokens=30, ignore_eos=True)[0]
    assert a.token_ids == b.token_ids and a.token_ids != c.token_ids


def test_max_new_tokens_eos_and_finish_reasons(tiny_target, tiny_draft):
    gen = SpeculativeGenerator(tiny_target, tiny_draft, config=SpecConfig(draft="model", gamma=4))
    out = gen.generate(PROMPTS[0], SamplingParams(seed=1), max_new_tokens=5, ignore_eos=True)[0]
    assert len(out.token_ids) == 5 and out.finish_reason == "length"
    # find a seed whose sample hits EOS, then check the EOS token ends the row and is not returned
    for seed in range(200):
        out = gen.generate(PROMPTS[1], SamplingParams(temperature=1.5, seed=seed), max_new_tokens=40)[0]
        if out.finish_reason == "stop":
            break
    assert out.finish_reason == "stop" and out.stop_reason == EOS and EOS not in out.token_ids
    assert len(out.token_ids) < 40
    again = gen.generate(PROMPTS[1], SamplingParams(temperature=1.5, seed=seed), max_new_tokens=40, ignore_eos=True)[0]
    assert again.token_ids[: len(out.token_ids) + 1] == out.token_ids + [EOS]


def test_stop_strings_cut_text_and_tokens(tiny_target):
    gen = SpeculativeGenerator(tiny_target, config=SpecConfig(draft="ngram", gamma=3))
    full = gen.generate(PROMPTS[2], GREEDY, max_new_tokens=20, ignore_eos=True)[0]
    words = full.text.split()
    assert len(words) >= 4
    stop = " ".join(words[2:4])
    out = gen.generate(PROMPTS[2], GREEDY, max_new_tokens=20, ignore_eos=True, stop=[stop, "zzzz"])[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.text == full.text[: full.text.find(stop)]
    assert out.token_ids == full.token_ids[:4] and len(out.logprobs) == 4


def test_streaming_deltas_add_up_to_the_text(tiny_target, tiny_draft):
    gen = SpeculativeGenerator(tiny_target, tiny_draft, config=SpecConfig(draft="model", gamma=3))
    params = [SamplingParams(seed=s) for s in (1, 2)]
    texts = {0: "", 1: ""}
    finals = {}
    for ev in gen.stream(PROMPTS[:2], params, max_new_tokens=15, ignore_eos=True):
        texts[ev.index] += ev.delta
        if ev.completion is not None:
            finals[ev.index] = ev.completion
    assert set(finals) == {0, 1}
    for i in (0, 1):
        assert texts[i] == finals[i].text and finals[i].text != ""


def test_logprobs_conventions(tiny_target, tiny_draft):
    gen = SpeculativeGenerator(tiny_target, tiny_draft, config=SpecConfig(draft="model", gamma=3))
    out = gen.generate(PROMPTS[0], SamplingParams(temperature=0.5, seed=3), max_new_tokens=6, ignore_eos=True)[0]
    seq = PROMPTS[0] + out.token_ids
    with torch.no_grad():
        logits = tiny_target.model(torch.tensor([seq])).logits[0, len(PROMPTS[0]) - 1 : -1]  # [6, V]
    toks = torch.tensor(out.token_ids)
    raw = torch.log_softmax(logits, -1)[torch.arange(6), toks]
    processed = torch.log_softmax(logits / 0.5, -1)[torch.arange(6), toks]
    assert out.raw_logprobs == pytest.approx(raw.tolist(), abs=1e-4)
    assert out.logprobs == pytest.approx(processed.tolist(), abs=1e-4)
    # temperature 1 with no processing: raw logprobs come from the processed ones (no second log-softmax pass)
    t1 = gen.generate(PROMPTS[0], SamplingParams(seed=4), max_new_tokens=6, ignore_eos=True)[0]
    with torch.no_grad():
        logits = tiny_target.model(torch.tensor([PROMPTS[0] + t1.token_ids])).logits[0, len(PROMPTS[0]) - 1 : -1]
    raw1 = torch.log_softmax(logits, -1)[torch.arange(6), torch.tensor(t1.token_ids)]
    assert t1.raw_logprobs == pytest.approx(raw1.tolist(), abs=1e-4) == t1.logprobs
    greedy = gen.generate(PROMPTS[0], GREEDY, max_new_tokens=4, ignore_eos=True)[0]
    assert greedy.logprobs == [0.0] * 4


def test_stats(tiny_target):
    gen = SpeculativeGenerator(
        tiny_target, tiny_target, config=SpecConfig(draft="model", stop_below=None, gamma=3)
    )  # perfect draft, full gamma
    out = gen.generate(PROMPTS[0], SamplingParams(seed=2), max_new_tokens=12, ignore_eos=True)[0]
    s = out.stats
    assert s.acceptance_rate == 1.0 and s.tau == pytest.approx(4.0) and s.per_position_acceptance == [1, 1, 1]
    assert s.output_tokens == 12 and s.target_passes == 3
    plain = SpeculativeGenerator(tiny_target, config=SpecConfig(draft="none")).generate(
        PROMPTS[0], SamplingParams(seed=2), max_new_tokens=5, ignore_eos=True
    )[0]
    assert plain.stats.tau == 1.0 and plain.stats.drafted == 0


def test_draft_stops_early_when_unsure(tiny_target, tiny_draft):
    sure = SpeculativeGenerator(tiny_target, tiny_draft, config=SpecConfig(draft="model", stop_below=None, gamma=4))
    unsure = SpeculativeGenerator(tiny_target, tiny_draft, config=SpecConfig(draft="model", stop_below=0.9, gamma=4))
    for g in (sure, unsure):
        g.generate(PROMPTS, SamplingParams(seed=4), max_new_tokens=16, ignore_eos=True)
    full = sure.last_stats.drafted / sure.last_stats.target_passes
    short = unsure.last_stats.drafted / unsure.last_stats.target_passes
    assert 0 < short < full


def test_adaptive_gamma_runs_and_stays_exact_under_greedy(tiny_target, tiny_draft):
    gen = SpeculativeGenerator(tiny_target, tiny_draft, config=SpecConfig(draft="model", gamma="auto", max_gamma=6))
    outs = gen.generate(PROMPTS, GREEDY, max_new_tokens=20)
    for prompt, out in zip(PROMPTS, outs):
        assert out.token_ids == greedy_reference(tiny_target.model, prompt, 20)


def test_chat_prompts_use_the_template(tiny_target):
    gen = SpeculativeGenerator(tiny_target, config=SpecConfig(draft="ngram"))
    assert gen.encode("a b", chat=True) == [3, 4, 29]  # template appends x0 (id 29)


# ---- bad input -------------------------------------------------------------------------------------------


def test_bad_input(tiny_target, tiny_draft):
    gen = SpeculativeGenerator(tiny_target, tiny_draft, config=SpecConfig(draft="model"))
    with pytest.raises(ValueError, match="prompt is empty"):
        gen.generate("", GREEDY)
    with pytest.raises(ValueError, match="max_new_tokens"):
        gen.generate("a b", GREEDY, max_new_tokens=0)
    with pytest.raises(ValueError, match="context is 256"):
        gen.generate([3] * 300, GREEDY)
    with pytest.raises(ValueError, match=r"SamplingParams\.top_p"):
        gen.generate("a b", SamplingParams(top_p=2.0))
    with pytest.raises(ValueError, match="one per prompt"):
        gen.generate(["a", "b"], [GREEDY])
    with pytest.raises(ValueError, match="stop strings"):
        gen.generate("a", GREEDY, stop=[""])
    with pytest.raises(ValueError, match="gamma"):
        SpeculativeGenerator(tiny_target, tiny_draft, config=SpecConfig(draft="model", gamma=-1))
    with pytest.raises(ValueError, match=r"token ids must lie in \[0, 32\)"):
        gen.generate([[40, 1]], GREEDY)


def test_a_draft_with_another_tokenizer_is_bridged(tiny_target):
    """Another tokenizer drafts across vocabularies (verispec.crossvocab; tests/crossvocab/ test it): here only the
    three special tokens are shared."""
    from verispec.crossvocab import BridgedRunner

    other = make_tokenizer(["<unk>", "<s>", "</s>"] + [f"w{i}" for i in range(29)])
    gen = SpeculativeGenerator(
        tiny_target, LoadedModel(make_model(1), other, "other"), config=SpecConfig(draft="model")
    )
    assert isinstance(gen.core.proposer.runner, BridgedRunner) and gen.core.proposer.runner.map.intersection == 3


def test_padded_embeddings_are_sliced_to_the_shared_vocabulary(tiny_target):
    big = LoadedModel(make_model(6, vocab=40), make_tokenizer(), "padded-40")  # 40 embedding rows, 32 tokens
    gen = SpeculativeGenerator(tiny_target, big, config=SpecConfig(draft="model", gamma=2))
    assert gen.core.vocab_size == 32
    out = gen.generate(PROMPTS[0], GREEDY, max_new_tokens=8)[0]
    assert out.token_ids == greedy_reference(tiny_target.model, PROMPTS[0], 8)
