"""Every option that can be checked without a model is checked before one loads: the loader is replaced by one
that raises, so an error that arrives only after loading fails these tests. Messages name the flag."""

from __future__ import annotations

import argparse
import re
import socket

import pytest

from tests.helpers.server import free_port
from verispec.cli import main


class ModelLoaded(Exception):
    pass


@pytest.fixture(autouse=True)
def no_model_loads(monkeypatch):
    import verispec.model.loading as loading

    def refuse(*args, **kwargs):
        raise ModelLoaded("a model was loaded before the options were checked")

    monkeypatch.setattr(loading, "load_model", refuse)


def usage_error(argv, capsys) -> str:
    """Run the command; it must exit with status 2, no traceback; return the last line of stderr."""
    try:
        code = main(argv)
    except SystemExit as e:
        code = e.code
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err, err
    return err.strip().splitlines()[-1]


GAMMA = ["-3", "65", "1000000", "abc", "2.5"]  # (0: no drafts, as --spec gamma=0)

SPECULATION = [  # options of generate and serve
    (["--tree", "0-1"], r"--tree 0-1: .*widths >= 1"),
    (["--tree", "dynamic-x"], r"--tree dynamic-x: .*must look like"),
    (["--tree", "dynamic-2-2-4", "--spec", "verify=iid"], r"--tree dynamic-2-2-4: .*'deterministic'"),
    (["--tree", "64-64"], r"--tree 64-64: .*at most 256"),
    (["--spec", "verify=iid"], r"--spec verify=iid: verify=iid is a tree rule: it needs --tree"),
    (["--tree", "2-1", "--spec", "verify=block"], r"--spec verify=block: verify=block verifies chains; a --tree"),
    (["--spec", "random=position"], r"random=position needs a draft model .* not --draft ngram"),  # the default
    (["--draft", "none", "--tree", "2-1"], r"--tree needs a drafter \(--draft PATH, --draft self or --draft ngram\)"),
    (["--draft", "ngram", "--spec", "quant=int4"], r"--spec quant=int4: quant applies to a draft model"),
    (["--draft", "self"], r"^verispec: error: --draft self needs --spec quant \(int8 or int4\)"),
    (["--spec", "quant=int2"], r"--spec quant=int2: quant must be int8, int4 or none"),
    (["--spec", "runner=turbo"], r"runner must be one of auto, fast, hf, llamacpp"),
    (["--threads", "0"], r"--threads: must be an integer >= 1"),
    (["--spec", "max_gamma=0"], r"max_gamma must be an integer from 1 to 64"),
    (["--spec", "ngram=3-x"], r"ngram must be integers >= 1"),
    (["--dtype", "int3"], r"--dtype: unknown dtype"),
    (["--spec", "gamma=x"], r"--spec gamma=x: gamma must be auto or an integer from 0 to 64, got 'x'"),
    (["--spec", "draft=ngram,speed=9"], r"--spec draft=ngram,speed=9: unknown key 'speed'"),
    (["--spec", "gamma=2,gamma=3"], r"gamma is given twice"),
    (["--spec", "draft=none", "--draft", "ngram"], r"--draft ngram disagrees with --spec draft=none: give it once"),
    (["--spec", "tree=2-1", "--tree", "2-2"], r"--tree 2-2 disagrees with --spec tree=2-1"),
    (["--spec", "gamma=4", "--gamma", "3"], r"--gamma 3 disagrees with --spec gamma=4"),
    (["--spec", "model=a/b", "--draft", "c/d"], r"--draft c/d disagrees with --spec model=a/b"),
    (["--spec", "draft=self"], r"--spec draft=self: draft=self needs quant \(int8 or int4\)"),
    (["--spec", "draft=ngram,random=position"], r"--spec .*: random=position needs a draft model"),
    (["--spec", "draft=history"], r"draft=history is drafted by objects the command line cannot give"),
    (["--spec", "draft=model"], r"draft=model needs the draft model: --draft PATH, or model=PATH in --spec"),
    # the llama.cpp runner's refusals (docs/guides/llamacpp.md), named as typed
    (
        ["--spec", "runner=llamacpp,draft=self,quant=int4"],
        r"^verispec: error: --spec runner=llamacpp,draft=self,"
        r"quant=int4: draft=self quantizes the target's torch weights \(quant=int4\), but runner=llamacpp runs a GGUF",
    ),
    (
        ["--draft", "self", "--spec", "quant=int4,runner=llamacpp"],
        r"--spec quant=int4,runner=llamacpp: --draft self "
        r"quantizes",
    ),
    (["--spec", "runner=llamacpp", "--device", "cuda"], r"runner=llamacpp runs on the CPU here, not on --device cuda"),
    (
        ["--spec", "runner=llamacpp", "--draft", "mtp"],
        r"--draft mtp reads the target's hidden states, which "
        r"runner=llamacpp does not expose",
    ),
    (["--spec", "runner=llamacpp", "--target", "org/model"], r"--target org/model: --spec runner=llamacpp runs GGUF"),
    (["--spec", "runner=llamacpp", "--draft", "org/draft"], r"--draft org/draft: --spec runner=llamacpp runs GGUF"),
    # files that are not there (a hub id, org/name, is left to the loader)
    (["--draft", "/no/such/draft.gguf"], r"^verispec: error: --draft /no/such/draft.gguf: no such file or directory"),
    (["--draft", "./no-such-draft"], r"--draft ./no-such-draft: no such file or directory"),
    (["--spec", "draft=model,model=~/no/such"], r"--spec model=~/no/such: no such file or directory"),
    (["--target", "no-such.gguf"], r"--target no-such.gguf: no such file or directory"),
    # the shorthands --stop-below and --max-gamma
    (["--stop-below", "2"], r"--stop-below: must be a number in \[0, 1\] or none, got '2'"),
    (["--stop-below", "0.2"], r"--stop-below 0.2: .* not apply to the default drafter \(draft=ngram\)"),
    (["--spec", "gamma=2", "--spec", "verify=block"], r"--spec given twice: put every key in one --spec"),
    (["--draft", "ngram", "--stop-below", "0.2"], r"--stop-below 0.2: .* not apply to --draft ngram$"),
    (["--draft", "m/d", "--tree", "2-1", "--stop-below", "0.2"], r"--stop-below 0.2: .* --draft m/d with a tree"),
    (["--draft", "m/d", "--stop-below", "0.2", "--spec", "stop_below=0.3"], r"--stop-below 0.2 disagrees with --spec"),
    (["--max-gamma", "65"], r"--max-gamma: must be an integer from 1 to 64"),
    (["--gamma", "4", "--max-gamma", "16"], r"--max-gamma 16 caps what --gamma auto picks"),
    (["--max-gamma", "16", "--spec", "max_gamma=8"], r"--max-gamma 16 disagrees with --spec max_gamma=8"),
] + [(["--gamma", g], rf"--gamma: must be auto or an integer from 0 to 64 .*got '{g}'") for g in GAMMA]

