"""SpecConfig: the string form round-trips, every invalid combination is a clear error naming its key, and every entry
point builds from it with one set of defaults."""

from __future__ import annotations

import re

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from verispec.drafting import TreeSpec
from verispec.engine import SpeculativeGenerator
from verispec.engine.config import DRAFTERS, KEYS, SpecConfig, SpecError
from verispec.sampling import SamplingParams

# --- the string form ------------------------------------------------------------------------------------------

CONFIGS = st.builds(
    SpecConfig,
    draft=st.sampled_from(list(DRAFTERS)),
    model=st.sampled_from([None, "org/draft-model", "./models/d=1"]),
    quant=st.sampled_from([None, "int8", "int4"]),
    ngram=st.lists(st.integers(1, 9), min_size=1, max_size=4).map(tuple),
    stop_below=st.one_of(st.none(), st.floats(0, 1)),
    min_share=st.sampled_from([0.0, 0.25, 1.0]),
    choose_depth=st.sampled_from([None, 1, 3]),
    gamma=st.one_of(st.just("auto"), st.integers(0, 64)),
    max_gamma=st.integers(1, 64),
    tree=st.sampled_from([None, "4-2-2-1", "2-2", "8", "dynamic-6-4-16", "dynamic-3-2-6"]),
    jump=st.sampled_from([0, 1, 16, 256]),
    verify=st.sampled_from([None, "token", "block", "deterministic", "iid", "without_replacement", "mixed"]),
    random=st.sampled_from(["auto", "stream", "position", "gumbel"]),
    runner=st.sampled_from(["auto", "fast", "hf", "llamacpp"]),
)


@st.composite
def coherent_configs(draw) -> SpecConfig:
    """Configurations drawn key by key from what the drafter takes (most are valid; the rest raise SpecError)."""
    draft = draw(st.sampled_from(list(DRAFTERS)))
    kind = DRAFTERS[draft]
    trees = ["dynamic-6-4-16", "dynamic-3-2-6"] if kind.history else ["4-2-2-1", "2-2", "8", "dynamic-3-2-6"]
    tree = draw(st.sampled_from([None, *trees])) if kind.tree_rules else None
    rules = kind.tree_rules if tree else kind.chain_rules
    quants = ["int8", "int4"] if kind.target_weights else [None, "int8", "int4"] if kind.model else [None]
    fixed = kind.history and kind.uses_model
    return SpecConfig(
        draft=draft,
        model=draw(st.sampled_from([None, "org/draft-model", "./models/d=1"])) if kind.model else None,
        quant=draw(st.sampled_from(quants)),
        ngram=draw(st.lists(st.integers(1, 9), min_size=1, max_size=4).map(tuple)),
        stop_below=draw(st.one_of(st.none(), st.floats(0, 1))),
        min_share=draw(st.sampled_from([0.0, 0.25, 1.0])) if kind.history else 0.0,
        choose_depth=draw(st.sampled_from([None, 1, 3])) if fixed else None,
        gamma=draw(st.integers(1, 64) if fixed else st.one_of(st.just("auto"), st.integers(0, 64))),
        max_gamma=draw(st.integers(1, 64)),
        tree=tree,
        jump=draw(st.sampled_from([0, 1, 16, 256])),
        verify=draw(st.sampled_from([None, *rules])),
        random=draw(st.sampled_from(["auto", "stream", "position", "gumbel"])),
        runner=draw(st.sampled_from(["auto", "fast", "hf", "llamacpp"])),
    )


