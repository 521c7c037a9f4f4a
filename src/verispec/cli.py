"""`verispec <command>`: the single command-line entry point.

Errors in user input print one line (`verispec: error: ...`) and exit with status 2; never a traceback.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

__all__ = ["main"]


class UsageError(Exception):
    """A user mistake: reported as one line, exit status 2."""


def _cmd_explain(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.table import Table

    from .explain import explain, format_fraction, parse_distribution, to_json

    try:
        p = parse_distribution(args.p, "p")
        q = parse_distribution(args.q, "q")
        labels = [s.strip() for s in args.labels.split(",")] if args.labels else None
        result = explain(p, q, labels, wrong=args.wrong)
    except ValueError as e:
        raise UsageError(str(e)) from None
    if args.json:
        print(json.dumps(to_json(result), indent=2))
        return 0
    f = format_fraction
    table = Table(title="One speculative step: accept t ~ q when u * q(t) < p(t), else draw from (p - q)+ / Z")
    for col in ("token", "p", "q", "a = min(1, p/q)", "accept mass min(p,q)", "residual (p-q)+", "P(output)", "= p?"):
        table.add_column(col, justify="left" if col == "token" else "right")
    for r in result.tokens:
        table.add_row(r.label, f(r.p), f(r.q), "-" if r.accept_prob is None else f(r.accept_prob),
                      f(r.accept_mass), f(r.residual_mass), f(r.output_prob), "yes" if r.output_prob == r.p else "NO")
    console = Console(width=max(100, Console().width))
    console.print(table)
    console.print(f"P(accept) = sum min(p, q) = {f(result.p_accept)}    "
                  f"Z = sum (p - q)+ = {f(result.z)}    (P(reject) = 1 - P(accept) = Z)")
    if result.wrong:
        w = Table(title="Classic mistakes: what the output distribution becomes")
        w.add_column("token")
        w.add_column("p (correct)", justify="right")
        w.add_column("resample from p", justify="right")
        w.add_column("resample from |p - q|", justify="right")
        for r in result.tokens:
            w.add_row(r.label, f(r.p), f(result.wrong["resample_from_p"][r.label]),
                      f(result.wrong["resample_from_abs_diff"][r.label]))
        console.print(w)
    return 0


def _gamma(text: str) -> int | str:
    if text == "auto":
        return "auto"
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--gamma must be an integer >= 0 or 'auto', got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"--gamma must be an integer >= 0 or 'auto', got {text!r}")
    return value


def _add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--target", help="target model: hub id, local directory or .gguf file (default: "
                                    "SmolLM2-135M-Instruct, fetched once into ~/.cache/verispec)")
    p.add_argument("--draft", default="ngram",
                   help="draft model (hub id, directory, .gguf), 'self' (the target's weights quantized: with "
                        "--draft-quant), 'ngram' (prompt lookup, default) or 'none'")
    p.add_argument("--draft-quant", choices=["int8", "int4"],
                   help="weight-only quantize the draft model's linear layers (lossless: q is what it sampled from)")
    p.add_argument("--runner", choices=["auto", "fast", "hf"], default="auto",
                   help="model forward: verispec's fast runner where supported (auto, default), fast, or hf")
    p.add_argument("--gamma", type=_gamma, default="auto", help="drafts per step, or 'auto' (default)")
    p.add_argument("--max-gamma", type=int, default=8, help="upper bound for --gamma auto (default 8)")
    p.add_argument("--ngram-sizes", default="3,2,1", help="prompt-lookup n-gram sizes, longest first (default 3,2,1)")
    _tree_args(p)
    p.add_argument("--dtype", default="float32", help="float32 (default), bfloat16 or float16")
    p.add_argument("--device", default="cpu", help="cpu (default) or cuda")
    p.add_argument("--threads", type=int, help="torch CPU threads")


def _add_sampling_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--temperature", type=float, default=1.0, help="0 = greedy (default 1.0)")
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--min-p", type=float, default=0.0)
    p.add_argument("--repetition-penalty", type=float, default=1.0)
    p.add_argument("--presence-penalty", type=float, default=0.0)
    p.add_argument("--frequency-penalty", type=float, default=0.0)
    p.add_argument("--seed", type=int)


def _sampling_params(args: argparse.Namespace):
    from .sampling import SamplingParams

    try:
        return SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, min_p=args.min_p,
                              repetition_penalty=args.repetition_penalty, presence_penalty=args.presence_penalty,
                              frequency_penalty=args.frequency_penalty, seed=args.seed)
    except ValueError as e:
        raise UsageError(str(e)) from None


def build_generator(args: argparse.Namespace):
    """Load the models named on the command line and build a SpeculativeGenerator."""
    from .engine.generator import SpeculativeGenerator
    from .model.loading import ModelLoadError, load_model

    from .model.loading import DEFAULT_MODEL_NAME

    print(f"loading {args.target or DEFAULT_MODEL_NAME} ...", file=sys.stderr, flush=True)
    try:
        target = load_model(args.target, dtype=args.dtype, device=args.device, threads=args.threads)
        draft = args.draft
        if draft not in ("ngram", "none", "self"):
            draft = load_model(draft, dtype=args.dtype, device=args.device)
        try:
            sizes = tuple(int(n) for n in args.ngram_sizes.split(","))
        except ValueError:
            raise UsageError(f"--ngram-sizes must be comma-separated integers, got {args.ngram_sizes!r}") from None
        return SpeculativeGenerator(target, draft, gamma=args.gamma, max_gamma=args.max_gamma, ngram_sizes=sizes,
                                    runner=args.runner, draft_quant=args.draft_quant, tree=args.tree,
                                    tree_rule=args.tree_rule)
    except (ModelLoadError, ValueError) as e:
        raise UsageError(str(e)) from None


def _cmd_generate(args: argparse.Namespace) -> int:
    params = _sampling_params(args)
    if args.max_new_tokens < 1:
        raise UsageError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    prompt = args.prompt if args.prompt != "-" else sys.stdin.read()
    if not prompt:
        raise UsageError("the prompt is empty")
    gen = build_generator(args)
    kwargs = dict(max_new_tokens=args.max_new_tokens, stop=args.stop or (), chat=args.chat)
    try:
        if args.json:
            out = gen.generate(prompt, params, **kwargs)[0]
            print(json.dumps({"text": out.text, "token_ids": out.token_ids, "finish_reason": out.finish_reason,
                              "logprobs": out.logprobs, "raw_logprobs": out.raw_logprobs,
                              "stats": out.stats.summary() | {"tokens_per_second": gen.last_stats.tokens_per_second}},
                             indent=2))
            return 0
        for event in gen.stream(prompt, params, **kwargs):
            sys.stdout.write(event.delta)
            sys.stdout.flush()
    except ValueError as e:
        raise UsageError(str(e)) from None
    s = gen.last_stats
    draft = gen.proposer.name if gen.proposer is not None else "none"
    print(f"\n[{s.output_tokens} tokens, {s.tokens_per_second:.1f} tok/s, draft={draft}, "
          f"acceptance={s.acceptance_rate:.2f}, tau={s.tau:.2f} tokens/pass, "
          f"draft {s.draft_time:.1f}s / verify {s.verify_time:.1f}s / other {s.other_time:.1f}s]", file=sys.stderr)
    return 0


def _parse_shape(text: str) -> tuple[int, int, int]:
    try:
        b, k, v = (int(x) for x in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"shape must be BxKxV, e.g. 8x4x151936, got {text!r}") from None
    if b < 1 or k < 1 or v < 2:
        raise argparse.ArgumentTypeError(f"shape needs B >= 1, k >= 1, V >= 2, got {text!r}")
    return b, k, v


def _cmd_bench_kernel(args: argparse.Namespace) -> int:
    import torch

    from .bench import kernel

    if args.device.startswith("cuda") and not torch.cuda.is_available():
        raise UsageError("--device cuda asked for, but torch sees no CUDA device")
    shapes = args.shape or list(kernel.DEFAULT_SHAPES)
    rows = kernel.run(shapes, repeats=args.repeats, device=args.device, reference=not args.no_reference)
    print(f"verify_chain on {args.device}, torch {torch.__version__}, {torch.get_num_threads()} threads; "
          "median times; 'x read' = time / one read pass over the inputs")
    print(kernel.to_markdown(rows))
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(rows, fh, indent=2)
        print(f"wrote {args.json}")
    return 0


def _cmd_bench_e2e(args: argparse.Namespace) -> int:

    from .bench import e2e
    from .model.loading import DEFAULT_MODEL_NAME, ModelLoadError, load_model

    try:
        temps = tuple(float(t) for t in args.temperatures.split(","))
        prompts = e2e.load_prompts(args.prompts)
    except (ValueError, OSError) as e:
        raise UsageError(str(e)) from None
    if any(t < 0 for t in temps):
        raise UsageError("--temperatures must be >= 0")
    methods = tuple(args.methods.split(",")) if args.methods else e2e.E2EConfig.methods
    try:
        for m in methods:
            e2e.check_method(m)
    except ValueError as e:
        raise UsageError(str(e)) from None
    cfg = e2e.E2EConfig(max_new_tokens=args.max_new_tokens, temperatures=temps, num_prompts=args.num_prompts,
                        batch=args.batch, gamma=args.gamma, seed=args.seed, chat=not args.no_chat, methods=methods,
                        runner=args.runner, draft_quant=args.draft_quant, self_quant=args.self_quant)
    try:
        print(f"loading {args.target or DEFAULT_MODEL_NAME} ...", file=sys.stderr, flush=True)
        target = load_model(args.target, dtype=args.dtype, device=args.device, threads=args.threads)
        draft = None
        if args.draft not in (None, "none", "ngram"):  # prompt lookup always runs; a model is optional
            print(f"loading {args.draft} ...", file=sys.stderr, flush=True)
            draft = load_model(args.draft, dtype=args.dtype, device=args.device)
        result = e2e.run_e2e(target, draft, prompts, cfg, log=lambda m: print(m, file=sys.stderr, flush=True))
    except (ModelLoadError, ValueError) as e:
        raise UsageError(str(e)) from None
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "e2e.json").write_text(json.dumps(result, indent=2))
    md = e2e.to_markdown(result)
    (out / "e2e.md").write_text(md + "\n")
    e2e.plot(result, out / "e2e.png")
    print(md)
    print(f"wrote {out / 'e2e.json'}, {out / 'e2e.md'}, {out / 'e2e.png'}")
    return 0


def _cmd_bench_runner(args: argparse.Namespace) -> int:
    from .bench import runner as bench_runner
    from .model.loading import DEFAULT_MODEL_NAME, ModelLoadError, load_model, shared_vocab_size

    paths = tuple(args.paths.split(","))
    unknown = set(paths) - set(bench_runner.PATHS)
    if unknown:
        raise UsageError(f"unknown path(s) {sorted(unknown)}; choose from {', '.join(bench_runner.PATHS)}")
    if args.max_k < 1 or args.context < 1 or args.repeats < 1:
        raise UsageError("--max-k, --context and --repeats must be >= 1")
    try:
        print(f"loading {args.model or DEFAULT_MODEL_NAME} ...", file=sys.stderr, flush=True)
        loaded = load_model(args.model, dtype=args.dtype, device=args.device, threads=args.threads)
        res = bench_runner.run(loaded.model, shared_vocab_size(loaded, None), max_k=args.max_k, context=args.context,
                               repeats=args.repeats, paths=paths,
                               log=lambda m: print(m, file=sys.stderr, flush=True))
    except (ModelLoadError, ValueError) as e:
        raise UsageError(str(e)) from None
    res["model"] = loaded.name
    md = bench_runner.to_markdown(res)
    print(f"Model: {loaded.name}\n\n{md}")
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=2))
    return 0


def _cmd_serve(args: argparse.Namespace) -> int:
    import logging

    import uvicorn

    from .model.loading import DEFAULT_MODEL_NAME
    from .serve import create_app

    if args.max_batch < 1 or args.max_queue < 0:
        raise UsageError("--max-batch must be >= 1 and --max-queue >= 0")
    if not 0 < args.port < 65536:
        raise UsageError(f"--port must be in 1..65535, got {args.port}")
    gen = build_generator(args)
    name = args.served_model_name or args.target or DEFAULT_MODEL_NAME
    app = create_app(gen, name, max_batch=args.max_batch, max_queue=args.max_queue)
    logging.basicConfig(level=logging.INFO)
    print(f"serving {name!r} on http://{args.host}:{args.port}/v1 (draft={args.draft}, gamma={args.gamma})",
          file=sys.stderr, flush=True)
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level)
    return 0


def _cmd_certify_kernel(args: argparse.Namespace) -> int:
    from rich.console import Console

    from .certify.bugs import BUGS, TREE_BUGS, TREE_NON_BUGS, broken_tree_verifier, broken_verifier
    from .certify.kernel import (DEFAULT_SAMPLES, certify_kernel, default_cases, load_sampler, verispec_sampler,
                                 write_report)
    from .certify.tree_kernel import (DEFAULT_TREE_SAMPLES, certify_tree_kernel, default_tree_cases,
                                      verispec_tree_sampler)
    from .sampling.tree import TREE_RULES

    if args.sampler and args.inject:
        raise UsageError("--sampler and --inject exclude each other (--inject replaces verispec's own verifier)")
    tree = args.tree is not None
    if args.inject and args.inject not in (TREE_BUGS + TREE_NON_BUGS if tree else BUGS):
        kind = "tree" if tree else "chain"
        raise UsageError(f"--inject {args.inject} is not a {kind} bug; {kind} bugs: "
                         f"{', '.join(TREE_BUGS + TREE_NON_BUGS if tree else BUGS)}")
    try:
        if tree:
            rules = TREE_RULES if args.tree == "all" else (args.tree,)
            sampler = (load_sampler(args.sampler) if args.sampler else broken_tree_verifier(args.inject)
                       if args.inject else verispec_tree_sampler)
            name = args.sampler or (f"verispec.certify.bugs:{args.inject}" if args.inject
                                    else "verispec.sampling.tree:verify_tree")
            cases = [c for c in default_tree_cases(vocab=args.vocab or 6, seed=args.seed) if c.draw in rules]
        else:
            sampler = (load_sampler(args.sampler) if args.sampler else broken_verifier(args.inject) if args.inject
                       else verispec_sampler)
            name = args.sampler or (f"verispec.certify.bugs:{args.inject}" if args.inject
                                    else "verispec.sampling:verify_chain")
            cases = default_cases(vocab=args.vocab or 32, seed=args.seed)
        if args.cases:
            wanted = [c.strip() for c in args.cases.split(",")]
            known = {c.name for c in cases}
            unknown = [w for w in wanted if w not in known]
            if unknown:
                raise UsageError(f"unknown case(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}")
            cases = [c for c in cases if c.name in wanted]
        console = Console(stderr=True)
        with console.status("certifying") as status:
            if tree:
                report = certify_tree_kernel(sampler, rules=rules, cases=cases,
                                             samples=args.samples or DEFAULT_TREE_SAMPLES, level=args.level,
                                             seed=args.seed, name=name, progress=lambda c: status.update(f"case {c}"))
            else:
                report = certify_kernel(sampler, cases=cases, samples=args.samples or DEFAULT_SAMPLES,
                                        level=args.level, seed=args.seed, name=name,
                                        progress=lambda c: status.update(f"case {c}"))
    except ValueError as e:
        raise UsageError(str(e)) from None
    md, js = write_report(report, args.out)
    print(report.to_markdown() if args.verbose else _kernel_summary(report))
    print(f"report: {md}, {js}", file=sys.stderr)
    return 0 if report.passed else 1


def _tree_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tree", help="tree speculation: children per node at each depth (e.g. 4-2-2-1) or "
                                  "dynamic-D-K-M (EAGLE-2: depth D, top-K expansion, budget of M nodes)")
    p.add_argument("--tree-rule", choices=["deterministic", "iid", "without_replacement"],
                   help="how tree children are drawn and verified (default deterministic: the top-k of q)")


def _kernel_summary(report) -> str:
    lines = [f"verispec certify kernel: {report.verdict} ({report.sampler})",
             f"  {len(report.cases)} cases x {report.samples_per_case} steps, {len(report.tests)} chi-square tests, "
             f"Holm family-wise level {report.level}",
             f"  detects any deviation of the first-position law with TV >= {report.headline_tv():.4f} "
             f"(power {report.power}, every case)"]
    for e in report.errors:
        lines.append(f"  error: {e}")
    for t in sorted(report.failing, key=lambda t: t.pvalue)[:10]:
        lines.append(f"  rejected: {t.case} / {t.test}: p = {t.pvalue:.3g} (Holm {t.holm_pvalue:.3g})")
    return "\n".join(lines)


def _certify_prompts(args, tokenizer) -> list[list[int]]:
    from .certify.generate import encode_prompt

    texts = list(args.prompt or [])
    for path in args.prompts or []:
        try:
            rows = [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
        except (OSError, json.JSONDecodeError) as e:
            raise UsageError(f"cannot read prompts from {path}: {e}") from None
        texts += [r["prompt"] for r in rows[: args.num_prompts]]
    if not texts:
        texts = ["def fibonacci(n):"]
    return [encode_prompt(tokenizer, t, args.chat) for t in texts]


def _cmd_certify_generate(args: argparse.Namespace) -> int:
    from .certify.generate import MethodSpec, _load, certify_generate, write_report
    from .model.loading import ModelLoadError
    from .sampling import SamplingParams

    try:
        params = SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, min_p=args.min_p)
        spec = MethodSpec(method=args.method, target=args.target, draft=args.draft, draft_quant=args.draft_quant,
                          gamma=args.gamma, runner=args.runner, dtype=args.dtype, draft_dtype=args.draft_dtype,
                          callable=args.callable, verifier=args.inject, tree=args.tree, tree_rule=args.tree_rule)
        if args.workers < 1:
            raise UsageError(f"--workers must be >= 1, got {args.workers}")
        if args.threads:
            import torch
            torch.set_num_threads(args.threads)
        print("loading the reference target (float32) ...", file=sys.stderr, flush=True)
        ref = _load(args.target, "float32")
        prompts = _certify_prompts(args, ref.tokenizer)
        report = certify_generate(spec, prompts, params, samples=args.samples, length=args.length, level=args.level,
                                  seed=args.seed, workers=args.workers, two_sample_tokens=args.two_sample_tokens,
                                  reference=ref)
    except (ModelLoadError, ValueError) as e:
        raise UsageError(str(e)) from None
    files = write_report(report, args.out)
    print(report.to_markdown())
    print(f"report: {', '.join(str(f) for f in files)}", file=sys.stderr)
    return 0 if report.passed else 1


def _cmd_certify_study(args: argparse.Namespace) -> int:
    from dataclasses import asdict

    from .certify.generate import _load
    from .certify.study import run_study, study_markdown
    from .model.loading import ModelLoadError
    from .sampling import SamplingParams

    try:
        params = SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p)
        ref = _load(args.target, "float32")
        prompts = _certify_prompts(args, ref.tokenizer)
        variants = [v.strip() for v in args.variants.split(",")] if args.variants else None
        rows = run_study(args.target, args.draft, prompts, params, variants=variants, contexts=args.contexts,
                         length=args.length, certify_samples=args.certify_samples, certify_length=args.length,
                         gamma=args.gamma, level=args.level, seed=args.seed)
    except (ModelLoadError, ValueError) as e:
        raise UsageError(str(e)) from None
    header = (f"# verispec certify study\n\ntarget `{args.target}`, draft `{args.draft}`; {params}; {len(prompts)} "
              f"prompt(s) x {args.contexts} contexts x {args.length} positions for the deviations; certificate: "
              + (f"N = {args.certify_samples}, L = {args.length}, level {args.level}" if args.certify_samples
                 else "not run (--certify-samples 0)"))
    md = study_markdown(rows, header)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "study.md").write_text(md)
    (out / "study.json").write_text(json.dumps([asdict(r) for r in rows], indent=1))
    print(md)
    return 0


def build_parser() -> argparse.ArgumentParser:
    from .certify.bugs import BUGS
    from .certify.generate import DEFAULT_LENGTH as GEN_LENGTH, DEFAULT_SAMPLES as GEN_SAMPLES, METHODS
    from .certify.kernel import DEFAULT_SAMPLES as KERNEL_SAMPLES

    parser = argparse.ArgumentParser(prog="verispec", description="Lossless speculative decoding.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    ex = sub.add_parser("explain", help="walk one speculative step through exact arithmetic",
                        description="Show, token by token, why accept-with-min(1, p/q) plus resampling from "
                                    "(p - q)+ emits exactly p. Decimal inputs are computed exactly.")
    ex.add_argument("--p", required=True, help="target distribution, e.g. 0.6,0.3,0.1")
    ex.add_argument("--q", required=True, help="draft distribution, e.g. 0.4,0.5,0.1")
    ex.add_argument("--labels", help="token names, e.g. cat,dog,fish")
    ex.add_argument("--wrong", action="store_true", help="also show two classic wrong resampling rules")
    ex.add_argument("--json", action="store_true", help="print JSON instead of tables")
    ex.set_defaults(func=_cmd_explain)

    gen = sub.add_parser("generate", help="generate text with speculative decoding (streams to the terminal)",
                         description="Generate from the target model; every token follows the target's "
                                     "distribution exactly. With no --target, uses the built-in default model.")
    gen.add_argument("prompt", help="the prompt ('-' reads standard input)")
    _add_model_args(gen)
    _add_sampling_args(gen)
    gen.add_argument("--max-new-tokens", type=int, default=128)
    gen.add_argument("--stop", action="append", help="stop string (repeatable)")
    gen.add_argument("--chat", action="store_true", help="wrap the prompt in the tokenizer's chat template")
    gen.add_argument("--json", action="store_true", help="print one JSON object (text, tokens, logprobs, stats)")
    gen.set_defaults(func=_cmd_generate)

    sv = sub.add_parser("serve", help="OpenAI-compatible HTTP server (completions, chat, streaming, metrics)")
    _add_model_args(sv)
    sv.add_argument("--host", default="127.0.0.1")
    sv.add_argument("--port", type=int, default=8000)
    sv.add_argument("--served-model-name", help="the model id clients send (default: --target)")
    sv.add_argument("--max-batch", type=int, default=8, help="rows (choices) decoded together (default 8)")
    sv.add_argument("--max-queue", type=int, default=64,
                    help="requests allowed to wait for a batch slot; beyond, 429 with Retry-After (default 64)")
    sv.add_argument("--log-level", default="warning", help="uvicorn log level (default warning)")
    sv.set_defaults(func=_cmd_serve)

    bench = sub.add_parser("bench", help="benchmarks, side by side in one run")
    bsub = bench.add_subparsers(dest="bench_command", required=True, metavar="BENCH")
    bk = bsub.add_parser("kernel", help="time verify_chain against a reference and one read pass")
    bk.add_argument("--shape", type=_parse_shape, action="append", help="BxKxV (repeatable); default: the 5 issue shapes")
    bk.add_argument("--repeats", type=int, default=10, help="timed repeats per variant (default 10)")
    bk.add_argument("--device", default="cpu", help="cpu or cuda (default cpu)")
    bk.add_argument("--no-reference", action="store_true", help="skip the slow reference implementation")
    bk.add_argument("--json", metavar="FILE", help="also write the raw timings as JSON")
    bk.set_defaults(func=_cmd_bench_kernel)

    be = bsub.add_parser("e2e", help="end-to-end tokens/s: verispec (plain, draft, ngram) vs HF generate")
    be.add_argument("--target", help="target model (default: the built-in default model)")
    be.add_argument("--draft", help="draft model for verispec-draft and hf-assisted (omit: those are skipped)")
    be.add_argument("--prompts", nargs="+", required=True, help="JSONL prompt files ({'prompt', 'category'})")
    be.add_argument("--num-prompts", type=int, default=2, help="prompts per category at batch 1 (default 2)")
    be.add_argument("--batch", type=int, default=4, help="batch size of the batched verispec runs (default 4)")
    be.add_argument("--max-new-tokens", type=int, default=64)
    be.add_argument("--temperatures", default="0,1", help="comma-separated (default 0,1)")
    be.add_argument("--gamma", type=_gamma, default=4, help="drafts per step for verispec, or auto (default 4)")
    be.add_argument("--methods", help="comma-separated methods (default: the six standard ones); also "
                                      "verispec-draft@G, verispec-tree@SHAPE[/RULE], verispec-ngram-tree@SHAPE")
    be.add_argument("--seed", type=int, default=0)
    be.add_argument("--no-chat", action="store_true", help="feed prompts raw instead of through the chat template")
    be.add_argument("--runner", choices=["auto", "fast", "hf"], default="auto", help="verispec's model forward")
    be.add_argument("--draft-quant", choices=["int8", "int4"], help="quantize the draft model (verispec-draft)")
    be.add_argument("--self-quant", choices=["int8", "int4"], default="int4",
                    help="quantization of the self-draft (verispec-self; default int4)")
    be.add_argument("--dtype", default="float32")
    be.add_argument("--device", default="cpu")
    be.add_argument("--threads", type=int)
    be.add_argument("--out", default="bench-out", help="folder for e2e.json, e2e.md and e2e.png")
    be.set_defaults(func=_cmd_bench_e2e)

    br = bsub.add_parser("runner", help="decode(1) / verify(k) cost curves: transformers vs fast runner vs "
                                        "quantized self-drafts")
    br.add_argument("--model", help="model (hub id, directory, .gguf; default: the built-in default model)")
    br.add_argument("--paths", default="hf,fast,int8-self,int4-self",
                    help="comma-separated subset of hf, fast, int8-self, int4-self (default: all)")
    br.add_argument("--max-k", type=int, default=16, help="largest verify length (default 16)")
    br.add_argument("--context", type=int, default=64, help="cached tokens before each step (default 64)")
    br.add_argument("--repeats", type=int, default=7, help="timed repeats per k and path (default 7)")
    br.add_argument("--dtype", default="float32")
    br.add_argument("--device", default="cpu")
    br.add_argument("--threads", type=int)
    br.add_argument("--json", metavar="FILE", help="also write the raw timings as JSON")
    br.set_defaults(func=_cmd_bench_runner)

    cert = sub.add_parser("certify", help="statistical certificate that a sampler / generator is lossless")
    csub = cert.add_subparsers(dest="certify_command", required=True, metavar="CERTIFY")
    ck = csub.add_parser("kernel", help="certify a chain (or --tree) verification function against exactly known laws",
                         description="Run a battery of (p, q) cases through a chain verifier (verispec's, or "
                                     "--sampler module:function with verify_chain's interface) and test every "
                                     "emitted position's distribution. With --tree RULE: trees drafted with that rule "
                                     "through a tree verifier (verify_tree's interface). Exit status 0 = PASS, "
                                     "1 = FAIL.")
    ck.add_argument("--sampler", help="module:function or file.py:function with verify_chain's (or, with --tree, "
                                      "verify_tree's) interface")
    ck.add_argument("--tree", choices=["iid", "without_replacement", "deterministic", "all"],
                    help="certify tree verification for trees whose children were drawn this way")
    ck.add_argument("--inject", help=f"certify a deliberately broken verifier instead (must FAIL): chain bugs "
                                     f"{', '.join(BUGS)}; with --tree: tree_stale_residual, tree_topk_as_sampled, "
                                     "tree_wor_as_iid (and tree_iid_as_deterministic, which is lossless)")
    ck.add_argument("--samples", type=int, default=None,
                    help=f"speculative steps per case (default {KERNEL_SAMPLES}; 40000 with --tree)")
    ck.add_argument("--level", type=float, default=0.01, help="family-wise significance level (default 0.01)")
    ck.add_argument("--vocab", type=int, default=None, help="vocabulary of the cases (default 32; 6 with --tree)")
    ck.add_argument("--cases", help="comma-separated subset of the cases")
    ck.add_argument("--seed", type=int, default=0)
    ck.add_argument("--out", default="certify-out", help="folder for kernel-certificate.{md,json}")
    ck.add_argument("--verbose", action="store_true", help="print every test, not just the summary")
    ck.set_defaults(func=_cmd_certify_kernel)

    cg = csub.add_parser("generate", help="certify a generator's continuations against the target's conditionals",
                         description="Draw N continuations of L tokens per prompt from a method and test them "
                                     "against the target model's own distribution (first-token and sequence "
                                     "goodness of fit, PIT uniformity, log-likelihood, two-sample vs plain "
                                     "decoding). Exit status 0 = PASS, 1 = FAIL.")
    cg.add_argument("--target", help="target model (default: the built-in default model)")
    cg.add_argument("--method", choices=METHODS, default="verispec",
                    help="verispec (default), plain (verispec without drafts), hf (transformers generate), "
                         "hf-assisted (generate(assistant_model=--draft)), callable (--callable)")
    cg.add_argument("--draft", default="ngram", help="verispec: draft model, ngram, self or none; hf-assisted: "
                                                    "the assistant model")
    cg.add_argument("--draft-quant", choices=["int8", "int4"])
    cg.add_argument("--gamma", type=_gamma, default=4, help="verispec drafts per step (default 4)")
    cg.add_argument("--runner", choices=["auto", "fast", "hf"], default="auto")
    cg.add_argument("--dtype", default="float32", help="the method's target precision (scoring is float32)")
    cg.add_argument("--draft-dtype", default="float32")
    cg.add_argument("--callable", help="module:function mapping (prompt_ids, params dict, seed) -> token ids")
    cg.add_argument("--inject", help=f"verispec with a deliberately broken verifier (must FAIL): {', '.join(BUGS)}; "
                                     "with --tree: tree_stale_residual, tree_topk_as_sampled, tree_wor_as_iid")
    _tree_args(cg)
    cg.add_argument("--temperature", type=float, default=1.0)
    cg.add_argument("--top-k", type=int, default=0)
    cg.add_argument("--top-p", type=float, default=1.0)
    cg.add_argument("--min-p", type=float, default=0.0)
    cg.add_argument("--prompt", action="append", help="prompt text (repeatable)")
    cg.add_argument("--prompts", nargs="+", help="JSONL prompt files ({'prompt': ...})")
    cg.add_argument("--num-prompts", type=int, default=1, help="prompts taken from each file (default 1)")
    cg.add_argument("--chat", action="store_true", help="wrap prompts in the tokenizer's chat template")
    cg.add_argument("--samples", type=int, default=GEN_SAMPLES, help=f"continuations per prompt (default {GEN_SAMPLES})")
    cg.add_argument("--length", type=int, default=GEN_LENGTH, help=f"tokens per continuation (default {GEN_LENGTH})")
    cg.add_argument("--level", type=float, default=0.01, help="family-wise significance level (default 0.01)")
    cg.add_argument("--two-sample-tokens", type=int, default=2,
                    help="positions compared with plain decoding samples (0 = off; default 2)")
    cg.add_argument("--workers", type=int, default=1, help="processes drawing samples (default 1)")
    cg.add_argument("--threads", type=int)
    cg.add_argument("--seed", type=int, default=0)
    cg.add_argument("--out", default="certify-out", help="folder for generate-certificate.{md,json,png}")
    cg.set_defaults(func=_cmd_certify_generate)

    cs = csub.add_parser("study", help="measure the seed's failure modes (temperature mismatch, bf16 / fp16, lossy "
                                       "acceptance) and the certificate's verdict on each")
    cs.add_argument("--target", help="target model (default: the built-in default model)")
    cs.add_argument("--draft", required=True, help="draft model (sharing the target's tokenizer)")
    cs.add_argument("--variants", help="comma-separated subset (default: all)")
    cs.add_argument("--temperature", type=float, default=0.7, help="default 0.7")
    cs.add_argument("--top-k", type=int, default=0)
    cs.add_argument("--top-p", type=float, default=1.0)
    cs.add_argument("--prompt", action="append", help="prompt text (repeatable)")
    cs.add_argument("--prompts", nargs="+", help="JSONL prompt files ({'prompt': ...})")
    cs.add_argument("--num-prompts", type=int, default=1, help="prompts taken from each file (default 1)")
    cs.add_argument("--chat", action="store_true")
    cs.add_argument("--contexts", type=int, default=16, help="target continuations per prompt used as contexts")
    cs.add_argument("--length", type=int, default=8, help="tokens per continuation (default 8)")
    cs.add_argument("--certify-samples", type=int, default=0,
                    help="N of the generator certificate run on each variant (0 = deviations only, default)")
    cs.add_argument("--gamma", type=int, default=4)
    cs.add_argument("--level", type=float, default=0.01)
    cs.add_argument("--seed", type=int, default=0)
    cs.add_argument("--out", default="certify-out", help="folder for study.{md,json}")
    cs.set_defaults(func=_cmd_certify_study)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except UsageError as e:
        print(f"verispec: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