SAMPLING = [
    (["--temperature", "-1"], r"^verispec: error: --temperature must be >= 0"),
    (["--temperature", "nan"], r"--temperature must be finite"),
    (["--temperature", "hot"], r"--temperature: invalid float value"),
    (["--top-p", "2"], r"--top-p must be in \(0, 1\]"),
    (["--top-p", "0"], r"--top-p must be in \(0, 1\]"),
    (["--top-k", "-2"], r"--top-k must be an integer >= 0"),
    (["--min-p", "1.5"], r"--min-p must be in \[0, 1\]"),
]
GENERATE_ONLY = [
    (["--repetition-penalty", "0"], r"--repetition-penalty must be in \[0.01, 100\]"),
    (["--presence-penalty", "3"], r"--presence-penalty must be in \[-2, 2\]"),
    (["--frequency-penalty", "-2.5"], r"--frequency-penalty must be in \[-2, 2\]"),
    (["--seed", "-1"], r"--seed: must be an integer from 0"),
    (["--max-new-tokens", "0"], r"--max-new-tokens: must be an integer >= 1"),
    # structured output: parsed without a tokenizer, before any model loads
    (["--regex", "("], r"^verispec: error: --regex: the regex '\(' constraint does not compile: .*parenthesis"),
    (["--json-object", "--stop", "x"], r"--stop cannot be combined with --json-object"),
    (["--json-schema", "/no/such/schema.json"], r"--json-schema: cannot read /no/such/schema.json"),
]