@settings(max_examples=800, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_the_string_form_round_trips(data):
    """parse(str(c)) == c, str(parse(s)) == s for every printed s, and repr evaluates back, over many valid
    configurations (a draw the constructor refuses is skipped: its errors are tested below)."""
    try:
        cfg = data.draw(coherent_configs() if data.draw(st.booleans()) else CONFIGS)
    except SpecError:
        return
    text = str(cfg)
    assert SpecConfig.parse(text) == cfg
    assert str(SpecConfig.parse(text)) == text == cfg.spec()
    assert eval(repr(cfg), {"SpecConfig": SpecConfig}) == cfg
    assert all(f"{key}=" in text for key in ("draft", "gamma", "verify", "random"))


def test_most_coherent_draws_are_valid():
    """The round trip above is not vacuous: most key-by-key draws are valid configurations."""
    outcomes = []

    @settings(max_examples=300, deadline=None)
    @given(st.data())
    def draw(data):
        try:
            data.draw(coherent_configs())
            outcomes.append(True)
        except SpecError:
            outcomes.append(False)

    draw()
    assert sum(outcomes) > 0.5 * len(outcomes)  # about 0.63 of the draws (measured over 3000)


@pytest.mark.parametrize(
    "text, expected",
    [
        ("", SpecConfig()),
        ("draft=ngram,gamma=auto,verify=token,random=auto", SpecConfig()),
        ("random=stream", SpecConfig(random="stream")),
        (" gamma = 4 , draft = model ", SpecConfig(draft="model", gamma=4)),
        ("random=gumbel,draft=model,model=org/d,quant=int8", SpecConfig("model", "org/d", "int8", random="gumbel")),
        ("ngram=1-2-3", SpecConfig(ngram=(3, 2, 1))),
        (
            "draft=model,stop_below=none,tree=dynamic-6-4-16",
            SpecConfig("model", stop_below=None, tree="dynamic-6-4-16"),
        ),
        ("draft=model,model=a=b", SpecConfig(draft="model", model="a=b")),
        ("draft=model+history,gamma=2,choose_depth=4", SpecConfig("model+history", gamma=2, choose_depth=4)),
    ],
)
def test_parse(text, expected):
    assert SpecConfig.parse(text) == expected


def test_printed_form_is_canonical():
    assert str(SpecConfig()) == "draft=ngram,gamma=auto,verify=token,random=auto"
    cfg = SpecConfig(draft="self", quant="int4", ngram=(1, 2), tree="4-2", verify="iid", runner="fast")
    assert str(cfg) == "draft=self,quant=int4,ngram=2-1,gamma=auto,tree=4-2,verify=iid,random=auto,runner=fast"
    assert str(SpecConfig(draft="history")) == "draft=history,gamma=auto,verify=deterministic,random=auto"
    assert list(SpecConfig.__dataclass_fields__) == list(KEYS)


def test_defaults_resolve_the_verification_rule():
    assert SpecConfig().verify == "token"
    assert SpecConfig(tree="2-2").verify == "deterministic"
    assert SpecConfig(draft="history").verify == "deterministic"
    assert SpecConfig(draft="self+history", quant="int4", gamma=3).verify == "mixed"
    cfg = SpecConfig(draft="model", tree="3-1", verify="without_replacement")
    assert cfg.tree_spec == TreeSpec.parse("3-1", "without_replacement") and cfg.chain_rule == "token"
    assert SpecConfig(draft="history").tree_spec == TreeSpec(dynamic=True, depth=8, topk=3, budget=16)


# --- every validation error -----------------------------------------------------------------------------------

ERRORS = [
    ("draft=medusa", "draft", r"draft must be one of ngram, none, model, self, history"),
    ("draft=model,model=a,b", None, r"each item of a spec is key=value"),
    ("speed=3", None, r"unknown key 'speed' in spec 'speed=3'; the keys are draft, model"),
    ("gamma", None, r"each item of a spec is key=value"),
    ("gamma=2,,draft=none", None, r"each item of a spec is key=value"),
    ("gamma=2,gamma=3", "gamma", r"gamma is given twice"),
    ("quant=int2,draft=self", "quant", r"quant must be int8, int4 or none, got 'int2'"),
    ("ngram=3-x", "ngram", r"ngram must be integers >= 1"),
    ("ngram=0", "ngram", r"ngram must be integers >= 1"),
    ("stop_below=2", "stop_below", r"stop_below must be a number in \[0, 1\] or none"),
    ("stop_below=x", "stop_below", r"stop_below must be a number in \[0, 1\] or none, got 'x'"),
    ("draft=history,min_share=-1", "min_share", r"min_share must be a number in \[0, 1\], got -1"),
    ("draft=model+history,gamma=2,choose_depth=0", "choose_depth", r"choose_depth must be an integer >= 1 or none"),
    ("gamma=65", "gamma", r"gamma must be auto or an integer from 0 to 64, got 65"),
    ("gamma=x", "gamma", r"gamma must be auto or an integer from 0 to 64, got 'x'"),
    ("max_gamma=0", "max_gamma", r"max_gamma must be an integer from 1 to 64"),
    ("jump=65", "jump", r"jump must be an integer from 0 to 64, got 65"),
    ("jump=x", "jump", r"jump must be an integer from 0 to 64, got 'x'"),
    ("verify=greedy", "verify", r"verify must be one of token, block, deterministic, iid, without_replacement, mixed"),
    ("random=keyed", "random", r"random must be one of auto, stream, position, gumbel"),
    ("runner=turbo", "runner", r"runner must be one of auto, fast, hf, llamacpp"),
    ("tree=4-x", "tree", r"tree=4-x: tree spec must look like"),
    ("tree=0-1", "tree", r"tree=0-1: a static tree needs widths >= 1"),
    ("tree=64-64", "tree", r"at most 256"),
    ("draft=model,tree=dynamic-2-2-4,verify=iid", "tree", r"tree=dynamic-2-2-4: .*biases sampled children"),
    ("model=org/d", "model", r"model names a draft model: it needs draft=model or draft=model\+history"),
    ("quant=int4", "quant", r"quant applies to a draft model or draft=self, not to draft=ngram"),
    ("draft=none,quant=int8", "quant", r"quant applies to a draft model or draft=self, not to draft=none"),
    ("draft=self", "draft", r"draft=self needs quant \(int8 or int4\): an unquantized copy"),
    ("draft=self+history,gamma=2", "draft", r"draft=self\+history needs quant"),
    ("draft=none,tree=2-1", "tree", r"a tree needs a drafter \(draft=model, draft=self or draft=ngram\)"),
    ("draft=custom,tree=2-1", "tree", r"pass the tree to the Proposer itself"),
    ("draft=history,tree=4-2", "tree", r"history tries are dynamic trees"),
    ("min_share=0.5", "min_share", r"min_share applies to history drafting, not to draft=ngram"),
    ("draft=history,choose_depth=2", "choose_depth", r"choose_depth applies to a draft model with history"),
    ("draft=model+history", "gamma", r"a draft model with history drafts a chain of fixed length: gamma must be"),
    ("draft=model+history,gamma=0", "gamma", r"gamma must be an integer >= 1, got 0"),
    ("tree=2-1,verify=block", "verify", r"verify=block verifies chains; a tree is verified by verify=deterministic"),
    ("draft=model,tree=2-1,verify=token", "verify", r"verify=token verifies chains; a tree is verified by"),
    ("draft=history,verify=block", "verify", r"verify=block verifies chains; draft=history drafts trees"),
    ("verify=iid", "verify", r"verify=iid is a tree rule: it needs tree"),
    ("tree=2-2,verify=iid", "verify", r"prompt-lookup trees are deterministic \(one-hot q\)"),
    ("draft=model,verify=mixed", "verify", r"verify=mixed does not apply to draft=model: use token or block"),
    ("draft=model+history,gamma=2,verify=deterministic", "verify", r"does not apply to draft=model\+history"),
    ("random=position", "random", r"random=position needs a draft model drafting chains .* not draft=ngram"),
    ("draft=model,tree=2-1,random=position", "random", r"random=position needs a draft model .* with a tree"),
    ("draft=history,random=position", "random", r"random=position needs a draft model"),
    ("draft=model,verify=block,random=position", "random", r"random=position verifies token-wise \(verify=token\)"),
]


@pytest.mark.parametrize("text, key, message", ERRORS, ids=[e[0] for e in ERRORS])
def test_every_invalid_spec_is_a_clear_error(text, key, message):
    with pytest.raises(SpecError, match=message) as err:
        SpecConfig.parse(text)
    assert err.value.key == key
    assert isinstance(err.value, ValueError)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(model=""), r"model must be a path or hub id without commas"),
        (dict(draft="model", model="a,b"), r"model must be a path or hub id without commas"),
        (dict(ngram=()), r"ngram must be integers >= 1"),
        (dict(gamma=True), r"gamma must be auto or an integer"),
        (dict(tree=TreeSpec.parse("2-2")), r"tree must be a shape such as 4-2-2-1"),
        (dict(stop_below=float("nan")), r"stop_below must be a number in \[0, 1\]"),
    ],
)
def test_constructor_values_are_checked_like_parsed_ones(kwargs, message):
    with pytest.raises(SpecError, match=message):
        SpecConfig(**kwargs)


