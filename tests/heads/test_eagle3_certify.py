"""`verispec certify generate` with an EAGLE-3 head as the draft (`--draft HEAD_DIR`): the generator certificate PASSES
the head's chains and trees and FAILS the injected head bugs (`--inject head-no-d2t | head-full-vocab`,
verispec.certify.mutants), which are refused where they do not apply (no head, a tree, coupled randomness).

Sizes: the tiny 4-layer target saved to disk, the distilled head of conftest.py (drafts accepted ~60% of the time
at temperature 1), one prompt, N = 600 continuations of L = 2 tokens, family-wise level 0.01, the two-sample test
off (the exact tests need no reference samples): a few seconds each. The first-token test then detects TV 0.25 at
power 0.99 (asserted); the bugs are far beyond it (first-token p-values ~1e-19 and below at this size).
"""

from __future__ import annotations

import json
from typing import ClassVar

import pytest

from verispec.certify.generate import certify_generate
from verispec.certify.methods import MethodSpec
from verispec.certify.mutants import HEAD_BUGS, HeadQ, Mutant, with_q
from verispec.cli import main
from verispec.engine.config import SpecConfig
from verispec.heads import load_head, scatter_logits
from verispec.sampling import SamplingParams

from .conftest import four_layer_target, one_thread

pytestmark = pytest.mark.statistical

PROMPT = [1, 3, 7]
T1 = SamplingParams(temperature=1.0)
SAMPLES, LENGTH = 600, 2


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny-4l") / "target"
    with one_thread():
        t = four_layer_target()
        t.model.save_pretrained(folder)
        t.tokenizer.save_pretrained(folder)
    return folder


def certify(target_dir, config: str, verifier=None):
    spec = MethodSpec(target=str(target_dir), config=config, verifier=verifier)
    return certify_generate(
        spec, [PROMPT], T1, samples=SAMPLES, length=LENGTH, two_sample_tokens=0, show_progress=False
    )


@pytest.mark.parametrize("shape", ["gamma=3,stop_below=none", "tree=2-2,verify=iid"])
def test_certify_passes_a_head(target_dir, trained_head_dir, shape):
    r = certify(target_dir, f"draft=model,model={trained_head_dir},{shape},random=stream")
    assert r.passed, r.to_markdown()
    assert 0.3 < r.acceptance_rate < 0.95
    first = [t for t in r.tests if t.kind == "first-token"]
    assert len(first) == 1 and first[0].detectable < 0.25


@pytest.mark.parametrize("bug", HEAD_BUGS)
def test_certify_fails_the_head_bugs(target_dir, trained_head_dir, bug):
    r = certify(target_dir, f"draft=model,model={trained_head_dir},gamma=3,stop_below=none", verifier=bug)
    assert not r.passed, r.to_markdown()
    assert "verifier " + bug in r.method


def test_the_cli_takes_a_head_bug_and_fails_it(target_dir, trained_head_dir, tmp_path, capsys):
    argv = ["certify", "generate", "--target", str(target_dir), "--draft", str(trained_head_dir), "--gamma", "3"]
    argv += ["--prompt", "a b", "--samples", str(SAMPLES), "--length", str(LENGTH), "--temperature", "1"]
    argv += ["--two-sample-tokens", "0"]
    argv += ["--inject", "head-no-d2t", "--out", str(tmp_path)]
    code = main(argv)
    out = capsys.readouterr()
    report = json.loads((tmp_path / "generate-certificate.json").read_text())
    assert report["verdict"] == "FAIL" and code == 1, out.out[-2000:] + out.err[-2000:]


@pytest.mark.parametrize(
    "config, message",
    [
        ("draft=model,model={head},tree=2-2", "no tree"),
        ("draft=model,model={head},gamma=3,random=position", "stream randomness"),
        ("draft=model,model={target},gamma=3", "not an EAGLE-3 head directory"),
        ("draft=ngram,gamma=3", "draft=model with a head"),
    ],
)
def test_head_bugs_are_refused_where_they_do_not_apply(target_dir, trained_head_dir, config, message):
    config = config.format(head=trained_head_dir, target=target_dir)
    for bug in HEAD_BUGS:
        with pytest.raises(ValueError, match=message):
            MethodSpec(target=str(target_dir), config=config, verifier=bug)


def test_the_cli_refuses_a_head_bug_without_a_head(target_dir, capsys):
    argv = ["certify", "generate", "--target", str(target_dir), "--draft", str(target_dir), "--prompt", "a b"]
    code = main(argv + ["--inject", "head-full-vocab"])
    assert code == 2 and "not an EAGLE-3 head directory" in capsys.readouterr().err


class _Exact(HeadQ):
    """The head mutant's observer rebuilding q from the logits it reads back, scattered the right way: it must give
    back the drafted q (the slots it reads are those the drafts were drawn from)."""

    gaps: ClassVar[list[float]] = []

    def after_draft(self, view, draft):
        if draft.probs is None:
            return None
        right = scatter_logits(self.head_logits(draft), self.ids, self.runner.vocab_size)
        rebuilt = with_q(view, draft, right)
        for b, n in enumerate(draft.num_nodes):
            if n:
                _Exact.gaps.append(float((rebuilt.probs[b, :n] - draft.probs[b, :n]).abs().max()))
        return None


def test_the_head_mutant_reads_the_drafting_logits(trained_head_dir):
    target = four_layer_target()
    cfg = SpecConfig.parse("draft=model,gamma=3,stop_below=none,random=stream")
    gen = Mutant("head-no-d2t", observer=_Exact).generator(target, load_head(trained_head_dir), cfg)
    prompts = [PROMPT, [1, 3, 7, 2, 5], [1]] * 2
    params = [SamplingParams(temperature=t, top_k=k, seed=i) for i, (t, k) in enumerate([(1.0, 0), (0.8, 5)] * 3)]
    gen.generate(prompts, params, max_new_tokens=6)
    assert len(_Exact.gaps) >= 6 and max(_Exact.gaps) < 1e-5
