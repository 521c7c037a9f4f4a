"""Library constants the parser shows or checks against, copied here so that building the parser (and `verispec
--help`, `verispec generate --help`) imports no torch: the library's packages load torch when they are imported.
tests/cli/test_startup.py checks that each copy equals the library's value, so they cannot drift apart."""

from __future__ import annotations

MAX_GAMMA = 64  # verispec.engine.adaptive.MAX_GAMMA: the most drafts per step
RUNNER_KINDS = ("auto", "fast", "hf", "llamacpp")  # verispec.model.fast.RUNNER_KINDS
QUANT_MODES = ("int8", "int4")  # verispec.model.linear.QUANT_MODES
DTYPES = ("float32", "bfloat16", "float16", "fp32", "bf16", "fp16")  # the names verispec.model.loading reads
SAMPLING_DEFAULTS = {  # SamplingParams()'s field values
    "temperature": 1.0,
    "top_k": 0,
    "top_p": 1.0,
    "min_p": 0.0,
    "repetition_penalty": 1.0,
    "presence_penalty": 0.0,
    "frequency_penalty": 0.0,
}
PREFILL_CHUNK = 128  # verispec.engine.core.PREFILL_CHUNK
DEFAULT_MAX_REQUEST_BYTES = 4 << 20  # verispec.serve.access.DEFAULT_MAX_REQUEST_BYTES
DEFAULT_READ_TIMEOUT_S = 10.0  # verispec.serve.transport.DEFAULT_READ_TIMEOUT_S
DEFAULT_BODY_TIMEOUT_S = 30.0  # verispec.serve.transport.DEFAULT_BODY_TIMEOUT_S
LOG_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")  # uvicorn.config.LOG_LEVELS
