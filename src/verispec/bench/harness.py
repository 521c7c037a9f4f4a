"""The harness every `verispec bench` kind runs in: a kind defines its methods and one record per measurement; the
harness runs the methods side by side (`side_by_side`), takes ratios to a baseline (`ratio_to`), times
(`median_seconds`), makes tables (`table`) and bar charts (`bars`), and writes the result once (`write_report`)."""

from __future__ import annotations

import json
import operator
import statistics
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from ..engine.config import DRAFTERS
from ..strict_json import dumps
from ._provenance import provenance, provenance_lines

__all__ = ["Col", "ModelBenchConfig", "SelfDraftBenchConfig", "bars", "fmt", "jsonl", "markdown_table"]
__all__ += ["median_seconds", "ratio_to", "report_head", "side_by_side", "started", "table", "timed", "write_report"]


@dataclass(frozen=True)
class ModelBenchConfig:
    """The config fields every model benchmark shares (`verispec.cli.options.add_bench_model_args`' options)."""

    seed: int = 0
    chat: bool = True  # prompts through the tokenizer's chat template
    runner: str = "auto"  # verispec's model forward (see verispec.model.fast.make_runner)
    draft_quant: str | None = None  # of the draft model


@dataclass(frozen=True)
class SelfDraftBenchConfig(ModelBenchConfig):
    """A benchmark with a self-draft method (the target's own weights quantized)."""

    self_quant: str = "int4"  # of the self-draft

    def quant_keys(self, draft: str) -> dict:
        """SpecConfig's quant for a drafter: draft_quant for a draft model, self_quant for the self-draft, else none."""
        d = DRAFTERS[draft]
        return {"quant": self.draft_quant if d.model else self.self_quant} if d.uses_model else {}


def started(**fields) -> dict:
    """A result's top level as its run starts: `provenance()` (commit, date, command, ...) and `fields`."""
    return provenance() | fields


def jsonl(text: str, name: str, need: Sequence[str]) -> list[dict]:
    """The JSON objects of a JSONL text, one per non-empty line, each with the fields `need` (ValueError naming the
    line where one is not)."""
    rows = []
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            rows.append(None)
        if not isinstance(rows[-1], dict) or not all(k in rows[-1] for k in need):
            raise ValueError(f"{name}:{n}: expected a JSON object with {' and '.join(map(repr, need))} field(s)")
    return rows


def side_by_side(cases: Iterable[dict], methods: Sequence[str], measure: Callable, log=None) -> list[dict]:
    """`case | {"method": m} | measure(m, case)` per case and method (none where it is None), the methods in turn on
    each case (load drift on a shared host falls on all alike); a progress line to log(text) after each."""
    records = []
    for case in cases:
        for m in methods:
            got = measure(m, case)
            if got is not None:
                records.append(rec := case | {"method": m} | got)
                rate = ", ".join(f"{k} {rec[k]:.2f}" for k in ("tokens_per_s", "tau") if rec.get(k) is not None)
                if log is not None:
                    log(" ".join(f"{v}" for v in case.values()) + f" {m}: {rate}")
    return records


def ratio_to(records: list[dict], base: dict, value: str, key: Sequence[str], out: str, op=operator.truediv) -> None:
    """rec[out] = op(rec[value], the value of the base record): the record with the same `key` fields and the
    `base` ones (None where there is none, or where either value is missing or the base's is 0)."""
    bases = {tuple(r[k] for k in key): r for r in records if base.items() <= r.items()}
    for r in records:
        b = bases.get(tuple(r[k] for k in key))
        r[out] = op(r[value], b[value]) if b and b.get(value) and r.get(value) is not None else None


def timed(fn: Callable, *args, **kwargs) -> tuple[float, object]:
    """(seconds, fn(*args, **kwargs))."""
    t0 = time.perf_counter()
    out = fn(*args, **kwargs)
    return time.perf_counter() - t0, out


def median_seconds(fn: Callable[[], object], repeats: int, warmup: int = 1, min_seconds: float = 0.0) -> float:
    """Median seconds of fn() over at least `repeats` calls (and `min_seconds`, up to 1000 calls), after `warmup`."""
    for _ in range(warmup):
        fn()
    times: list[float] = []
    start = time.perf_counter()
    while len(times) < repeats or (time.perf_counter() - start < min_seconds and len(times) < 1000):
        times.append(timed(fn)[0])
    return statistics.median(times)


