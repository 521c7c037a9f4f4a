"""The generator certificate under a structured-output constraint, on the tiny word-level models (V = 32).

The grammar `("a" | "b" | "c")+ "d" ("e" | "f")*` leaves 3 of 32 tokens at the first position and ends the output
(EOS) only after "d", so the constrained law is far from the unconstrained one. The exact law the certificate
tests: p at each position masked after the sample's prefix (certify/scoring.py). verispec with a draft model
PASSES; the two grammar bugs (`grammar-stale-mask`: every slot masked with the step's root mask;
`grammar-q-unmasked`: drafts from the unmasked q, verification handed the masked renormalized q) FAIL; the
control `grammar-q-unmasked-consistent` (drafts from the unmasked q, verification handed that same q) PASSES,
since the rule is exact for whatever q the drafts were drawn from: the certificate tests the law, not whether q
was masked. Default tier: N = 100 continuations of L = 4 tokens, level 0.01 (the bugs deviate by TV ~0.4 at the
first token, far above what N = 100 detects); the slow tier runs each at the default N = 2000, L = 8.
"""

from __future__ import annotations

import re

import pytest
import torch

from verispec.certify.endpoint import Endpoint, structured_outputs
from verispec.certify.generate import certify_generate
from verispec.certify.methods import MethodSpec, _load
from verispec.certify.scoring import exact_sequence_law, grammar_masks
from verispec.cli import main
from verispec.sampling import Constraint, SamplingParams

from ..helpers.tiny import EOS, WORDS

GRAMMAR = 'root ::= ("a" | "b" | "c")+ "d" ("e" | "f")*'
PROMPT = [3, 7, 7, 12, 3, 7]
PARAMS = SamplingParams(temperature=1.0, constraint=Constraint.grammar(GRAMMAR))
A, B, C, D, E, F = (WORDS.index(w) for w in "abcdef")
SMALL = dict(samples=100, length=4)  # default tier: a few seconds per certificate


def _certify(models, inject=None, **kw):
    target, draft = models
    spec = MethodSpec(target=target, config=f"draft=model,model={draft},gamma=4", verifier=inject)
    return certify_generate(spec, [PROMPT], PARAMS, show_progress=False, **kw)


VERDICTS = [  # (injection, whether the certificate passes): the correct engine and the control PASS, the bugs FAIL
    (None, True),
    ("grammar-q-unmasked-consistent", True),
    ("grammar-stale-mask", False),
    ("grammar-q-unmasked", False),
]


def _valid(sample: list[int]) -> bool:
    """Whether a sample is a prefix of a sentence of GRAMMAR, ended at EOS only where it is complete."""
    text = "".join(WORDS[t] if t != EOS else "$" for t in sample)
    return re.fullmatch(r"[abc]+(d[ef]*\$?)?", text) is not None and ("$" not in text or text.endswith("$"))


@pytest.mark.statistical
@pytest.mark.parametrize(
    "inject, passes",
    VERDICTS,
)
def test_constrained_certificate(models, inject, passes):
    """The correct engine and the control PASS, the two grammar bugs FAIL (module docstring)."""
    r = _certify(models, inject, **SMALL)
    assert r.passed is passes and r.rejected is not passes, r.to_markdown()
    assert not r.errors
    first = next(t for t in r.tests if t.kind == "first-token")
    assert first.powered  # N = 100 pins a 3-outcome first-token law: a PASS is not INCONCLUSIVE
    assert r.params["constraint"]["kind"] == "grammar"
    if inject == "grammar-q-unmasked":  # the law itself moved (not only invalid outputs)
        assert first.holm_pvalue < r.level
    if inject == "grammar-stale-mask":  # p at a slot below the root allows what the grammar refuses there
        assert next(t for t in r.tests if t.kind == "loglik").holm_pvalue < r.level


@pytest.mark.slow
@pytest.mark.statistical
@pytest.mark.parametrize(
    "inject, passes",
    VERDICTS,
)
def test_constrained_certificate_at_default_size(models, inject, passes):
    """The same verdicts at the certificate's default size (N = 2000, L = 8): each first-token law checked to TV
    0.1 at power 0.99."""
    r = _certify(models, inject)
    assert r.passed is passes and r.rejected is not passes, r.to_markdown()
    assert all(t.detectable < 0.1 for t in r.tests if t.kind == "first-token")


