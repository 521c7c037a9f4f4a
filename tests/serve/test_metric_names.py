"""The server's metric names against vLLM's, through the page that maps them (docs/guides/coming-from.md): every
`verispec:` metric of the registry is a row of the page's table, and relabelled by the page's own Prometheus rule it
is a vLLM metric of the same type and labels, or the page says it has no vLLM equivalent (and vLLM indeed has no
metric of that name). A metric added, renamed or retyped without its row, or a stale row, fails here."""

from __future__ import annotations

import re
from pathlib import Path

import yaml

from verispec.serve.metrics import Metrics

PAGE = Path(__file__).resolve().parents[2] / "docs" / "guides" / "coming-from.md"
VLLM_LABELS = {"model_name", "engine"}  # on every vLLM series

# vLLM's Prometheus metrics (names as declared, before prometheus_client adds `_total` to counters) -> (type, labels
# besides model_name and engine). Read from vLLM's v0.12 line: vllm/v1/metrics/loggers.py (PrometheusStatLogger,
# the version that hides vllm:time_per_output_token_seconds behind --show-hidden-metrics-for-version=0.11) and
# vllm/v1/spec_decode/metrics.py (SpecDecodingProm). The KV-connector and LoRA metrics are left out.
VLLM_METRICS = {
    "vllm:num_requests_running": ("gauge", ()),
    "vllm:num_requests_waiting": ("gauge", ()),
    "vllm:engine_sleep_state": ("gauge", ("sleep_state",)),
    "vllm:kv_cache_usage_perc": ("gauge", ()),
    "vllm:cache_config_info": ("gauge", ()),
    "vllm:corrupted_requests": ("counter", ()),
    "vllm:prefix_cache_queries": ("counter", ()),
    "vllm:prefix_cache_hits": ("counter", ()),
    "vllm:external_prefix_cache_queries": ("counter", ()),
    "vllm:external_prefix_cache_hits": ("counter", ()),
    "vllm:mm_cache_queries": ("counter", ()),
    "vllm:mm_cache_hits": ("counter", ()),
    "vllm:num_preemptions": ("counter", ()),
    "vllm:prompt_tokens": ("counter", ()),
    "vllm:generation_tokens": ("counter", ()),
    "vllm:request_success": ("counter", ("finished_reason",)),
    "vllm:request_prompt_tokens": ("histogram", ()),
    "vllm:request_generation_tokens": ("histogram", ()),
    "vllm:iteration_tokens_total": ("histogram", ()),
    "vllm:request_max_num_generation_tokens": ("histogram", ()),
    "vllm:request_params_n": ("histogram", ()),
    "vllm:request_params_max_tokens": ("histogram", ()),
    "vllm:time_to_first_token_seconds": ("histogram", ()),
    "vllm:time_per_output_token_seconds": ("histogram", ()),
    "vllm:inter_token_latency_seconds": ("histogram", ()),
    "vllm:request_time_per_output_token_seconds": ("histogram", ()),
    "vllm:e2e_request_latency_seconds": ("histogram", ()),
    "vllm:request_queue_time_seconds": ("histogram", ()),
    "vllm:request_inference_time_seconds": ("histogram", ()),
    "vllm:request_prefill_time_seconds": ("histogram", ()),
    "vllm:request_decode_time_seconds": ("histogram", ()),
    "vllm:kv_block_lifetime_seconds": ("histogram", ()),
    "vllm:kv_block_idle_before_evict_seconds": ("histogram", ()),
    "vllm:kv_block_reuse_gap_seconds": ("histogram", ()),
    "vllm:spec_decode_num_drafts": ("counter", ()),
    "vllm:spec_decode_num_draft_tokens": ("counter", ()),
    "vllm:spec_decode_num_accepted_tokens": ("counter", ()),
    "vllm:spec_decode_num_accepted_tokens_per_pos": ("counter", ("position",)),
}

_ROW = re.compile(r"^\| `(verispec:[a-z0-9_]+)` \| (`vllm:[a-z0-9_]+`|none) \| (gauge|counter|histogram) \|", re.M)


def page_rows() -> dict[str, tuple[str | None, str]]:
    """The page's metric table: verispec name -> (vLLM name or None, type)."""
    rows = {}
    for name, vllm, kind in _ROW.findall(PAGE.read_text()):
        assert name not in rows, f"{name} has two rows on {PAGE.name}"
        rows[name] = (None if vllm == "none" else vllm.strip("`"), kind)
    return rows


def page_relabel():
    """The page's Prometheus rule that renames metrics, as a function of a name (RE2 anchors a regex at both ends,
    and `$1` is its first group)."""
    block = re.search(r"```yaml\n(.*?)```", PAGE.read_text(), re.S)
    assert block, f"no yaml block on {PAGE.name}"
    rules = yaml.safe_load(block[1])["scrape_configs"][0]["metric_relabel_configs"]
    (rule,) = [r for r in rules if r.get("target_label") == "__name__"]
    assert rule["source_labels"] == ["__name__"]
    regex, replacement = re.compile(rule["regex"]), re.sub(r"\$(\d+)", r"\\\1", rule["replacement"])

    def relabel(name: str) -> str:
        m = regex.fullmatch(name)
        return m.expand(replacement) if m else name

    return relabel


def registry_metrics() -> dict[str, tuple[str, set[str]]]:
    """The server's metrics: name -> (type, label names), with one observation each so that every labelled series
    shows its labels."""
    m = Metrics("m")
    m.observe_step([(2, 1)])
    m.observe_end("stop", 0.1)
    found = {}
    for family in m.registry.collect():
        labels = set().union(*(s.labels for s in family.samples)) - {"le"}
        found[family.name] = (family.type, labels)
    return found


def test_every_metric_has_a_row_and_every_row_a_metric():
    assert set(registry_metrics()) == set(page_rows())


def test_relabelled_names_are_vllm_metrics_of_the_same_type_and_labels():
    relabel, rows = page_relabel(), page_rows()
    for name, (kind, labels) in registry_metrics().items():
        vllm, page_kind = rows[name]
        assert page_kind == kind, f"{name} is a {kind}, the page says {page_kind}"
        if vllm is None:
            assert relabel(name) not in VLLM_METRICS, f"{name}: vLLM has {relabel(name)}, the page says none"
            continue
        assert relabel(name) == vllm, f"{name} relabels to {relabel(name)}, the page says {vllm}"
        assert vllm in VLLM_METRICS, f"{vllm} is not a vLLM metric"
        vllm_kind, vllm_labels = VLLM_METRICS[vllm]
        assert kind == vllm_kind, f"{name} is a {kind}, {vllm} a {vllm_kind}"
        assert labels <= VLLM_LABELS | set(vllm_labels), f"{name} has labels {labels}, {vllm} has {vllm_labels}"


def test_the_relabel_renames_exposed_series_too():
    """The exposition's sample names (`_total`, `_bucket`, ...) keep their suffix through the rule."""
    relabel = page_relabel()
    assert relabel("verispec:prompt_tokens_total") == "vllm:prompt_tokens_total"
    assert relabel("verispec:e2e_request_latency_seconds_bucket") == "vllm:e2e_request_latency_seconds_bucket"
    assert relabel("process_cpu_seconds_total") == "process_cpu_seconds_total"