def test_errors_survive_pickling():
    import pickle

    with pytest.raises(SpecError) as err:
        SpecConfig.parse("draft=self")
    again = pickle.loads(pickle.dumps(err.value))
    assert str(again) == str(err.value) and again.key == "draft"


def test_the_generator_takes_a_config_only(tiny_target):
    with pytest.raises(ValueError, match=r"config must be a SpecConfig \(SpecConfig.parse reads its string form\)"):
        SpeculativeGenerator(tiny_target, None, config="draft=none")


# --- one set of defaults, every entry point --------------------------------------------------------------------


def test_defaults_are_one_set_across_entry_points(tiny_target):
    """The generator, the CLI (generate, serve), bench e2e and the certifier build SpecConfig's defaults; the rollout
    engine, the benchmark and the certifier differ only in the defaults they document (RL_DEFAULTS, E2EConfig.gamma,
    CERTIFY_DEFAULTS)."""
    from verispec.bench import e2e
    from verispec.certify.methods import CERTIFY_DEFAULTS, MethodSpec
    from verispec.cli import build_parser
    from verispec.cli.options import spec_config
    from verispec.rollout import RolloutEngine
    from verispec.rollout.engine import RL_DEFAULTS

    default = SpecConfig()
    assert SpeculativeGenerator(tiny_target).config == default
    assert spec_config(build_parser().parse_args(["generate", "a b"])) == default
    assert spec_config(build_parser().parse_args(["serve"])) == default
    assert RolloutEngine(tiny_target).config == RL_DEFAULTS and RL_DEFAULTS.random == "stream"
    bench = e2e.E2EConfig()
    # benchmarks and certificates seed every request: they run the stream unless they name random (auto would
    # couple every one of them)
    assert e2e.method_config("verispec:", bench) == SpecConfig(gamma=bench.gamma, random="stream")
    assert e2e.method_config("verispec-ngram", bench) == SpecConfig(gamma=bench.gamma, random="stream")
    assert e2e.method_config("verispec:draft=ngram,gamma=auto,random=auto", bench) == default
    assert MethodSpec().config == SpecConfig(**CERTIFY_DEFAULTS)
    assert CERTIFY_DEFAULTS == {"gamma": 4, "random": "stream"}
    certify = build_parser().parse_args(["certify", "generate"])
    assert spec_config(certify, CERTIFY_DEFAULTS) == MethodSpec().config