def test_scores_read_the_grammar_along_each_prefix(models):
    """The exact constrained law: the first position allows a, b, c; after "a d" only e, f and EOS; the sequence
    law of two tokens puts all its mass on valid prefixes, an ended sequence padded with EOS."""
    target, _ = models
    from verispec.certify.generate import grammar_state

    ref = _load(target, "float32")
    g = grammar_state(ref, PARAMS.constraint, 32, [EOS])
    m = grammar_masks(g, [[A, D, E]], 3, 32, torch.device("cpu"))[0]
    assert m[0].nonzero().flatten().tolist() == [A, B, C]
    assert sorted(m[1].nonzero().flatten().tolist()) == [A, B, C, D]
    assert sorted(m[2].nonzero().flatten().tolist()) == [EOS, E, F]
    law = exact_sequence_law(ref.model, PROMPT, PARAMS, 2, g, [EOS]).reshape(32, 32)
    assert law.sum() == pytest.approx(1.0)
    support = {(int(i), int(j)) for i, j in zip(*law.nonzero())}
    assert support == {(x, y) for x in (A, B, C) for y in (A, B, C, D)}


def test_verispec_samples_are_valid_and_end_at_eos(models):
    """verispec's constrained continuations are valid prefixes of the grammar; one that ends early ends with EOS
    (the engine's stop, appended as the outcome the scores count)."""
    from verispec.certify.methods import build_method

    target, draft = models
    fn = build_method(MethodSpec(target=target, config=f"draft=model,model={draft},gamma=4"))
    tokens, _, _ = fn(PROMPT, PARAMS, list(range(40)), 12)
    assert all(_valid(s) for s in tokens), tokens
    assert all(len(s) == 12 or s[-1] == EOS for s in tokens)
    assert any(s[-1] == EOS for s in tokens)


def test_constraint_checks(models):
    target, draft = models
    with pytest.raises(ValueError, match="constraint"):  # transformers' generate has no grammar
        certify_generate(MethodSpec(method="hf", target=target), [PROMPT], PARAMS, samples=20, show_progress=False)
    with pytest.raises(ValueError, match="needs a constraint"):  # a grammar bug without a grammar: a sure PASS
        spec = MethodSpec(target=target, config=f"draft=model,model={draft}", verifier="grammar-stale-mask")
        certify_generate(spec, [PROMPT], SamplingParams(), samples=20, show_progress=False)
    with pytest.raises(ValueError, match="no tree"):
        MethodSpec(target=target, config=f"draft=model,model={draft},tree=2-1", verifier="grammar-q-unmasked")
    with pytest.raises(ValueError, match="needs a drafter"):
        MethodSpec(target=target, config="draft=none", verifier="grammar-stale-mask")


def test_endpoint_sends_the_constraint():
    """--method openai: the constraint goes out as vLLM's structured_outputs (verispec serve reads it too)."""
    ep = Endpoint("http://localhost:1", "m")
    body = ep.body([1, 2], SamplingParams(constraint=Constraint.regex("[ab]+")), 7, 4)
    assert body["structured_outputs"] == {"regex": "[ab]+"}
    assert "structured_outputs" not in ep.body([1, 2], SamplingParams(), 7, 4)
    assert structured_outputs(Constraint.json_schema({"type": "integer"})) == {"json": {"type": "integer"}}
    assert structured_outputs(Constraint.json_object()) == {"json_object": True}
    assert structured_outputs(Constraint.choice(["x", "y"])) == {"choice": ["x", "y"]}
    assert structured_outputs(Constraint.grammar(GRAMMAR)) == {"grammar": GRAMMAR}


@pytest.mark.statistical
def test_cli_with_a_grammar(models, tmp_path, capsys):
    """`certify generate --grammar FILE` end to end: PASS for verispec, FAIL (exit 1) with --inject
    grammar-q-unmasked, exit 2 for a grammar bug without a constraint."""
    target, draft = models
    path = tmp_path / "g.ebnf"
    path.write_text(GRAMMAR)
    args = ["certify", "generate", "--target", target, "--draft", draft, "--prompt", "a b c", "--samples", "60"]
    args += ["--length", "3", "--grammar", str(path), "--out", str(tmp_path)]
    assert main(args) == 0
    assert "PASS" in capsys.readouterr().out
    assert main(args + ["--inject", "grammar-q-unmasked"]) == 1
    bare = [a for a in args if a not in ("--grammar", str(path))]
    assert main(bare + ["--inject", "grammar-stale-mask"]) == 2