@pytest.mark.parametrize("extra,msg", SPECULATION + SAMPLING + GENERATE_ONLY)
def test_generate_checks_options_before_loading(extra, msg, capsys):
    assert re.search(msg, usage_error(["generate", "a b", *extra], capsys))


REMOVED = [  # the speculation flags of earlier versions: --spec keys now, the flags refused as any unknown option
    ["--seeding", "position"],
    ["--coupling", "gumbel"],
    ["--tree-rule", "iid"],
    ["--verify", "block"],
    ["--draft-quant", "int4"],
    ["--runner", "hf"],
    ["--ngram-sizes", "2,1"],
    ["--cross-vocab", "slem"],
]


@pytest.mark.parametrize("command", [["generate", "a b"], ["serve"]])
@pytest.mark.parametrize("removed", REMOVED, ids=[r[0] for r in REMOVED])
def test_the_older_speculation_flags_are_refused(command, removed, capsys):
    error = usage_error([*command, *removed], capsys)
    assert f"unrecognized arguments: {' '.join(removed)}; {removed[0]} is --spec " in error


@pytest.mark.parametrize(
    "extra,msg",
    [
        *SPECULATION,
        (["--port", "0"], r"--port: must be an integer from 1 to 65535"),
        (["--port", "70000"], r"--port: must be an integer from 1 to 65535"),
        (["--max-batch", "0"], r"--max-batch: must be an integer >= 1"),
        (["--max-queue", "-1"], r"--max-queue: must be an integer >= 0"),
        (["--log-level", "loud"], r"--log-level: invalid choice"),
    ],
)
def test_serve_checks_options_before_loading(extra, msg, capsys):
    assert re.search(msg, usage_error(["serve", *extra], capsys))


@pytest.mark.parametrize(
    "extra,msg",
    [
        (["--tree", "0-1"], r"--tree 0-1:"),
        (["--spec", "verify=iid"], r"verify=iid is a tree rule: it needs --tree"),
        (["--method", "hf", "--tree", "2-1"], r"--tree applies to --method verispec"),
        (["--method", "hf", "--spec", "draft=ngram,tree=2-1"], r"--tree applies to --method verispec"),
        (["--spec", "gamma=auto", "--gamma", "3"], r"--gamma 3 disagrees with --spec gamma=auto"),
        (["--draft", "self"], r"--draft self needs --spec quant"),
        (["--spec", "quant=int4"], r"--spec quant=int4: quant applies to a draft model"),
        (["--method", "hf-assisted"], r"--method hf-assisted needs --draft"),
        (["--method", "callable"], r"--method callable needs --callable"),
        (["--gamma", "65"], r"--gamma:"),
        (["--threads", "0"], r"--threads: must be an integer >= 1"),
        (["--samples", "5"], r"--samples: must be an integer >= 20"),
        (["--length", "0"], r"--length: must be an integer >= 1"),
        (["--level", "1.5"], r"--level: must be a number in \(0, 1\)"),
        (["--workers", "0"], r"--workers must be >= 1"),
        (["--draft-dtype", "int3"], r"--draft-dtype: unknown dtype"),
        (["--prompts", "/no/such/prompts.jsonl"], r"cannot read prompts from /no/such/prompts.jsonl"),
        (["--prompt", ""], r"a prompt is empty"),
        (["--inject", "nope"], r"--inject nope: unknown verifier"),
        (["--inject", "tree_stale_residual"], r"--inject tree_stale_residual: .*needs a tree"),
        (["--inject", "swap_p_q", "--tree", "2-1"], r"--inject swap_p_q: .*must be a tree bug"),
        (["--inject", "block_first_rejection"], r"--inject block_first_rejection: .*needs verify='block'"),
        (["--spec", "verify=block", "--inject", "swap_p_q"], r"--inject swap_p_q: .*must be a block bug"),
        (["--spec", "verify=block", "--tree", "2-1"], r"verify=block verifies chains"),
        (["--spec", "verify=block", "--method", "hf"], r"verify='block' applies to method 'verispec'"),
        *SAMPLING,
    ],
)
def test_certify_generate_checks_options_before_loading(extra, msg, capsys, tmp_path):
    assert re.search(msg, usage_error(["certify", "generate", "--out", str(tmp_path), *extra], capsys))


