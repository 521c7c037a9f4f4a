"""The llama.cpp runner's errors that need no llama.cpp: a torch model asked to run on it, quantized drafts, the
backend name, and bench e2e leaving out the methods a target cannot run."""

from __future__ import annotations

import pytest

from verispec.bench.e2e import _runnable
from verispec.model import make_runner
from verispec.model.loading import LoadedModel, ModelLoadError, load_model


class FakeLlamaCpp:  # what make_runner sees of a model llama.cpp loaded (no torch parameters)
    n_vocab = 32


def test_a_torch_model_cannot_take_runner_llamacpp(tiny_target):
    with pytest.raises(ValueError, match=r"GGUF file loaded by llama\.cpp"):
        make_runner(tiny_target.model, runner="llamacpp")


@pytest.mark.parametrize(
    "kwargs,msg", [(dict(runner="fast"), "runs on runner 'llamacpp'"), (dict(quant="int4"), "own quantization")]
)
def test_a_llamacpp_model_refuses_torch_runners_and_quantization(kwargs, msg):
    with pytest.raises(ValueError, match=msg):
        make_runner(FakeLlamaCpp(), **kwargs)


def test_unknown_backend_is_a_load_error():
    with pytest.raises(ModelLoadError, match="backend must be one of torch, llamacpp"):
        load_model("x", backend="onnx")


def test_bench_skips_what_the_target_cannot_run(tiny_target):
    logged = []
    on_torch = LoadedModel(model=tiny_target.model, tokenizer=None, name="tiny-dir")
    kept = _runnable(["verispec-plain", "hf-plain", "llamacpp-plain"], on_torch, logged.append)
    assert kept == ["verispec-plain", "hf-plain"] and "llamacpp-plain skipped" in logged[0]
    on_llamacpp = LoadedModel(model=FakeLlamaCpp(), tokenizer=None, name="m.gguf")
    logged.clear()
    kept = _runnable(["verispec-plain", "hf-plain"], on_llamacpp, logged.append)
    assert kept == ["verispec-plain"] and "hf-plain skipped" in logged[0]


def test_weight_updates_on_a_llamacpp_model_are_refused():
    from verispec.model.weights import WeightUpdateError, update_weights

    with pytest.raises(WeightUpdateError, match="cannot be replaced in place"):
        update_weights(FakeLlamaCpp(), [])
