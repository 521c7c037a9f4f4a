"""`verispec bench e2e` with chain and tree methods side by side, on tiny random models (a smoke test: speed is
measured by the benchmark itself, never asserted in tests)."""

from __future__ import annotations

import json

import pytest

from verispec.bench import e2e
from verispec.cli import main

from ..helpers.saved import read_strict_json, save_tiny_pair


def test_tree_methods_side_by_side(tmp_path, capsys):
    save_tiny_pair(tmp_path)
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt": "a b c a b", "category": "code"}) + "\n")
    tree = "verispec:draft=model,tree=2-2,gamma=auto,verify=without_replacement"
    block = "verispec:draft=model,gamma=2,verify=block"
    methods = (
        f"verispec-plain,verispec:draft=model,gamma=2,{block},{tree},verispec:draft=model,tree=dynamic-2-2-4,"
        "verispec:draft=ngram,tree=2-1,gamma=auto,verispec:draft=model,gamma=2,random=gumbel"
    )
    assert (
        main(
            [
                "bench",
                "e2e",
                "--target",
                str(tmp_path / "target"),
                "--draft",
                str(tmp_path / "draft"),
                "--prompts",
                str(prompts),
                "--num-prompts",
                "1",
                "--batch",
                "1",
                "--max-new-tokens",
                "8",
                "--temperatures",
                "1",
                "--methods",
                methods,
                "--spec",
                "max_gamma=4",
                "--no-chat",
                "--out",
                str(tmp_path / "out"),
            ]
        )
        == 0
    )
    result = read_strict_json(tmp_path / "out" / "e2e.json")
    assert {"commit", "dirty", "date", "command", "torch", "threads"} <= set(result)  # verispec.bench.provenance
    recs = {r["method"]: r for r in result["records"]}
    assert set(recs) == {
        "verispec-plain",
        "verispec:draft=model,gamma=2",
        block,
        tree,
        "verispec:draft=model,tree=dynamic-2-2-4",
        "verispec:draft=ngram,tree=2-1,gamma=auto",
        "verispec:draft=model,gamma=2,random=gumbel",
    }
    assert (
        result["config"]["spec"] == "max_gamma=4" and recs["verispec:draft=model,gamma=2,random=gumbel"]["tokens"] == 8
    )
    assert recs[tree]["tokens"] == 8 and recs[tree]["nodes"] > 0 and recs[tree]["drafted_per_step"] > 2
    assert len(result["cost_curve_s"]) == 7  # calibrated up to the widest verification (6 nodes + root)
    assert recs[block]["tokens"] == 8


@pytest.mark.parametrize(
    "bad, message",
    [
        ("verispec:draft=model,tree=4-x", "method 'verispec:draft=model,tree=4-x'"),
        ("verispec:draft=model,tree=dynamic-2-2-4,verify=iid", "deterministic"),
        ("nope", "unknown method 'nope'"),
        # the old aliases are gone: verispec:SPEC is the one spelling of a configuration
        ("verispec-draft@2", "unknown method 'verispec-draft@2'"),
        ("verispec-tree@2-2/iid", "unknown method"),
        ("verispec-ngram-tree@2-1", "unknown method"),
    ],
)
def test_bad_methods(bad, message):
    with pytest.raises(ValueError, match=message):
        e2e.method_config(bad, e2e.E2EConfig(methods=()))


def test_verispec_spec_methods():
    """verispec:SPEC is a method; in --methods its key=value items run up to the next method name."""
    from verispec.cli.bench_e2e import _methods

    listed = "verispec-plain,verispec:draft=model,gamma=2,verify=block,hf-plain,verispec:draft=ngram"
    assert _methods(listed) == (
        "verispec-plain",
        "verispec:draft=model,gamma=2,verify=block",
        "hf-plain",
        "verispec:draft=ngram",
    )
    cfg = e2e.E2EConfig(methods=())
    assert str(e2e.method_config("verispec:draft=model,gamma=2,verify=block", cfg)).startswith("draft=model,gamma=2")
    for bad in ("verispec:draft=model,verify=iid", "verispec:gamma=x", "verispec:draft=custom"):
        with pytest.raises(ValueError, match="method 'verispec:"):
            e2e.method_config(bad, cfg)


