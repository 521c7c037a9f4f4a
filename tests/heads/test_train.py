"""`verispec train-draft` (verispec.training.heads): the training-time test attends as drafting does, the draft
vocabulary, the saved layout, resuming, and the command's errors. A tiny 8-layer target (aux layers 2, 4, 5)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from verispec.engine import SpeculativeGenerator
from verispec.engine.config import SpecConfig
from verispec.engine.drafters import load_draft
from verispec.heads import LoadedHead, PairRunner, bind_head, load_head
from verispec.heads.learn import _ttt_masks, choose_vocab, default_aux_layers, init_head, save_eagle3, ttt_logits
from verispec.model.fast import make_runner
from verispec.model.loading import LoadedModel, load_model
from verispec.sampling import SamplingParams
from verispec.training.heads import TrainConfig, _TargetTap

from ..helpers.cli import run_verispec
from ..helpers.heads import save_eagle3 as save_random_eagle3
from ..helpers.tiny import V, make_model, make_tokenizer

LAYERS = 8
AUX = (2, 4, 5)  # EAGLE-3's default for 8 layers: 2, L // 2, L - 3
PROMPTS = ["a b c", "d e f g", "x0 a", "b b b", "c d", "e e f", "g a", "h i j"]


def tiny8(seed: int = 0) -> LoadedModel:
    return LoadedModel(make_model(seed, layers=LAYERS), make_tokenizer(), f"tiny-8l-{seed}")


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("target8")
    make_model(0, layers=LAYERS).save_pretrained(folder)
    make_tokenizer().save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def prompts_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("prompts") / "p.jsonl"
    lines = [json.dumps({"prompt": p, "category": c}) for c in ("a", "b") for p in PROMPTS]
    path.write_text("\n".join(lines) + "\n")
    return path


def train_args(target_dir, prompts_file, out, *extra) -> list:
    return [
        "train-draft",
        "--target",
        target_dir,
        "--prompts",
        prompts_file,
        "--out",
        out,
        "--holdout",
        "2",
        "--max-new-tokens",
        "12",
        "--samples-per-prompt",
        "1",
        "--draft-vocab",
        "20",
        "--batch-tokens",
        "128",
        "--no-chat",
        *extra,
    ]


# --- the training-time test is drafting ------------------------------------------------------------------------


@pytest.mark.parametrize("runner", ["fast", "hf"])
def test_ttt_logits_equal_the_runners_when_the_head_drafts_s_deep(tmp_path, runner):
    """Step s's logits at slot j (training) == the PairRunner's logits when the target has computed x_0..x_{j-s-1},
    the head was fed x_0..x_{j-s} (the pending token x_{j-s} with the target's h_{j-s-1}) and then x_{j-s+1}..x_j
    as its own drafts, one forward each: the masks, the fed-back hidden states and the positions of training are
    drafting's. Two sequences of different lengths in one batch (padding never seen)."""
    target = tiny8()
    head = load_head(save_random_eagle3(tmp_path / "head", V, aux=AUX))
    bind_head(head, target)
    ids_of = torch.arange(len(head.model.d2t)) + head.model.d2t
    gen = SpeculativeGenerator(target, config=SpecConfig(draft="none"))  # the target's own continuations (sampled)
    prompts = ["a b c d", "x0 e"]
    seqs = [
        gen.encode(p) + gen.generate(p, SamplingParams(seed=k), max_new_tokens=m, ignore_eos=True)[0].token_ids
        for k, (p, m) in enumerate(zip(prompts, (10, 6)))
    ]
    pad = 0
    n = max(len(s) for s in seqs)
    ids = torch.tensor([s + [pad] * (n - len(s)) for s in seqs])
    lengths = torch.tensor([len(s) for s in seqs])
    aux, _ = _TargetTap(target.model, AUX)(ids, lengths, ids_of)
    steps = 3
    with torch.no_grad():
        trained = list(ttt_logits(head.model, ids, lengths, aux, steps))  # [steps] x [B, n, V_d]
    checked = 0
    for b, seq in enumerate(seqs):
        for s in range(steps):
            for j in range(s + 1, len(seq)):
                t_runner = make_runner(target.model, V, runner=runner)
                h_runner = PairRunner(head.model, t_runner, V)
                t_runner.start(1, 64)
                t_runner.prefill([seq[: j - s]])  # the target holds x_0..x_{j-s-1}
                h_runner.start(1, 64)
                logits = h_runner.forward([seq[: j - s + 1]], logits_at="last")  # ... and x_{j-s} is pending
                for t in range(j - s + 1, j + 1):  # x_{j-s+1}..x_j as drafts
                    logits = h_runner.forward([[seq[t]]], logits_at="last")
                torch.testing.assert_close(
                    logits[0, ids_of], trained[s][b, j].float(), atol=2e-5, rtol=1e-4, msg=f"row {b} step {s} slot {j}"
                )
                outside = torch.ones(V, dtype=torch.bool)
                outside[ids_of] = False
                assert (logits[0, outside] < logits[0, ids_of].min() - 30).all()  # probability 0 outside the head's ids
                checked += 1
    assert checked == sum(len(seq) - s - 1 for seq in seqs for s in range(steps)) > 30


def test_ttt_masks_hide_slot_0_padding_and_the_future():
    m = [mask[0, 0] == 0 for mask in _ttt_masks(6, 3, torch.tensor([6]))]  # step s: visible [n, (s + 1) n]
    assert not m[0][:, 0].any()  # slot 0 (x_0) holds no pair
    assert m[0][3].tolist() == [False, True, True, True, False, False]  # step 0: causal
    blocks = m[2][5].view(3, 6)  # step 2, slot 5: step-0 keys 1..3, step-1's at 4, step-2's at 5
    assert blocks[0].tolist() == [False, True, True, True, False, False]
    assert blocks[1].nonzero().flatten().tolist() == [4] and blocks[2].nonzero().flatten().tolist() == [5]
    padded = _ttt_masks(6, 2, torch.tensor([4]))[1][0, 0] == 0
    assert not padded.view(6, 2, 6)[:, :, 4:].any()  # keys past the row's length: never


# --- draft vocabulary, layout ------------------------------------------------------------------------------------


def test_choose_vocab_counts_continuations_then_prompts_then_low_ids():
    seqs = [[1, 1, 9, 9, 9, 4], [7, 4, 4, 3]]
    starts = [2, 1]  # continuations: 9 9 9 4 | 4 4 3; prompts: 1 1 | 7
    assert choose_vocab(seqs, starts, 16, 2).tolist() == [4, 9]  # 4 x3 and 9 x3: both; sorted by id
    assert choose_vocab(seqs, starts, 16, 3).tolist() == [3, 4, 9]
    assert choose_vocab(seqs, starts, 16, 4).tolist() == [1, 3, 4, 9]  # then the prompts: 1 (x2) before 7 (x1)
    assert choose_vocab(seqs, starts, 16, 5).tolist() == [1, 3, 4, 7, 9]
    assert choose_vocab(seqs, starts, 16, 7).tolist() == [0, 1, 2, 3, 4, 7, 9]  # then the lowest ids
    ties = [[5, 6, 2, 2, 8, 8]]
    assert choose_vocab(ties, [2], 16, 1).tolist() == [2]  # a tie: the lower id
    assert choose_vocab(ties, [2], 16, 3).tolist() == [2, 5, 8]  # prompt tokens 5, 6 tie: 5
    assert choose_vocab(seqs, starts, 16, 99).tolist() == list(range(16))  # at most the vocabulary


def test_a_saved_head_loads_binds_and_computes_what_it_did(tmp_path):
    target = tiny8()
    vocab_ids = torch.tensor([0, 2, 3, 5, 8, 13, 21, 30])
    head = init_head(target.model, vocab_ids, AUX)
    with torch.no_grad():
        for p in head.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    save_eagle3(head, tmp_path / "h", V)
    cfg = json.loads((tmp_path / "h" / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLMEagle3"] and cfg["draft_vocab_size"] == 8
    assert cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [i - 1 for i in AUX]  # layer outputs
    loaded = load_draft(str(tmp_path / "h"))
    assert isinstance(loaded, LoadedHead) and loaded.kind == "eagle3" and not loaded.embedded
    assert bind_head(loaded, target) == V
    assert loaded.model.layers_read == AUX
    assert (torch.arange(8) + loaded.model.d2t).tolist() == vocab_ids.tolist()
    ids = torch.tensor([[1, 5, 7, 9, 4, 3]])
    lengths = torch.tensor([6])
    aux, _ = _TargetTap(target.model, AUX)(ids, lengths, vocab_ids)
    with torch.no_grad():
        want = list(ttt_logits(head, ids, lengths, aux, 2))
        got = list(ttt_logits(loaded.model, ids, lengths, aux, 2))
    for w, g in zip(want, got):
        torch.testing.assert_close(g, w)


def test_default_aux_layers_need_seven_layers():
    assert default_aux_layers(7) == (2, 3, 4) and default_aux_layers(32) == (2, 16, 29)
    with pytest.raises(ValueError, match=">= 7 layers, this one has 6"):
        default_aux_layers(6)


@pytest.mark.parametrize(
    "field,value,msg",
    [("ttt", 0, "ttt must be an integer >= 1"), ("lr", 0.0, "lr, minutes"), ("max_steps", 0, "max_steps must be")],
)
def test_train_config_checks(field, value, msg):
    with pytest.raises(ValueError, match=msg):
        TrainConfig(**{field: value}).check()


# --- the command ------------------------------------------------------------------------------------------------


@pytest.mark.integration  # two training runs (seconds)
def test_train_draft_resume_and_the_trained_head_drafts_exactly(
    target_dir, prompts_file, tmp_path, capsys, monkeypatch
):
    out = tmp_path / "head"
    r = run_verispec(train_args(target_dir, prompts_file, out, "--max-steps", "6", "--checkpoint-every", "3"), capsys)
    assert r.returncode == 0, r.stderr
    summary = json.loads(r.stdout)
    assert summary["steps"] == 6 and summary["aux_layers"] == list(AUX) and summary["draft_vocab"] == 20
    assert {p.name for p in out.iterdir()} >= {"config.json", "model.safetensors", "data.pt", "train_state.pt"}
    data = torch.load(out / "data.pt", weights_only=False)
    assert len(data["seqs"]) == 2 * (len(PROMPTS) - 2) and len(data["vocab_ids"]) == 20

    # a second run into the same --out: refused without --resume
    again = run_verispec(train_args(target_dir, prompts_file, out, "--max-steps", "6"), capsys)
    assert again.returncode == 2 and "holds a training run already: pass --resume" in again.stderr

    # --resume: continues the step count from the checkpoint, on the same data (no sampling)
    import verispec.training.heads as train

    def no_sampling(*a, **k):
        raise AssertionError("a resumed run sampled again")

    monkeypatch.setattr(train, "sample_data", no_sampling)
    r = run_verispec(train_args(target_dir, prompts_file, out, "--max-steps", "10", "--resume"), capsys)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["steps"] == 10
    state = torch.load(out / "train_state.pt", weights_only=False)
    assert state["step"] == 10 and [h["step"] for h in state["history"]] == list(range(1, 11))
    resumed = torch.load(out / "data.pt", weights_only=False)
    assert resumed["seqs"] == data["seqs"] and resumed["vocab_ids"].tolist() == data["vocab_ids"].tolist()

    # the trained head: speculation with it gives plain decoding's greedy tokens
    target = load_model(str(target_dir))
    head = load_draft(str(out))
    assert isinstance(head, LoadedHead)
    prompts = ["a b c", "d e", "x0 h i"]
    params = SamplingParams(temperature=0)
    spec = SpeculativeGenerator(target, head, config=SpecConfig(draft="model", gamma=3))
    outs = spec.generate(prompts, params, max_new_tokens=16, ignore_eos=True)
    plain = SpeculativeGenerator(target, config=SpecConfig(draft="none")).generate(
        prompts, params, max_new_tokens=16, ignore_eos=True
    )
    assert [o.token_ids for o in outs] == [o.token_ids for o in plain]
    assert spec.last_stats.drafted > 0


def test_train_draft_errors(target_dir, prompts_file, tmp_path, capsys, monkeypatch):
    out = tmp_path / "h"
    cases = [
        (["--ttt", "0"], "--ttt: must be an integer >= 1"),
        (["--lr", "0"], "lr, minutes and temperature must be > 0"),
        (["--holdout", "8"], "no prompts left after --holdout"),
        (["--max-prompts", "0"], "--max-prompts: must be an integer >= 1"),
        (["--holdout", "-1"], "--holdout: must be an integer >= 0"),
    ]
    for extra, msg in cases:
        r = run_verispec(train_args(target_dir, prompts_file, out, *extra), capsys)
        assert r.returncode == 2 and msg in r.stderr, (extra, r.stderr)
        assert not out.exists()  # nothing written
    r = run_verispec(train_args(target_dir, prompts_file, out, "--runner", "llamacpp"), capsys)
    assert r.returncode == 2 and "unrecognized arguments: --runner" in r.stderr  # torch only: no runner to choose
    r = run_verispec(train_args(target_dir, tmp_path / "missing.jsonl", out), capsys)
    assert r.returncode == 2 and "missing.jsonl" in r.stderr
    r = run_verispec(train_args(tmp_path / "no-such-model", prompts_file, out), capsys)
    assert r.returncode == 2 and "verispec: error:" in r.stderr

    # a target llama.cpp runs (no torch module): refused before sampling
    import verispec.cli.train_draft as cli

    class FakeLlamaCpp:
        n_vocab = V

    monkeypatch.setattr(cli, "load", lambda spec, args: LoadedModel(FakeLlamaCpp(), make_tokenizer(), "m.gguf"))
    r = run_verispec(train_args(target_dir, prompts_file, out), capsys)
    assert r.returncode == 2 and "train-draft trains on a torch model, and m.gguf runs on llama.cpp" in r.stderr


def test_a_target_of_fewer_than_7_layers_is_refused_before_sampling(prompts_file, tmp_path, capsys, monkeypatch):
    small = tmp_path / "t6"
    make_model(0, layers=6).save_pretrained(small)
    make_tokenizer().save_pretrained(small)
    import verispec.training.heads as train

    monkeypatch.setattr(train, "sample_data", lambda *a, **k: pytest.fail("sampled for a target it cannot train on"))
    r = run_verispec(train_args(small, prompts_file, tmp_path / "h"), capsys)
    assert r.returncode == 2
    assert "EAGLE-3's default aux layers need a target of >= 7 layers, this one has 6" in r.stderr
