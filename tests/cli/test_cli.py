"""The `verispec` command: explain (exact arithmetic), bench kernel (smoke), and one-line errors."""

from __future__ import annotations

import json

import pytest

from verispec.cli import main

from ..helpers.cli import PROCESS, run_verispec

SEED = ["explain", "--p", "0.6,0.3,0.1", "--q", "0.4,0.5,0.1", "--labels", "cat,dog,fish"]


def run_json(argv, capsys):
    assert main([*argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_explain_seed_example_exact(capsys):
    doc = run_json([*SEED, "--wrong"], capsys)
    rows = {t["label"]: t for t in doc["tokens"]}
    assert set(rows["cat"]) == {"label", "p", "q", "accept_prob", "accept_mass", "residual_mass", "output_prob"}
    assert doc["p_accept"] == "0.8" and doc["z"] == "0.2"
    assert [rows[x]["output_prob"] for x in ("cat", "dog", "fish")] == ["0.6", "0.3", "0.1"]
    assert rows["dog"]["accept_prob"] == "0.6" and rows["cat"]["accept_prob"] == "1"
    assert [rows[x]["residual_mass"] for x in ("cat", "dog", "fish")] == ["0.2", "0", "0"]
    assert doc["wrong"]["resample_from_p"] == {"cat": "0.52", "dog": "0.36", "fish": "0.12"}
    assert doc["wrong"]["resample_from_abs_diff"] == {"cat": "0.5", "dog": "0.4", "fish": "0.1"}


def test_explain_exact_rationals_and_zero_q(capsys):
    doc = run_json(["explain", "--p", "1/3,1/3,1/3", "--q", "0.5,0.5,0"], capsys)
    assert [t["output_prob"] for t in doc["tokens"]] == ["1/3"] * 3
    assert doc["tokens"][2]["accept_prob"] is None  # never drafted
    assert doc["p_accept"] == "2/3" and doc["z"] == "1/3"


def test_explain_table_output(capsys):
    assert main([*SEED, "--wrong"]) == 0
    out = capsys.readouterr().out
    assert "P(accept) = sum min(p, q) = 0.8" in out and "Z = sum (p - q)+ = 0.2" in out
    assert "0.52" in out and "NO" not in out


EXPLAIN_BAD = [
    (["explain", "--p", "0.6,0.3", "--q", "0.5,0.5"], "sum to exactly 1"),
    (["explain", "--p", "0.6,0.4", "--q", "0.4,0.5,0.1"], "same length"),
    (["explain", "--p", "1.2,-0.2", "--q", "0.5,0.5"], ">= 0"),
    (["explain", "--p", "a,b", "--q", "0.5,0.5"], "not a list of numbers"),
    (["explain", "--p", "0.5,0.5", "--q", "0.5,0.5", "--labels", "x"], "1 names for 2 tokens"),
]


# In the test process in the default tier, as `python -m verispec.cli` processes in the slow tier (tests/helpers/cli.py);
# the first case also runs as a process in the default tier (below).
@pytest.mark.parametrize("process", PROCESS)
@pytest.mark.parametrize("argv,msg", EXPLAIN_BAD)
def test_explain_bad_input_one_line_exit_2(argv, msg, process, capsys):
    proc = run_verispec(argv, capsys, process)
    assert proc.returncode == 2
    assert proc.stderr.count("\n") == 1 and msg in proc.stderr and "Traceback" not in proc.stderr


@pytest.mark.integration
def test_a_bad_input_is_one_line_and_exit_2_from_a_process():
    """The process itself (the entry point's exit status, nothing else written to stderr), in the default tier."""
    argv, msg = EXPLAIN_BAD[0]
    proc = run_verispec(argv, process=True)
    assert proc.returncode == 2
    assert proc.stderr.count("\n") == 1 and msg in proc.stderr and "Traceback" not in proc.stderr


def test_bench_kernel_smoke(capsys, tmp_path):
    out_json = tmp_path / "k.json"
    assert main(["bench", "kernel", "--shape", "2x3x50", "--repeats", "2", "--json", str(out_json)]) == 0
    text = capsys.readouterr().out
    assert "| 2 | 3 | 50 |" in text
    result = json.loads(out_json.read_text())  # {provenance..., device, rows}
    assert result["date"] and "commit" in result and result["command"]  # (sys.argv: pytest here, in-process)
    rows = result["rows"]
    assert rows[0]["reference_s"] > 0 and rows[0]["verispec_s"] > 0


@pytest.mark.parametrize("process", PROCESS)
def test_bench_kernel_bad_shape(process, capsys):
    proc = run_verispec(["bench", "kernel", "--shape", "8x4"], capsys, process)
    assert proc.returncode == 2 and "BxKxV" in proc.stderr