# --- the oracle (--oracle): gamma auto against plain and the best fixed gamma of the same cell ------------------------


def test_oracle_variants_are_the_gamma_auto_chain_methods_at_each_fixed_gamma():
    methods = (
        "verispec-plain",
        "verispec-ngram",  # gamma auto from the run
        "verispec:draft=model,gamma=auto,random=gumbel",  # its own gamma=auto
        "verispec:draft=model,gamma=2",  # fixed: no variants
        "verispec:draft=model,tree=2-2,gamma=auto",  # a tree's shape sets its drafts: no variants
        "hf-plain",
    )
    cfg = e2e.E2EConfig(methods=methods, gamma="auto", oracle=(2, 1))
    assert e2e.oracle_variants(methods, cfg) == {
        "verispec-ngram": {1: "verispec:draft=ngram,gamma=1", 2: "verispec:draft=ngram,gamma=2"},
        "verispec:draft=model,gamma=auto,random=gumbel": {
            1: "verispec:draft=model,gamma=1,random=gumbel",
            2: "verispec:draft=model,gamma=2,random=gumbel",
        },
    }
    for names in e2e.oracle_variants(methods, cfg).values():  # ordinary methods, at their gamma
        assert all(e2e.method_config(name, cfg).gamma == g for g, name in names.items())
    fixed = e2e.E2EConfig(methods=methods, gamma=4, oracle=(1, 2))  # the run's gamma fixed: only a method's own auto
    assert list(e2e.oracle_variants(methods, fixed)) == ["verispec:draft=model,gamma=auto,random=gumbel"]
    assert e2e.oracle_variants(methods, e2e.E2EConfig(methods=methods, gamma="auto")) == {}  # off by default
    # each auto method followed by its variants; plain first where the run does not list it
    order = e2e._with_variants(e2e.E2EConfig(methods=("verispec-ngram", "hf-plain"), gamma="auto", oracle=(4,)))
    assert order == ["verispec-plain", "verispec-ngram", "verispec:draft=ngram,gamma=4", "hf-plain"]
    with pytest.raises(ValueError, match="oracle gamma"):
        e2e.E2EConfig(methods=(), oracle=(0,))


def _rec(method, rate, category="code", **extra):
    return dict(temperature=0.0, category=category, batch=1, method=method, tokens_per_s=rate) | extra


def test_oracle_is_the_fastest_fixed_choice_of_each_cell():
    auto, g = "verispec-ngram", lambda n: f"verispec:draft=ngram,gamma={n}"
    records = []
    for cat, plain, rates, auto_rate in [
        ("drafting wins", 10.0, {1: 11.0, 2: 14.0, 4: 13.0}, 12.6),
        ("plain wins", 10.0, {1: 9.0, 2: 8.0, 4: 5.0}, 9.9),
        ("ties", 10.0, {1: 10.0, 2: 12.0, 4: 12.0}, 6.0),  # equals: plain, then the smaller gamma
        ("one missing", None, {1: None, 2: 3.0, 4: None}, 3.0),
    ]:
        records.append(_rec("verispec-plain", plain, cat))
        records.append(_rec(auto, auto_rate, cat))
        records += [_rec(g(n), rate, cat, oracle_of=[auto], gamma=n) for n, rate in reversed(rates.items())]
    records.append(_rec("verispec:draft=ngram,gamma=8", 99.0))  # a fixed method not marked as a variant: not a choice
    e2e.oracle(records)
    got = {r["category"]: r for r in records if r["method"] == auto}
    assert {c: (r["oracle"], r["oracle_gamma"], r["oracle_tokens_per_s"]) for c, r in got.items()} == {
        "drafting wins": ("gamma=2", 2, 14.0),
        "plain wins": ("plain", 0, 10.0),
        "ties": ("gamma=2", 2, 12.0),
        "one missing": ("gamma=2", 2, 3.0),
    }
    assert got["drafting wins"]["vs_oracle"] == pytest.approx(0.9) and got["plain wins"]["vs_oracle"] == 0.99
    assert got["drafting wins"]["plain_tokens_per_s"] == 10.0 and got["one missing"]["plain_tokens_per_s"] is None
    assert all("oracle" not in r for r in records if r["method"] != auto)  # the variants and plain gain nothing
    ties = [(0, 1.0), (1, 1.0), (2, None)]
    assert e2e.best_fixed(ties) == (0, 1.0) and e2e.best_fixed([(0, None)]) is None


