"""Mask engines for structured outputs, measured side by side: xgrammar (what verispec uses) vs llguidance.

Not part of the package (llguidance is no dependency of verispec). For every schema of the prompt set
(verispec/bench/data/extract.jsonl) a valid document is built from the schema (`example`: every property, in schema
order, json.dumps's separators, which both engines' default compact JSON format allows), tokenized with the default
model's tokenizer (SmolLM2-135M-Instruct, V = 49,152), and walked token by token: at each position the next-token
mask is filled (timed), then the token is accepted; at the end EOS must be allowed. Reported per engine: grammar
compile time per schema (a fresh compiler, no cache), and the per-mask time, mean / p50 / p90 / p99 over all
positions of all documents and `--repeats` walks. Also timed: verispec's own `GrammarState.mask` (xgrammar's fill plus
the unpacking into a [V] bool tensor the engine reads).

    python docs/bench/grammar-engines.py [--repeats 5] [--out docs/bench/grammar-engines.md]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch


def example(schema: dict):
    """A valid instance of an (extraction-style) schema: every property, enums' first value, arrays of two items."""
    if "enum" in schema:
        return schema["enum"][0]
    kind = schema.get("type")
    if kind == "object":
        return {k: example(v) for k, v in schema.get("properties", {}).items()}
    if kind == "array":
        n = min(2, schema.get("maxItems", 2))
        return [example(schema.get("items", {"type": "string"})) for _ in range(n)]
    if kind == "string":
        return "Harbour street 12"
    if kind == "integer":
        return max(int(schema.get("minimum", 0)), 42) if "maximum" not in schema else int(schema["maximum"]) // 2
    if kind == "number":
        return 12.5
    if kind == "boolean":
        return True
    return None


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def walk_xgrammar(tok, V, eos, schemas, docs, repeats):
    import xgrammar as xgr

    info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=V, stop_token_ids=[eos])
    compile_s, mask_s = [], []
    for schema, ids in zip(schemas, docs):
        compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        t0 = time.perf_counter()
        compiled = compiler.compile_json_schema(json.dumps(schema), any_whitespace=False, strict_mode=True)
        compile_s.append(time.perf_counter() - t0)
        bits = xgr.allocate_token_bitmask(1, V)
        for _ in range(repeats):
            m = xgr.GrammarMatcher(compiled)
            for j, t in enumerate([*ids, eos]):
                t0 = time.perf_counter()
                m.fill_next_token_bitmask(bits, 0)
                mask_s.append((j, time.perf_counter() - t0))
                word = int(bits[0, t // 32])
                assert (word >> (t % 32)) & 1, f"xgrammar refuses token {t} of a valid document"
                assert m.accept_token(t)
    return compile_s, mask_s


def walk_llguidance(tok, V, eos, schemas, docs, repeats):
    import llguidance
    import llguidance.hf
    import llguidance.torch as llt

    lltok = llguidance.hf.from_tokenizer(tok, n_vocab=V, eos_token=eos)
    compile_s, mask_s = [], []
    for schema, ids in zip(schemas, docs):
        t0 = time.perf_counter()
        grammar = llguidance.LLMatcher.grammar_from_json_schema(json.dumps(schema))
        m = llguidance.LLMatcher(lltok, grammar)
        compile_s.append(time.perf_counter() - t0)
        assert not m.is_error(), m.get_error()
        bits = llt.allocate_token_bitmask(1, V)
        for r in range(repeats):
            m = m if r == 0 else llguidance.LLMatcher(lltok, grammar)
            for j, t in enumerate([*ids, eos]):
                t0 = time.perf_counter()
                llt.fill_next_token_bitmask(m, bits, 0)
                mask_s.append((j, time.perf_counter() - t0))
                word = int(bits[0, t // 32])
                assert (word >> (t % 32)) & 1, f"llguidance refuses token {t} of a valid document"
                assert m.consume_token(t), m.get_error()
    return compile_s, mask_s


def walk_verispec(tok, V, eos, schemas, docs, repeats):
    from verispec.sampling import Constraint
    from verispec.structured import Grammars

    grammars = Grammars(tok, V, [eos])
    compile_s, mask_s = [], []
    for schema, ids in zip(schemas, docs):
        c = Constraint.json_schema(schema)
        t0 = time.perf_counter()
        grammars.compile(c)
        compile_s.append(time.perf_counter() - t0)
        for _ in range(repeats):
            state = grammars.state(c)
            for j, t in enumerate([*ids, eos]):
                t0 = time.perf_counter()
                m = state.mask(())
                mask_s.append((j, time.perf_counter() - t0))
                assert bool(m[t]), f"verispec's mask refuses token {t}"
                state.advance([t])
    return compile_s, mask_s


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=5, help="walks per document (default 5)")
    ap.add_argument("--out", help="write the markdown report here")
    args = ap.parse_args()
    torch.set_num_threads(1)
    import importlib.metadata as md

    from transformers import AutoTokenizer

    from verispec.bench import provenance, provenance_line
    from verispec.bench.structured import load_extract_prompts
    from verispec.model.loading import _resolve

    origin = provenance()  # the code, date and command at the start of the run
    source, name, kwargs = _resolve(None)
    tok = AutoTokenizer.from_pretrained(source, **kwargs)
    V, eos = len(tok), tok.eos_token_id
    unique = {}
    for p in load_extract_prompts():
        unique.setdefault(json.dumps(p["schema"], sort_keys=True), p["schema"])
    schemas = list(unique.values())
    docs = [tok.encode(json.dumps(example(s)), add_special_tokens=False) for s in schemas]
    rows = []
    for engine, walk in (
        (f"xgrammar {md.version('xgrammar')}", walk_xgrammar),
        (f"llguidance {md.version('llguidance')}", walk_llguidance),
        ("verispec GrammarState.mask (xgrammar + unpack to [V] bool)", walk_verispec),
    ):
        compile_s, mask_s = walk(tok, V, eos, schemas, docs, args.repeats)
        us = [1e6 * s for _, s in mask_s]
        first = [1e6 * s for j, s in mask_s if j == 0]
        rest = [1e6 * s for j, s in mask_s if j > 0]
        rows.append(
            f"| {engine} | {1e3 * statistics.mean(compile_s):.1f} / {1e3 * max(compile_s):.1f} | {len(us)} | "
            f"{statistics.mean(us):.1f} | {pct(us, 0.5):.1f} | {pct(us, 0.9):.1f} | {pct(us, 0.99):.1f} | "
            f"{max(us):.0f} | {statistics.mean(first):.0f} | {statistics.mean(rest):.1f} |"
        )
        print(rows[-1], flush=True)
    lengths = [len(d) for d in docs]
    report = "\n".join(
        [
            "# Grammar mask engines: xgrammar vs llguidance",
            "",
            f"Made by {provenance_line(origin)}",
            "",
            f"Tokenizer: {name} (V = {V}); {len(schemas)} distinct schemas of verispec/bench/data/extract.jsonl, one "
            f"valid document each ({min(lengths)}-{max(lengths)} tokens, {sum(lengths)} in all, EOS after each), "
            f"walked {args.repeats} times; 1 torch thread; a 2-core CPU shared with other jobs, so p99 is noisy. "
            "Compile: a fresh compiler per schema, no cache (llguidance: grammar text + matcher construction; it "
            "builds parts of its lexer lazily, which then land in the first masks).",
            "",
            "| engine | compile ms (mean / max) | masks | mean us / mask | p50 | p90 | p99 | max "
            "| first mask of a walk (mean) | mean of the others |",
            "|---|---|---|---|---|---|---|---|---|---|",
            *rows,
        ]
    )
    print(report)
    if args.out:
        with open(args.out, "w") as f:
            f.write(report + "\n")


if __name__ == "__main__":
    main()