def fmt(x, spec: str = ".2f") -> str:
    """A figure as text, '-' where it was not measured (None)."""
    return "-" if x is None else format(x, spec)


def markdown_table(header: Sequence[str], rows: Sequence[Sequence[object]]) -> list[str]:
    """Lines of a markdown table; a ValueError if a row does not have one cell per header cell."""
    for i, row in enumerate(rows):
        if len(row) != len(header):
            raise ValueError(f"table row {i} has {len(row)} cells for {len(header)} header cells")
    line = lambda cells: "| " + " | ".join(str(c).replace("|", "\\|") for c in cells) + " |"  # noqa: E731
    return [line(header), "|" + "---|" * len(header)] + [line(row) for row in rows]  # (a literal pipe: escaped)


@dataclass(frozen=True)
class Col:
    """A table column: its header, the record's field, fields (a tuple: their values joined by " / ") or a function
    of the record, and the format of its value (a list's values joined by spaces; None prints "-")."""

    header: str
    value: str | tuple[str, ...] | Callable[[dict], object]
    spec: str = ""  # a format spec; "": as it is

    def cell(self, rec: dict) -> str:
        if isinstance(self.value, tuple):
            return " / ".join(fmt(rec.get(k), self.spec) for k in self.value)
        value = self.value(rec) if callable(self.value) else rec.get(self.value)
        return " ".join(fmt(x, self.spec) for x in value) or "-" if isinstance(value, list) else fmt(value, self.spec)


def table(records: Iterable[dict], columns: Sequence[Col | str | tuple]) -> list[str]:
    """The markdown table of records, one row each; a column is a Col, a field (its own header) or Col's arguments."""
    cols = [c if isinstance(c, Col) else Col(c, c) if isinstance(c, str) else Col(*c) for c in columns]
    return markdown_table([c.header for c in cols], [[c.cell(r) for c in cols] for r in records])


def report_head(result: dict, *lines: str) -> list[str]:
    """A report's first lines: its provenance line, then `lines`, then a blank line (a table may follow)."""
    return [*provenance_lines(result), *lines, ""]


def bars(path, records: list[dict], panel, group, series, value, *, title, ylabel, one=True, top=None) -> None:
    """Grouped bar charts into `path` (PNG): one panel per distinct panel field (None: one panel), bars of the value
    field per group field (x) and series field (one colour each; a field, or a function of the record); a line at
    1 where `one`; `top`: the y range's top."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    get = [f if f is None or callable(f) else operator.itemgetter(f) for f in (panel, group, series, value)]
    panel, group, series, value = get
    panels = list(dict.fromkeys(panel(r) if panel else None for r in records))
    groups, names = list(dict.fromkeys(map(group, records))), list(dict.fromkeys(map(series, records)))
    fig, axes = plt.subplots(1, len(panels), figsize=(6 * len(panels), 4), squeeze=False)
    width = 0.8 / max(len(names), 1)
    for ax, p in zip(axes[0], panels):
        for i, s in enumerate(names):
            vals = {group(r): value(r) or 0 for r in records if series(r) == s and (panel is None or panel(r) == p)}
            ax.bar([x + i * width for x in range(len(groups))], [vals.get(g, 0) for g in groups], width, label=s)
        if one:
            ax.axhline(1.0, color="black", linewidth=0.8)
        ax.set_ylim(0, top)
        ax.set_xticks([x + width * (len(names) - 1) / 2 for x in range(len(groups))], [str(g) for g in groups])
        ax.set(title=title(p) if callable(title) else title, ylabel=ylabel)
    axes[0][0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def write_report(result: dict, name: str, markdown: str, *, out=None, json_file=None, plot=None) -> list[Path]:
    """Print the markdown report and write the result: NAME.json (strict JSON), NAME.md and NAME.png (plot(result,
    path), where given) into folder `out`, or the JSON alone into `json_file`. Returns the files written."""
    print(markdown)
    files = [Path(json_file)] if json_file is not None and out is None else []
    if out is not None:
        Path(out).mkdir(parents=True, exist_ok=True)
        files = [Path(out) / f"{name}.{ext}" for ext in ("json", "md", "png")[: 3 if plot else 2]]
        files[1].write_text(markdown + "\n")
        if plot is not None:
            plot(result, files[2])
    if files:
        files[0].write_text(dumps(result, indent=2))
        print("wrote " + ", ".join(map(str, files)))
    return files