@pytest.mark.parametrize(
    "extra,msg",
    [
        (["--temperature", "0"], r"--temperature must be > 0 for the study"),
        (["--top-p", "2"], r"--top-p must be in"),
        (["--variants", "exact,nope"], r"--variants: unknown variant\(s\) nope"),
        (["--draft", "ngram"], r"--draft takes a draft model"),
        (["--certify-samples", "5"], r"--certify-samples must be 0 \(off\) or >= 20"),
        (["--gamma", "auto"], r"--gamma: must be an integer from 1 to 64"),
        (["--contexts", "0"], r"--contexts: must be an integer >= 1"),
    ],
)
def test_certify_study_checks_options_before_loading(extra, msg, capsys, tmp_path):
    argv = ["certify", "study", "--draft", "some/draft", "--out", str(tmp_path), *extra]
    assert re.search(msg, usage_error(argv, capsys))


@pytest.mark.parametrize(
    "extra,msg",
    [
        (["--gamma", "1000000"], r"--gamma:"),
        (["--temperatures", "0,-1"], r"--temperatures: each temperature must be >= 0"),
        (["--temperatures", "0,x"], r"--temperatures: must be comma-separated numbers"),
        (["--methods", "verispec-plain,nope"], r"--methods: unknown method 'nope'"),
        (["--methods", "verispec:draft=model,tree=0-1"], r"--methods: .*widths >= 1"),
        (["--methods", "verispec-draft@2/block"], r"--methods: unknown method 'verispec-draft@2/block'"),
        (["--methods", "verispec-ngram/block"], r"--methods: unknown method 'verispec-ngram/block'"),
        (["--draft", "self"], r"--draft takes a draft model"),
        (["--draft-quant", "int4"], r"--draft-quant quantizes the --draft model"),
        (["--threads", "0"], r"--threads: must be an integer >= 1"),
        (["--batch", "0"], r"--batch: must be an integer >= 1"),
        (["--self-quant", "int2"], r"--self-quant: invalid choice"),
        ([], r"cannot read prompts from /no/such/prompts.jsonl"),
        (["--runner", "llamacpp", "--device", "cuda"], r"--runner llamacpp runs on the CPU here, not on --device cuda"),
        (["--runner", "llamacpp", "--draft", "a/b", "--draft-quant", "int4"], r"--draft-quant int4 quantizes torch"),
        (["--runner", "lamacpp"], r"--runner: invalid choice: 'lamacpp' .*; did you mean 'llamacpp'\?"),
    ],
)
def test_bench_e2e_checks_options_before_loading(extra, msg, capsys):
    argv = ["bench", "e2e", "--prompts", "/no/such/prompts.jsonl", *extra]
    assert re.search(msg, usage_error(argv, capsys))


@pytest.mark.parametrize("flag", ["--target", "--draft"])
def test_bench_commands_check_model_files_before_loading(flag, capsys, tmp_path):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "a", "category": "c"}\n')
    msg = usage_error(["bench", "e2e", "--prompts", str(prompts), flag, "./no-such.gguf"], capsys)
    assert msg == f"verispec: error: {flag} ./no-such.gguf: no such file or directory"


@pytest.mark.parametrize(
    "flag,text,msg",
    [
        ("--grammar", 'root ::= "a" | ', r"--grammar: the grammar .* does not compile: EBNF parser error"),
        ("--grammar", "root ::= missing", r"--grammar: .*Rule \"missing\" is not defined"),
        ("--json-schema", '{"type": "nope"}', r"--json-schema: the json_schema .* does not compile"),
        ("--json-schema", "{not json", r"--json-schema: the JSON schema is not valid JSON"),
    ],
)
def test_structured_output_files_are_parsed_before_loading(flag, text, msg, capsys, tmp_path):
    (tmp_path / "c").write_text(text)
    assert re.search(msg, usage_error(["generate", "a b", flag, str(tmp_path / "c")], capsys))