@pytest.mark.parametrize(
    "alias, spec",
    [
        ("verispec-plain", "draft=none,gamma=auto,verify=token,random=stream"),
        ("verispec-draft", "draft=model,gamma=4,verify=token,random=stream"),
        ("verispec:draft=model,gamma=2,verify=block", "draft=model,gamma=2,verify=block,random=stream"),
        ("verispec:draft=model,random=position", "draft=model,gamma=4,verify=token,random=position"),
        ("verispec:draft=model,gamma=3,random=gumbel", "draft=model,gamma=3,verify=token,random=gumbel"),
        ("verispec-self", "draft=self,quant=int4,gamma=4,verify=token,random=stream"),
        (
            "verispec:draft=model,tree=4-2,gamma=auto,verify=iid",
            "draft=model,gamma=auto,tree=4-2,verify=iid,random=stream",
        ),
        (
            "verispec:draft=ngram,tree=2-1,gamma=auto",
            "draft=ngram,gamma=auto,tree=2-1,verify=deterministic,random=stream",
        ),
        ("verispec:draft=model,verify=block", "draft=model,gamma=4,verify=block,random=stream"),
    ],
)
def test_bench_method_names_are_specs(alias, spec):
    from verispec.bench import e2e

    assert str(e2e.method_config(alias, e2e.E2EConfig())) == spec


