"""The CPU threads of every model in the process (`verispec.model.threads`): the default-threads policy on simulated
loads (the thread figure of docs/bench/threads: under a load of 2 busy processes on 2 CPUs the default is 1 thread,
the setting that does not collapse; with idle CPUs, one per core), the /proc/stat sampling, that a count reaches
torch and llama.cpp's context (the real GGUF: slow tier), and the contention hint."""

from __future__ import annotations

import pytest
import torch

from verispec.model import threads as th
from verispec.model.threads import CpuSample, choose_threads, contention_hint, others_busy, parse_stat


@pytest.fixture
def fresh_state(monkeypatch):
    """A process where no count was chosen yet and torch sits at its own default (restored after the test)."""
    before = torch.get_num_threads()
    monkeypatch.setattr(th, "_state", {"threads": None, "since": None})
    monkeypatch.setattr(th, "_TORCH_AT_IMPORT", before)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    yield
    torch.set_num_threads(before)


@pytest.mark.parametrize(
    "cpus, others, cores, want",
    [
        (2, 0.0, None, 2),  # idle 2-core machine: both cores
        (2, 0.1, None, 2),  # a little background noise does not cost a thread
        (2, 2.0, None, 1),  # 2 busy processes on 2 CPUs (the benchmark's load): one thread, never 0
        (2, 1.0, None, 1),  # one busy process: the one idle CPU
        (2, 0.5, None, 1),  # half a CPU taken: a second thread would share it
        (2, 5.0, None, 1),  # more load than CPUs
        (16, 3.0, None, 13),
        (16, 0.0, 8, 8),  # no more threads than physical cores (torch's and llama.cpp's own cap)
        (1, 0.0, None, 1),
    ],
)
def test_the_default_takes_one_thread_per_idle_cpu(cpus, others, cores, want):
    assert choose_threads(cpus, others, cores) == want


def test_the_default_never_oversubscribes_a_loaded_machine():
    for cpus in (1, 2, 4, 8, 64):
        for tenths in range(0, 10 * cpus + 1):
            others = tenths / 10
            n = choose_threads(cpus, others)
            assert 1 <= n <= cpus
            assert n == 1 or n <= cpus - others + th.IDLE_SLACK  # every thread but the first has an idle CPU


STAT = """cpu  100 0 100 800 0 0 0 0 0 0
cpu0 50 0 50 400 0 0 0 0 0 0
cpu1 10 5 10 300 20 1 2 12 0 0
cpu2 40 0 40 100 0 0 0 0 0 0
intr 12345
ctxt 999
"""


def test_stat_parsing_counts_the_allowed_cpus_and_steal_as_busy():
    assert parse_stat(STAT, {0}) == (1, 100, 500)
    assert parse_stat(STAT, {1}) == (1, 40, 360)  # user+nice+system+irq+softirq+steal; iowait is idle
    assert parse_stat(STAT, None) == (3, 220, 1040)  # the per-CPU lines, never the "cpu" total
    assert parse_stat(STAT, {7}) is None


def test_others_busy_takes_this_process_out():
    a = CpuSample(cpus=2, busy=10.0, total=20.0, own=1.0, wall=0.0)
    b = CpuSample(cpus=2, busy=19.0, total=30.0, own=3.0, wall=5.0)  # 9 s busy of 10 s, 2 s of it ours
    assert others_busy(a, b) == pytest.approx(1.4)
    assert others_busy(a, a) == 0.0
    mine = CpuSample(cpus=2, busy=20.0, total=30.0, own=11.0, wall=5.0)  # all the busy time was ours
    assert others_busy(a, mine) == 0.0


