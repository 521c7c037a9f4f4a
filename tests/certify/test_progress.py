"""`certify_generate` tells its progress through a callback (the CLI renders it; the library prints nothing then):
each phase from 0 to its total, in order; and the report names the model it scored against when no target was
named (it printed "target `None`")."""

from __future__ import annotations

from itertools import pairwise

from verispec.certify.generate import certify_generate
from verispec.certify.methods import MethodSpec, _verispec_method
from verispec.sampling import SamplingParams

PROMPT = [3, 7, 7, 12, 3, 7]
PARAMS = SamplingParams(temperature=0.7, top_k=10)


def test_progress_phases_and_the_default_targets_name(tiny_target, capsys):
    spec = MethodSpec(target=None, config="draft=ngram,gamma=3")  # None: the default model, here the tiny one
    draw = _verispec_method(spec, tiny_target)
    told = []
    kw = dict(samples=40, length=3, reference=tiny_target, sample_fn=draw, progress=lambda *a: told.append(a))
    r = certify_generate(spec, [PROMPT, PROMPT[:3]], PARAMS, **kw)
    phases = list(dict.fromkeys(p for p, _, _ in told))
    assert phases == ["sampling", "scoring", "two-sample reference"]
    for phase in phases:
        seen = [(done, total) for p, done, total in told if p == phase]
        assert seen[0] == (0, 80) and seen[-1] == (80, 80), (phase, seen)  # 2 prompts x 40 samples
        assert all(a[0] < b[0] for a, b in pairwise(seen)), (phase, seen)  # after each batch
    assert capsys.readouterr().err == ""  # the callback given: nothing drawn
    assert r.target == tiny_target.name and f"target `{tiny_target.name}`" in r.to_markdown()
    assert r.to_json()["target"] == tiny_target.name