@pytest.mark.parametrize(
    "extra,msg",
    [
        (["--paths", "fast,turbo"], r"--paths: unknown path\(s\) turbo"),
        (["--max-k", "0"], r"--max-k: must be an integer >= 1"),
        (["--threads", "0"], r"--threads: must be an integer >= 1"),
    ],
)
def test_bench_runner_checks_options_before_loading(extra, msg, capsys):
    assert re.search(msg, usage_error(["bench", "runner", *extra], capsys))


@pytest.mark.parametrize(
    "argv",
    [
        ["generate", "a b", "--draft", "self", "--spec", "quant=int4", "--tree", "dynamic-3-2-6", "--gamma", "64"],
        ["serve", "--draft", "some/draft", "--spec", "quant=int8,max_gamma=16", "--gamma", "auto"],
        ["generate", "a b", "--spec", "draft=model,model=some/draft,gamma=4,verify=block,random=gumbel"],
        ["certify", "generate", "--target", "some/target", "--method", "hf-assisted", "--draft", "some/draft"],
        ["certify", "study", "--target", "some/target", "--draft", "some/draft", "--certify-samples", "20"],
        ["bench", "runner", "--paths", "fast"],
        ["generate", "a b", "--regex", "[a-z]+", "--gamma", "0"],
        ["generate", "a b", "--draft", "org/draft", "--stop-below", "0.1", "--max-gamma", "16"],
        ["generate", "a b", "--draft", "mtp", "--stop-below", "none", "--spec", "runner=hf"],
    ],
)
def test_valid_options_reach_the_loader(argv, tmp_path):
    """The other side of the tests above: options that pass every check go on to load a model."""
    if argv[0] == "certify":
        argv = [*argv, "--out", str(tmp_path)]
    if argv[0] == "serve":  # a port free now (the default, 8000, may be another program's)
        argv = [*argv, "--port", str(free_port())]
    with pytest.raises(ModelLoaded):
        main(argv)


@pytest.mark.parametrize(
    "argv, spec",
    [
        ([], "draft=ngram,gamma=auto,verify=token,random=auto"),
        (["--draft", "self", "--spec", "quant=int4"], "draft=self,quant=int4,gamma=auto,verify=token,random=auto"),
        (["--draft", "m/d", "--gamma", "3"], "draft=model,model=m/d,gamma=3,verify=token,random=auto"),
        (["--tree", "2-1"], "draft=ngram,gamma=auto,tree=2-1,verify=deterministic,random=auto"),
        (["--spec", "draft=model", "--draft", "m/d"], "draft=model,model=m/d,gamma=auto,verify=token,random=auto"),
        (["--draft", "m/d", "--spec", "model=m/d"], "draft=model,model=m/d,gamma=auto,verify=token,random=auto"),
        (
            ["--tree", "dynamic-4-2-8", "--spec", "tree=dynamic-4-2-8"],
            "draft=ngram,gamma=auto,tree=dynamic-4-2-8,verify=deterministic,random=auto",
        ),
        (
            ["--spec", "gamma=4,random=stream,runner=hf", "--gamma", "4"],
            "draft=ngram,gamma=4,verify=token,random=stream,runner=hf",
        ),
        (["--gamma", "0"], "draft=ngram,gamma=0,verify=token,random=auto"),  # as --spec gamma=0: the same config
        (["--spec", "gamma=0"], "draft=ngram,gamma=0,verify=token,random=auto"),
        (["--max-gamma", "16"], "draft=ngram,gamma=auto,max_gamma=16,verify=token,random=auto"),
        (
            ["--draft", "m/d", "--stop-below", "0.1"],
            "draft=model,model=m/d,stop_below=0.1,gamma=auto,verify=token,random=auto",
        ),
        (
            ["--draft", "m/d", "--stop-below", "none"],
            "draft=model,model=m/d,stop_below=none,gamma=auto,verify=token,random=auto",
        ),
        (
            ["--draft", "m/d", "--stop-below", "0.3", "--spec", "stop_below=0.30"],
            "draft=model,model=m/d,gamma=auto,verify=token,random=auto",
        ),
    ],
)
def test_flags_and_spec_fill_one_config(argv, spec):
    from verispec.cli import build_parser
    from verispec.cli.options import spec_config

    assert str(spec_config(build_parser().parse_args(["generate", "a b", *argv]))) == spec