def test_the_default_samples_the_load(fresh_state, monkeypatch):
    samples = iter([CpuSample(2, 0.0, 0.0, 0.0, 0.0), CpuSample(2, 0.4, 0.4, 0.0, 0.2)])  # both CPUs busy, not us
    monkeypatch.setattr(th, "read_sample", lambda: next(samples))
    monkeypatch.setattr(th, "usable_cpus", lambda: 2)
    monkeypatch.setattr(th, "_physical_cores", lambda: 2)
    assert th.default_threads(seconds=0) == 1
    monkeypatch.setenv("OMP_NUM_THREADS", "3")  # the user's explicit choice, as torch reads it
    assert th.default_threads(seconds=0) == 3


def test_set_threads_reaches_torch_and_later_loads_keep_it(fresh_state):
    assert th.set_threads(1) == 1 and torch.get_num_threads() == 1
    assert th.set_threads(None) == 1  # a draft loaded after the target (no --threads of its own)
    torch.set_num_threads(2)  # the caller's own choice since
    assert th.set_threads(None) == 2 and th.current_threads() == 2
    with pytest.raises(ValueError, match="threads must be >= 1"):
        th.set_threads(0)


def test_with_nothing_chosen_the_default_applies_to_torch(fresh_state, monkeypatch):
    want = 2 if torch.get_num_threads() != 2 else 1
    monkeypatch.setattr(th, "default_threads", lambda: want)
    assert th.set_threads(None) == want and torch.get_num_threads() == want


def test_load_model_sets_the_threads_of_a_torch_model(fresh_state, tmp_path):
    from verispec.model.loading import load_model

    from ..helpers.tiny import make_model, make_tokenizer

    make_model(0).save_pretrained(tmp_path / "m")
    make_tokenizer().save_pretrained(tmp_path / "m")
    torch.set_num_threads(2)
    load_model(tmp_path / "m", threads=1)
    assert torch.get_num_threads() == 1 and th.current_threads() == 1


@pytest.mark.parametrize("threads, cpus, others", [(1, 2, 2.0), (2, 2, 0.0), (2, 2, 0.4), (4, 8, 4.0)])
def test_no_hint_without_contention(threads, cpus, others):
    assert contention_hint(threads, cpus, others) is None


@pytest.mark.parametrize("threads, cpus, others, better", [(2, 2, 2.0, 1), (2, 2, 0.9, 1), (8, 8, 4.0, 4)])
def test_a_hint_when_threads_shared_their_cpus(threads, cpus, others, better):
    hint = contention_hint(threads, cpus, others)
    assert hint is not None and "\n" not in hint
    assert f"--threads {better}" in hint and f"{others:.1f} of {cpus} CPUs" in hint


def test_threads_hint_reads_the_load_since_the_threads_were_set(fresh_state, monkeypatch):
    th.set_threads(2)
    start = CpuSample(2, 0.0, 0.0, 0.0, 0.0)
    loaded = CpuSample(2, 10.0, 10.0, 0.5, 5.0)  # others kept 1.9 CPUs busy
    monkeypatch.setattr(th, "read_sample", lambda: loaded)
    assert "--threads 1" in th.threads_hint(start)
    assert th.threads_hint(CpuSample(2, 0.0, 0.0, 0.0, 4.9)) is None  # 0.1 s: too short to judge
    monkeypatch.setattr(th, "_state", {"threads": 2, "since": None})
    assert th.threads_hint() is None  # nothing sampled


@pytest.mark.slow
@pytest.mark.llamacpp
def test_threads_reach_a_llamacpp_context(fresh_state):
    pytest.importorskip("llama_cpp", reason='needs the extra: pip install -e ".[llamacpp]"')
    from verispec.model import make_runner
    from verispec.model.loading import default_model_path, load_model

    m = load_model(default_model_path(), backend="llamacpp", threads=1)
    r = make_runner(m.model, len(m.tokenizer))
    r.fill([[1, 2, 3]], 16)
    assert (r.lib.llama_n_threads(r.ctx), r.lib.llama_n_threads_batch(r.ctx)) == (1, 1)
    assert torch.get_num_threads() == 1