def test_decisions_summarise_the_steps_and_the_controllers_counters():
    from verispec.engine.stats import SpecStats

    st = SpecStats()
    for drafted in (0, 0, 4, 2, 0, 3):
        st.observe(drafted, 1 if drafted else 0)
    before = {"decisions": 10.0, "probes": 2.0, "probe_cost_s": 0.5}
    after = {"decisions": 16.0, "probes": 3.0, "probe_cost_s": 0.75}
    got = e2e.decisions(st, before, after)
    assert got["drafting_share"] == 0.5 and got["mean_gamma"] == 3.0
    assert (got["probes"], got["probe_cost_s"], got["controller"]["decisions"]) == (1.0, 0.25, 6.0)
    bare = e2e.decisions(SpecStats(), {}, {})  # no steps, a controller without counters
    assert bare == dict(drafting_share=None, mean_gamma=None, probes=None, probe_cost_s=None)


def test_run_e2e_with_the_oracle_on_a_tiny_model(tiny_target):
    """Through run_e2e: each gamma-auto method's variants run beside it (plain added), the auto records carry the
    oracle, the report renders its table, and the JSON is strict (None, not NaN)."""
    from verispec.strict_json import dumps

    cfg = e2e.E2EConfig(
        methods=("verispec-ngram",), gamma="auto", oracle=(1, 2), temperatures=(0.0,), max_new_tokens=6,
        num_prompts=1, batch=(), chat=False,
    )  # fmt: skip
    result = e2e.run_e2e(tiny_target, None, {"letters": ["a b c a b c a b"]}, cfg, log=lambda m: None)
    recs = {r["method"]: r for r in result["records"]}
    variants = ["verispec:draft=ngram,gamma=1", "verispec:draft=ngram,gamma=2"]
    assert list(recs) == ["verispec-plain", "verispec-ngram", *variants]
    assert [(recs[v]["oracle_of"], recs[v]["gamma"], recs[v]["tokens"]) for v in variants] == [
        (["verispec-ngram"], 1, 6),
        (["verispec-ngram"], 2, 6),
    ]
    auto = recs["verispec-ngram"]
    fixed = [recs["verispec-plain"], *map(recs.get, variants)]
    assert auto["oracle_tokens_per_s"] == max(r["tokens_per_s"] for r in fixed)
    assert auto["vs_oracle"] == auto["tokens_per_s"] / auto["oracle_tokens_per_s"]
    assert 0 <= auto["drafting_share"] <= 1 and "oracle" not in recs["verispec-plain"]
    assert result["config"]["oracle"] == [1, 2]
    text = e2e.to_markdown(result)
    assert "| gamma auto method | plain tok/s | best fixed |" in text and "of 1 cells" in text
    assert text.count("| 0 | letters | 1 | verispec-ngram |") == 2  # the oracle's table and the full one
    json.loads(dumps(result), parse_constant=lambda c: pytest.fail(f"non-standard JSON constant {c}"))


def test_the_oracle_option(capsys, tmp_path):
    from verispec.cli.bench_e2e import _gammas

    assert _gammas("4,1,2,1") == (1, 2, 4)
    with pytest.raises(Exception, match="an integer from 1"):
        _gammas("0")
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt": "a b", "category": "code"}) + "\n")
    try:  # the run's gamma is fixed (4) and no method names gamma=auto: nothing to compare
        code = main(["bench", "e2e", "--prompts", str(prompts), "--oracle", "--methods", "verispec-ngram"])
    except SystemExit as e:
        code = e.code
    assert code == 2 and "--oracle compares gamma auto" in capsys.readouterr().err
