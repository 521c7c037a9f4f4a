import pytest
import torch


@pytest.fixture(autouse=True)
def _deterministic_torch():
    """Every test starts from the same global RNG state and a fixed thread count."""
    torch.manual_seed(0)
    yield