def test_bench_run_keys_fill_methods_that_do_not_name_them():
    from verispec.bench import e2e

    cfg = e2e.E2EConfig(spec="random=gumbel,max_gamma=16", gamma="auto", runner="hf", draft_quant="int8")
    assert e2e.method_config("verispec:draft=model,gamma=2", cfg) == SpecConfig(
        draft="model", quant="int8", gamma=2, max_gamma=16, random="gumbel", runner="hf"
    )
    assert e2e.method_config("verispec:draft=ngram,random=stream", cfg).random == "stream"
    assert e2e.method_config("hf-assisted", cfg) is None
    for bad, message in [
        ("verispec:draft=history", "bench e2e runs draft=none, ngram, model"),
        ("verispec:speed=1", "unknown key 'speed'"),
        ("verispec-draft@2", "unknown method"),  # the old aliases are gone: verispec:SPEC is the one spelling
        ("verispec-ngram/block", "unknown method"),
    ]:
        with pytest.raises(ValueError, match=message):
            e2e.method_config(bad, e2e.E2EConfig())
    with pytest.raises(ValueError, match="not keys of the run's spec"):
        e2e.E2EConfig(spec="draft=model")


def test_a_bench_method_may_name_its_own_draft_model():
    """verispec:draft=model,model=PATH drafts with PATH (loaded beside --draft, once per path), not the run's draft."""
    from verispec.bench import e2e

    methods = (
        "verispec:draft=model,model=a/b.gguf,cross_vocab=slem",
        "verispec:draft=model,model=a/b.gguf",
        "verispec-draft",
    )
    cfg = e2e.E2EConfig(methods=methods)
    assert e2e.method_config(methods[0], cfg).model == "a/b.gguf"
    assert e2e.method_models(methods, cfg) == ["a/b.gguf"]
    assert not e2e._needs_draft(methods[1], e2e.method_config(methods[1], cfg))
    assert e2e._needs_draft("verispec-draft", e2e.method_config("verispec-draft", cfg))


# --- the drafter object beside the config ----------------------------------------------------------------------

PROMPTS = [[3, 4, 5, 3, 4, 5, 3], [7, 8, 9, 10]]


def _tokens(gen, temperature: float) -> list[list[int]]:
    params = [SamplingParams(temperature=temperature, seed=11 + i) for i in range(len(PROMPTS))]
    return [c.token_ids for c in gen.generate(PROMPTS, params, max_new_tokens=12, ignore_eos=True)]


def test_the_drafter_object_must_fit_the_config(tiny_target, tiny_noisy):
    from verispec.drafting import PromptLookupProposer
    from verispec.drafting.history import RolloutHistory
    from verispec.rollout import RolloutEngine

    with pytest.raises(ValueError, match="a draft model was given as draft, but the config drafts with draft=ngram"):
        SpeculativeGenerator(tiny_target, tiny_noisy, config=SpecConfig())
    with pytest.raises(ValueError, match="draft=model drafts with a draft model: pass it as draft"):
        SpeculativeGenerator(tiny_target, None, config=SpecConfig(draft="model"))
    with pytest.raises(ValueError, match="builds its own drafter: a given Proposer is draft=custom"):
        SpeculativeGenerator(tiny_target, PromptLookupProposer(), config=SpecConfig())
    with pytest.raises(ValueError, match="draft=history drafts from a RolloutHistory"):
        SpeculativeGenerator(tiny_target, None, config=SpecConfig(draft="history"))
    custom = SpeculativeGenerator(tiny_target, PromptLookupProposer((2, 1)), config=SpecConfig(draft="custom", gamma=2))
    ngram = SpeculativeGenerator(tiny_target, config=SpecConfig(gamma=2, ngram=(2, 1)))
    assert _tokens(custom, 1.0) == _tokens(ngram, 1.0)
    shared = RolloutHistory()
    assert RolloutEngine(tiny_target, history=shared, config=SpecConfig(draft="history", gamma=4)).history is shared


def test_the_spec_grammar_is_documented_in_the_generating_guide():
    """The docs' Generating guide (docs/guides/generating.md) shows a command with --spec and names every key of
    the string form."""
    from pathlib import Path

    guide = Path(__file__).resolve().parents[2] / "docs" / "guides" / "generating.md"
    text = guide.read_text()
    assert re.search(r"verispec generate .*--spec \w+=", text), "no `verispec generate ... --spec key=value` example"
    assert all(re.search(rf"`{key}`", text) for key in KEYS), [k for k in KEYS if f"`{k}`" not in text]
