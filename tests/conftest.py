import pytest
import torch

from verispec.model.loading import LoadedModel

from .engine.tiny import loaded, noisy_copy


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
