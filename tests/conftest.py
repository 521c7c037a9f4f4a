import os
from pathlib import Path

import pytest
import torch

from verispec.model.loading import LoadedModel

from .helpers.tiny import LONG_CONTEXT, loaded, noisy_copy


@pytest.fixture(scope="session")
def tiny_target():
    """The tiny 2-layer Llama target (seed 0, vocabulary 32), built once per session and shared by every test
    that uses it (tests must not modify its weights)."""
    return loaded(0)


@pytest.fixture(scope="session")
def tiny_draft():
    """A 1-layer tiny draft (seed 1) with the target's tokenizer: agrees with the target rarely."""
    return loaded(1, layers=1)


@pytest.fixture(scope="session")
def tiny_long_target():
    """The tiny target (the same weights) with a 32k context (LONG_CONTEXT): a request of up to ~32k tokens runs
    for thousands of steps, far longer than a client's timeout or a server's watch of its clients, on any machine
    (for tests of what happens while a request runs: ignore_eos and a max_tokens near the context)."""
    return loaded(0, max_positions=LONG_CONTEXT)


@pytest.fixture(scope="session")
def tiny_noisy(tiny_target):
    """The target with Gaussian noise (eps 0.3) on every weight: a draft that agrees often, not always."""
    return LoadedModel(noisy_copy(tiny_target.model, 0.3), tiny_target.tokenizer, "noisy")


# One intra-op thread. The test models are tiny (hidden size 32), so a second thread has nothing to share and its
# synchronisation costs more than it saves; on a busy 2-core machine it is far worse, since every small op waits for
# both threads to be scheduled (measured under load ~5: a greedy test 0.3 s with one thread, 21 s with two; the
# N = 2000 generator certificate 23 s vs 101 s). Subprocesses (CLI, `serve`, certify workers) get it through
# OMP_NUM_THREADS, set for the session and restored after it.
TEST_THREADS = 1


@pytest.fixture(scope="session", autouse=True)
def _one_thread_per_process():
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("OMP_NUM_THREADS", str(TEST_THREADS))
        yield


@pytest.fixture(autouse=True)
def _deterministic_torch():
    """Every test starts from the same global RNG state and a fixed thread count (a test may change it, e.g. the
    CLI's --threads run in-process)."""
    torch.manual_seed(0)
    torch.set_num_threads(TEST_THREADS)
    yield


# --- Tiers ---------------------------------------------------------------------------------------------------------
# Every collected test gets exactly one of two marks, here at collection, so a new test lands in a tier by where it
# is and what it uses:
#   integration  starts something (a live server, a `verispec` process, Ray, certify workers), runs a certificate or
#                a distributional test at full sample size, or otherwise takes seconds;
#   unit         the rest: in-process and fast (`python3 -m pytest -m "unit and not slow"` is the quick loop).
# A test's own mark wins (`@pytest.mark.integration` or `@pytest.mark.unit`, on the test, its class or the module's
# pytestmark). Otherwise it is integration when it is `statistical` (seeded hypothesis tests at powered sample sizes:
# seconds each), when its file is under INTEGRATION_PATHS (and not in UNIT_PATHS), when it uses a fixture in
# INTEGRATION_FIXTURES, or when its module holds one of INTEGRATION_NAMES (what starts things).
# `slow` is orthogonal: the slow tier has both kinds. Unit tests slower than UNIT_BUDGET_S are listed at the end of
# the run, to be marked integration.
INTEGRATION_PATHS = (
    "bench/",  # the benchmarks end to end on saved models
    "certify/",  # certificates
    "cli/test_generate.py",  # the CLI end to end on saved models
    "distributed/",  # Ray
    "engine/test_coupling.py",  # coupled output == plain output over 200 seeds, per drafter
    "model/test_llamacpp.py",  # a real model on disk (slow tier)
    "rollout/test_certificate.py",
    "rollout/test_distribution.py",
    "rollout/test_trl.py",  # TRL's trainer on a live server
    "serve/",  # live servers
)
UNIT_PATHS = (
    "certify/test_stats.py",
    "serve/test_model_id.py",
    "serve/test_offsets.py",
)
INTEGRATION_FIXTURES = frozenset({"tiny_long_target"})
INTEGRATION_NAMES = ("LiveServer", "subprocess", "ray", "multiprocessing")
UNIT_BUDGET_S = 5.0
TESTS = Path(__file__).parent


def _is_integration(item) -> bool:
    path = item.path.relative_to(TESTS).as_posix()
    if path.startswith(UNIT_PATHS):
        return False
    if item.get_closest_marker("statistical") is not None:
        return True
    if path.startswith(INTEGRATION_PATHS) or INTEGRATION_FIXTURES.intersection(getattr(item, "fixturenames", ())):
        return True
    module = getattr(item, "module", None)
    return module is not None and any(name in vars(module) for name in INTEGRATION_NAMES)


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects by these marks
def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.get_closest_marker("unit") is None and item.get_closest_marker("integration") is None:
            item.add_marker(pytest.mark.integration if _is_integration(item) else pytest.mark.unit)


_slow_units: list[tuple[float, str]] = []


def pytest_runtest_logreport(report):
    # in the process that prints the summary: the controller under xdist (workers' reports reach it), else this one
    if report.when == "call" and report.passed and "unit" in report.keywords and report.duration > UNIT_BUDGET_S:
        _slow_units.append((report.duration, report.nodeid))


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    report = yield
    if report.skipped and os.environ.get("CI") and item.get_closest_marker("slow") and not hasattr(report, "wasxfail"):
        # CI runs the slow tier to run it: a test there that cannot run (a missing extra, a model that could not be
        # fetched) fails instead of passing CI by skipping
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        report.outcome, report.longrepr = "failed", f"a slow-tier test skipped under CI: {reason}"
    return report


def pytest_terminal_summary(terminalreporter):
    if _slow_units:
        terminalreporter.section(f"unit tests over {UNIT_BUDGET_S:.0f} s (mark them integration, or make them faster)")
        for seconds, nodeid in sorted(_slow_units, reverse=True):
            terminalreporter.line(f"{seconds:7.1f}s {nodeid}")
