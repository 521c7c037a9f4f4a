"""The generator certificate's report: each test's result (`TestResult`), the verdict and figures
(`GenerateReport`, as markdown and JSON) and `write_report` (the files, with plots)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

from .kernel import Verdict, has_power, write_md_json

__all__ = ["GenerateReport", "TestResult", "write_report"]


@dataclass
class TestResult:
    name: str
    kind: str  # first-token, sequence, pit, loglik, two-sample
    statistic: float
    pvalue: float
    n: int
    detectable: float  # smallest effect detected with power 0.99 (unit in `effect`)
    effect: str
    holm_pvalue: float = float("nan")
    # where the counts differ most from the law (or from the reference's): token, observed / expected frequency
    deviations: list[dict] = field(default_factory=list)

    @property
    def powered(self) -> bool:
        """Some effect short of the largest possible is detectable (no upper bound for nats per token)."""
        return math.isfinite(self.detectable) if self.kind == "loglik" else has_power(self.detectable)


@dataclass
class GenerateReport(Verdict):
    method: str
    target: str | None
    params: dict
    prompts: int
    samples: int
    length: int
    level: float
    power: float
    seed: int
    tests: list[TestResult]
    acceptance: list[float]  # per-position acceptance of the speculative method (empty otherwise)
    acceptance_rate: float
    tau: float
    pit: list[float]  # all PIT values (for the histogram)
    seconds: float
    errors: list[str] = field(default_factory=list)
    samples_needed: int | None = None  # INCONCLUSIVE: continuations per prompt to detect TARGET_TV everywhere
    tv_tolerance: float = 0.0  # > 0: the first-token tests test TV <= this (another engine's numerics)
    parity: dict | None = None  # logprob_parity: returned logprobs against the float32 recompute
    endpoint: dict | None = None  # method 'openai': requests, retries, refused fields, EOS appended, ...
    request_seeds: dict | None = None  # every request's seed (the rule and each prompt's range)
    reference_endpoint: dict | None = None  # the --reference-url endpoint's log, when it was the two-sample reference
    unusable: list[str] = field(default_factory=list)  # samples a method could not return: INCONCLUSIVE

    @property
    def rejected(self) -> bool:
        """As Verdict's, unless samples were dropped (their loss conditions the law: no FAIL, no PASS)."""
        return not self.unusable and Verdict.rejected.fget(self)

    @property
    def conclusive(self) -> bool:
        """Every prompt's first-token law is tested with power (a deviation below TV 1 is detectable)."""
        first = [t for t in self.tests if t.kind == "first-token"]
        return bool(first) and all(t.powered for t in first) and not self.unusable

    def power_note(self) -> str:
        if self.conclusive:
            return ""
        if self.unusable:
            return (
                "INCONCLUSIVE: some samples could not be returned as token ids (a token text no single id has: use "
                f"a server that honours return_tokens_as_token_ids): {'; '.join(self.unusable)}."
            )
        need = self.needed_note(f"N = {self.samples_needed} continuations per prompt")
        return (
            f"INCONCLUSIVE: with N = {self.samples} continuations per prompt a first-token test has no power "
            f"(it cannot detect any deviation){need}."
        )

    def to_json(self) -> dict:
        d = self.json_with_verdict()
        d.pop("pit")
        return d

    def to_markdown(self) -> str:
        lines = [
            f"# verispec certify generate: **{self.verdict}**",
            "",
            f"method: {self.method}; target `{self.target}`; params {self.params}",
            "",
            f"{self.prompts} prompt(s) x N = {self.samples} continuations x L = {self.length} tokens; "
            f"{len(self.tests)} tests, Holm-corrected at family-wise level {self.level}; power {self.power} for "
            f"the detectable effects (each at the Bonferroni level); seed {self.seed}; {self.seconds:.0f} s.",
        ]
        lines += [line for note in self._notes() for line in ("", note)]  # each note a paragraph
        lines += self._parity_lines()
        if self.errors:
            lines += ["", "## Errors", ""] + [f"- {e}" for e in self.errors]
        return "\n".join(lines + self._table_lines() + self._deviation_lines()) + "\n"

    def _notes(self) -> list[str]:
        """The paragraphs under the header: the power, the acceptance, the tolerance, the endpoint's run, the seeds."""
        notes = [self.power_note()]
        if self.acceptance:
            notes.append(
                f"acceptance rate {self.acceptance_rate:.3f}, tau {self.tau:.2f} tokens per target pass; "
                f"per position: {' '.join(f'{a:.2f}' for a in self.acceptance)}"
            )
        if self.tv_tolerance:
            notes.append(
                f"Tolerance: the first-token tests test H0 TV <= {self.tv_tolerance:g} (numeric drift allowed; a "
                "distribution-free bound, stats.tolerant_tv_test); the exact-equality tests (PIT, log-likelihood, "
                "sequence) are left out."
            )
        notes.append(self._endpoint_note())
        if r := self.request_seeds:
            reference = f"; {r['reference']}" if "reference" in r else ""
            notes.append(f"seeds ({r['rule']}): {r['per_prompt_first_last']}{reference}")
        return [note for note in notes if note]

    def _endpoint_note(self) -> str:
        """Method 'openai': what the endpoint run did (requests, retries, refused fields, EOS, mapped ids)."""
        e = self.endpoint
        if not e:
            return ""
        return (
            f"endpoint: {e['requests']} requests, {e['retries']} retries; refused optional fields: "
            f"{', '.join(e['dropped_fields']) or 'none'}; {e['eos_appended']} continuations ended at EOS; "
            f"{e['mapped_by_text']} token ids mapped from their text (no token_id:N)."
            + (f" The server's speculation counters: {e['speculation']}." if e.get("speculation") else "")
            + (f" Unmappable: {'; '.join(e['unmappable_examples'])}." if e.get("unmappable_examples") else "")
        )

    def _table_lines(self) -> list[str]:
        """One row per test: statistic, n, p-value, Holm p-value, detectable effect, verdict."""
        lines = [
            "",
            "| test | kind | statistic | n | p-value | Holm p | detectable effect | verdict |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for t in self.tests:
            mark = "**reject**" if t.holm_pvalue < self.level else "ok" if t.powered else "no power"
            lines.append(
                f"| {t.name} | {t.kind} | {t.statistic:.3g} | {t.n} | {t.pvalue:.3g} | {t.holm_pvalue:.3g} | "
                f"{t.detectable:.4g} {t.effect} | {mark} |"
            )
        return lines

    def _deviation_lines(self) -> list[str]:
        """Where each rejected test deviates (its top_deviations), when any was rejected."""
        rejected = [t for t in self.tests if t.holm_pvalue < self.level and t.deviations]
        if not rejected:
            return []
        lines = ["", "## Where it deviates (tokens whose frequency differs most: observed / expected)", ""]
        for t in rejected:
            cells = ", ".join(f"{d['token']}: {d['observed']:.4f} / {d['expected']:.4f}" for d in t.deviations)
            lines.append(f"- {t.name}: {cells}")
        return lines

    def _parity_lines(self) -> list[str]:
        if not self.parity:
            return []
        p = self.parity
        lines = [
            "",
            f"## Logprob parity ({p['tokens']} tokens: returned logprobs against the float32 recompute)",
            "",
            f"| against | max abs diff | mean abs diff | fraction > {p['threshold']:g} |",
            "|---|---|---|---|",
        ]
        for k in ("raw", "processed"):
            d = p[k]
            lines.append(f"| {k} | {d['max_abs']:.3g} | {d['mean_abs']:.3g} | {d['frac_over_threshold']:.4f} |")
        per = p["raw"]["per_position"]
        lines += [
            "",
            "raw, per position (max / mean): "
            + ", ".join(f"{r['position']}: {r['max']:.2g} / {r['mean']:.2g}" for r in per),
        ]
        return lines


def write_report(report: GenerateReport, out: str | Path) -> list[Path]:
    """generate-certificate.{md,json,png} in `out`: the table, the raw figures, and three plots (PIT histogram,
    per-position acceptance, Holm-adjusted p-values against the level)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    md, js = write_md_json(report, out, "generate-certificate")
    png = md.with_suffix(".png")
    md.write_text(md.read_text() + f"\n![plots]({png.name})\n")
    fig, axes = plt.subplots(1, 4, figsize=(20, 4))
    bins = 20
    axes[0].hist(report.pit, bins=bins, range=(0, 1), color="tab:blue", alpha=0.8)
    axes[0].axhline(len(report.pit) / bins, color="k", ls="--", lw=1, label="uniform")
    axes[0].set_title("randomized PIT of emitted tokens")
    axes[0].legend()
    if report.acceptance:
        axes[1].bar(range(len(report.acceptance)), report.acceptance, color="tab:green")
        axes[1].set_ylim(0, 1)
    axes[1].set(title="per-position acceptance", xlabel="draft position")
    names = [t.name for t in report.tests]
    vals = [-math.log10(max(t.holm_pvalue, 1e-300)) for t in report.tests]
    colors = ["tab:red" if t.holm_pvalue < report.level else "tab:gray" for t in report.tests]
    axes[2].barh(range(len(vals)), vals, color=colors)
    axes[2].axvline(-math.log10(report.level), color="k", ls="--", lw=1, label=f"level {report.level}")
    axes[2].set_yticks(range(len(vals)), names, fontsize=7)
    axes[2].set_title("-log10 Holm p-value")
    axes[2].legend()
    if report.parity:
        per = report.parity["raw"]["per_position"]
        xs = [r["position"] for r in per]
        axes[3].semilogy(xs, [max(r["max"], 1e-12) for r in per], "o-", label="max")
        axes[3].semilogy(xs, [max(r["mean"], 1e-12) for r in per], "s-", label="mean")
        axes[3].axhline(report.parity["threshold"], color="k", ls="--", lw=1)
        axes[3].legend()
    axes[3].set(title="logprob parity |returned - float32 raw|", xlabel="position")
    fig.suptitle(f"{report.verdict}: {report.method}")
    fig.tight_layout()
    fig.savefig(png, dpi=90)
    plt.close(fig)
    return [md, js, png]
