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


@pytest.fixture(autouse=True)
def _deterministic_torch():
    """Every test starts from the same global RNG state and a fixed thread count."""
    torch.manual_seed(0)
    yield