@pytest.mark.parametrize("command", [["bench", "e2e"], ["bench", "rollout"], ["certify", "generate"]])
def test_repeated_prompts_flags_add_up(command):
    """`--prompts a --prompts b c` reads all three files (a second --prompts used to replace the first)."""
    from verispec.cli import build_parser

    args = build_parser().parse_args([*command, "--prompts", "a.jsonl", "--prompts", "b.jsonl", "c.jsonl"])
    assert args.prompts == ["a.jsonl", "b.jsonl", "c.jsonl"]


@pytest.mark.parametrize(
    "extra,pattern",
    [
        (["--history-min-share", "2"], "history_min_share must be in"),
        (["--noise", "-1"], "--noise must be in"),
        (["--methods", "history,nope"], "--methods: choose from"),
        (["--history-tree", "2-2"], "history_tree must be dynamic"),
        (["--methods", "draft"], "need --draft PATH"),
    ],
)
def test_bench_rollout_options_are_checked_before_loading(extra, pattern, capsys):
    argv = ["bench", "rollout", "--prompts", "p.jsonl", "--methods", "plain,history", *extra]  # the last --methods wins
    assert re.search(pattern, usage_error(argv, capsys))


def test_runner_llamacpp_without_the_extra_says_how_to_install(monkeypatch, capsys):
    import verispec.model.llamacpp as llamacpp

    monkeypatch.setattr(llamacpp, "llamacpp_available", lambda: False)
    msg = usage_error(["generate", "a b", "--spec", "runner=llamacpp"], capsys)
    assert "--spec runner=llamacpp" in msg and 'pip install -e ".[llamacpp]"' in msg


@pytest.mark.parametrize("command", [["bench", "rollout"], ["bench", "acceptance"]])
def test_commands_that_need_torch_models_offer_no_llamacpp_runner(command, capsys):
    assert "invalid choice: 'llamacpp'" in usage_error([*command, "--runner", "llamacpp"], capsys)


def test_auto_keeps_torch_where_llamacpp_cannot_serve(monkeypatch):
    import verispec.model.llamacpp as llamacpp
    from verispec.cli.options import backend_for

    monkeypatch.setattr(llamacpp, "llamacpp_available", lambda: True)
    args = argparse.Namespace(runner="auto", device="cpu", dtype="float32", draft="ngram")
    assert backend_for("m.gguf", args) == "llamacpp" and backend_for("model-dir", args) == "torch"
    for change in (dict(draft="self"), dict(dtype="bfloat16"), dict(runner="fast"), dict(torch_only=True)):
        assert backend_for("m.gguf", argparse.Namespace(**{**vars(args), **change})) == "torch", change


def test_a_port_in_use_is_refused_before_loading(capsys):
    """`verispec serve --port P` with P taken: one line, exit 2, before the model loads (not uvicorn's Errno 98)."""
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        msg = usage_error(["serve", "--port", str(port)], capsys)
    assert msg == f"verispec: error: --port {port}: cannot listen on 127.0.0.1:{port}: Address already in use"


def test_a_free_port_is_held_while_loading_and_then_released():
    with socket.socket() as probe:  # a port free now
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    with pytest.raises(ModelLoaded):
        main(["serve", "--port", str(port)])
    with socket.socket() as again:  # released when loading failed: nothing keeps it
        again.bind(("127.0.0.1", port))


def test_the_port_is_held_while_the_model_loads(monkeypatch):
    import verispec.model.loading as loading

    seen = []

    def loading_model(*args, **kwargs):  # another server starting now cannot take the port
        with socket.socket() as other, pytest.raises(OSError):
            other.bind(("127.0.0.1", port))
            other.listen()
        seen.append(True)
        raise ModelLoaded

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    monkeypatch.setattr(loading, "load_model", loading_model)
    with pytest.raises(ModelLoaded):
        main(["serve", "--port", str(port)])
    assert seen
