"""Reading hidden-state heads from disk, in the layouts their trainers write and serving engines load (the table in
docs/guides/train-draft-head.md): EAGLE-3 (SafeAILab `traineagle3` / SpecForge, vLLM's `speculators`), EAGLE-1/2,
Medusa (FasterDecoding's, vLLM's) and the multi-token-prediction layer of a DeepSeek-V3 / Qwen3-Next checkpoint
(Llama-layout blocks only; its first layer drafts at every depth).

Aux layer ids follow vLLM and `speculators`: id i is the input of target layer i (default 2, L // 2, L - 3), id L
the last layer's output. Every problem is a `HeadLoadError` naming it, before anything runs.
"""

from __future__ import annotations

import contextlib
import json
from dataclasses import dataclass
from pathlib import Path

import torch
from huggingface_hub import snapshot_download
from safetensors import safe_open
from torch import Tensor
from transformers import LlamaConfig

from ..model.loading import LoadedModel, ModelLoadError, shared_vocab_size
from .modules import MedusaHeads, PairHead

__all__ = ["HEAD_KINDS", "HeadLoadError", "LoadedHead", "bind_head", "head_kind", "load_head", "mtp_head"]

HEAD_KINDS = ("eagle3", "eagle", "medusa", "mtp")


class HeadLoadError(ModelLoadError, ValueError):
    """A head checkpoint that cannot be used, or not with this target (a ModelLoadError and a ValueError): the
    message names the problem (hidden size, aux layer ids, `d2t` out of range, a setting heads refuse, ...)."""


@dataclass
class LoadedHead:
    """A hidden-state head read from disk (`load_head`): not a model (it has no tokenizer; it reads the target's ids
    and hidden states). Pass it as a generator's `draft`; `bind_head` ties it to a target (the drafter factory does).

    Attributes:
        model: The head's module: a PairHead (EAGLE-3, EAGLE, MTP) or MedusaHeads.
        name: The directory it was read from.
        kind: "eagle3", "eagle", "medusa" or "mtp".
        config: The checkpoint's config.json.
        embedded: The checkpoint carries its own embedding (else the target's is shared).
    """

    model: torch.nn.Module
    name: str
    kind: str = "eagle3"
    config: dict | None = None
    embedded: bool = False

    @property
    def described(self) -> str:
        """How a message names it: 'an EAGLE-3 head', 'Medusa heads', ..."""
        return DESCRIBED[self.kind]


DESCRIBED = {"eagle3": "an EAGLE-3 head", "eagle": "an EAGLE head", "medusa": "Medusa heads", "mtp": "an MTP layer"}


def head_kind(path) -> str | None:
    """The head kind a directory holds, from its config.json: "eagle3", "eagle", "medusa" or "mtp" (a checkpoint with
    a multi-token-prediction layer); None for anything else (a plain model, no readable config.json).

    Args:
        path (str | os.PathLike): A directory.
    """
    try:
        cfg = json.loads((Path(path) / "config.json").read_text())
    except (OSError, json.JSONDecodeError):  # not a directory with a readable config.json
        return None
    return _kind(cfg, Path(path))


def _kind(cfg: dict, path: Path) -> str | None:
    archs = " ".join(cfg.get("architectures") or [])
    if cfg.get("speculators_model_type") == "eagle3" or "Eagle3" in archs or "draft_vocab_size" in cfg:
        return "eagle3"
    if cfg.get("speculators_model_type") == "eagle" or ("Eagle" in archs and "Eagle3" not in archs):
        return "eagle"
    if "medusa_num_heads" in cfg or cfg.get("model_type") == "medusa":
        return "medusa"
    if cfg.get("num_nextn_predict_layers", 0) or cfg.get("mtp_num_hidden_layers", 0):
        return "mtp"
    llama = cfg.get("model_type") in ("llama", "qwen2", "qwen3", "mistral", None)
    if llama and {"fc.weight", "model.fc.weight"} & _tensor_names(path):
        return "eagle"  # EAGLE-1 checkpoints ship a plain Llama config
    return None


def _weight_files(path: Path) -> list[Path]:
    files = sorted(path.glob("*.safetensors")) or sorted(path.glob("*.bin")) + sorted(path.glob("*.pt"))
    if not files:
        raise HeadLoadError(f"{path}: no weights (*.safetensors, *.bin or *.pt)")
    return files


def _tensor_names(path: Path) -> set[str]:
    try:
        return set(_read(path, names_only=True))
    except HeadLoadError:
        return set()


def _read(path: Path, prefix: str = "", names_only: bool = False) -> dict:
    """The checkpoint's tensors {name: tensor} (only those under prefix, with it removed), or just their names."""
    out = {}
    for f in _weight_files(path):
        if f.suffix == ".safetensors":
            with safe_open(str(f), "pt") as fh:
                for k in fh.keys():  # noqa: SIM118 - safe_open is not iterable
                    if k.startswith(prefix):
                        out[k[len(prefix) :]] = None if names_only else fh.get_tensor(k)
            continue
        try:
            sd = _torch_load(f, mmap=names_only)  # (names only: mapped, no tensor data read)
        except Exception as e:
            raise HeadLoadError(f"{f}: not a tensor checkpoint ({type(e).__name__}: {e})") from None
        out |= {k[len(prefix) :]: None if names_only else v for k, v in sd.items() if k.startswith(prefix)}
    return out


def _torch_load(f: Path, mmap: bool) -> dict:
    if mmap:
        with contextlib.suppress(Exception):  # (a legacy, non-zip file cannot be mapped)
            return torch.load(f, map_location="cpu", weights_only=True, mmap=True)
    return torch.load(f, map_location="cpu", weights_only=True)


def load_head(
    path, *, dtype: torch.dtype = torch.float32, device: str = "cpu", kinds: tuple[str, ...] = HEAD_KINDS
) -> LoadedHead:
    """Read the hidden-state head in a directory (its kind from config.json), to pass as a generator's draft; a
    HeadLoadError where the directory holds no head of `kinds` or its weights do not fit its config.

    Args:
        path (str | os.PathLike): The head's directory (config.json and its weights).
        dtype: The weights' dtype.
        device: The device to load onto.
        kinds: The kinds accepted.
    """
    path = Path(path).expanduser()
    kind = head_kind(path)
    if kind is None or kind not in kinds:
        wanted = [DESCRIBED[k] for k in kinds]
        wanted = wanted[0] if len(wanted) == 1 else ", ".join(wanted[:-1]) + " or " + wanted[-1]
        found = "" if kind is None else f" (it describes {DESCRIBED[kind]})"
        if kinds == ("mtp",):
            wanted += " (num_nextn_predict_layers / mtp_num_hidden_layers)"
        raise HeadLoadError(f"{path}: config.json does not describe {wanted}{found}")
    cfg = json.loads((path / "config.json").read_text())
    module, embedded = (_medusa(cfg, path), False) if kind == "medusa" else _pair(kind, cfg, path)
    module = module.to(device=device, dtype=dtype).eval().requires_grad_(False)
    if getattr(module, "embed", None) is not None:
        module.embed = module.embed.to(device=device, dtype=dtype)
    return LoadedHead(module, str(path), kind=kind, config=cfg, embedded=embedded)


def mtp_head(target: LoadedModel) -> LoadedHead:
    """The multi-token-prediction layer of the checkpoint the target was loaded from, as a head in the target's dtype
    and on its device (what draft=mtp drafts with); a HeadLoadError for a GGUF target, a checkpoint not found or
    without an MTP layer.

    Args:
        target: A torch model loaded from a checkpoint directory, or a hub id in the local Hugging Face cache.
    """
    what = f"draft=mtp reads the multi-token-prediction layer of the target's checkpoint, and target {target.name!r}"
    if not isinstance(target.model, torch.nn.Module) or target.gguf is not None:
        raise HeadLoadError(f"{what} was loaded from a GGUF file: load the checkpoint directory with torch")
    p = next(target.model.parameters())
    dirs = [Path(n).expanduser() for n in (target.name, getattr(target.model.config, "_name_or_path", None)) if n]
    folder = next((d for d in dirs if d.is_dir()), None)
    if folder is None:
        try:
            folder = Path(snapshot_download(str(target.name), local_files_only=True))
        except Exception:
            raise HeadLoadError(f"{what} is neither a local directory nor in the Hugging Face cache") from None
    return load_head(folder, dtype=p.dtype, device=str(p.device), kinds=("mtp",))


def _llama_config(cfg: dict) -> LlamaConfig:
    inner = cfg.get("transformer_layer_config") or cfg  # speculators nest the layer's config
    keys = {k: v for k, v in inner.items() if k not in ("architectures", "model_type", "auto_map", "torch_dtype")}
    for k in ("hidden_size", "num_attention_heads", "intermediate_size"):
        if not isinstance(inner.get(k), int) or inner[k] < 1:
            raise HeadLoadError(f"the head's config.json needs a positive integer {k!r}, got {inner.get(k)!r}")
    try:
        return LlamaConfig(**keys)
    except Exception as e:  # TypeError, ValueError, huggingface_hub's strict-dataclass validation errors
        raise HeadLoadError(f"the head's config is not a Llama-layout config: {e}") from None


def _aux_layers(cfg: dict) -> tuple[int, ...] | None:
    """The target layers an EAGLE-3 head reads, as capture ids (id i: the input of layer i; None: the default).
    SafeAILab / SpecForge's nested `eagle_config` ids name layer *outputs* (SGLang reads id k as the input of layer
    k + 1), `speculators`' top-level ids name layer inputs (vLLM)."""
    nested = (cfg.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    if nested:
        return tuple(int(i) + 1 for i in nested)
    ids = cfg.get("eagle_aux_hidden_state_layer_ids")
    return tuple(int(i) for i in ids) if ids else None


def _renamed(tensors: dict, old: str, new: str = "") -> dict:
    """The tensors with the name prefix `old` replaced by `new`."""
    return {(new + k[len(old) :] if k.startswith(old) else k): v for k, v in tensors.items()}


def _depth(tensors: dict) -> int:
    """Decoder layers in `layers.{i}.*` names (at least 1)."""
    return 1 + max((int(k.split(".")[1]) for k in tensors if k.startswith("layers.")), default=0)


def _pair(kind: str, cfg: dict, path: Path) -> tuple[PairHead, bool]:
    """An EAGLE-3 / EAGLE / MTP head and whether its checkpoint carries an embedding."""
    lc = _llama_config(cfg)
    H = lc.hidden_size
    tensors = _mtp_tensors(cfg, path) if kind == "mtp" else _read(path)
    tensors = _renamed(tensors, "midlayer.", "layers.0.") if kind == "eagle3" else tensors
    tensors = _renamed(tensors, "model.") if kind == "eagle" else tensors
    lc.num_hidden_layers = _depth(tensors)
    if kind == "eagle3":
        aux = _aux_layers(cfg)
        feature = (3 if aux is None else len(aux)) * int(cfg.get("target_hidden_size") or H)
        vd = int(cfg.get("draft_vocab_size") or lc.vocab_size)
        head = PairHead(kind, lc, feature, vd, layers=aux or ())
        head.norm_before_residual = bool(cfg.get("norm_before_residual"))
    elif kind == "eagle":
        head = PairHead(kind, lc, H, 0, layers=(-1,))
    else:
        head = PairHead(kind, lc, H, lc.vocab_size if "lm_head.weight" in tensors else 0, layers=(-1,))
        head.feed_normed = not cfg.get("num_nextn_predict_layers", 0)  # Qwen3-Next feeds its normed output back
    embed = tensors.pop("embed_tokens.weight", None)
    unused = {k for k in tensors if k == "t2d" or k.startswith("verifier_") or k.endswith("rotary_emb.inv_freq")}
    tensors = {k: v for k, v in tensors.items() if k not in unused}
    if kind == "eagle3" and "d2t" not in tensors:
        if head.lm_head.weight.shape[0] != (lc.vocab_size or 0) and "lm_head.weight" in tensors:
            raise HeadLoadError(f"{path}: the EAGLE-3 head has a draft vocabulary but no 'd2t' tensor")
        tensors["d2t"] = torch.zeros(head.lm_head.weight.shape[0], dtype=torch.int64)
    _load_state(head, tensors, path)
    head.embed = embed  # (None: the target's, bound by `bind_head`)
    return head, embed is not None


def _mtp_tensors(cfg: dict, path: Path) -> dict:
    """The MTP layer's tensors in the PairHead's names, from a DeepSeek-V3 or Qwen3-Next checkpoint."""
    if cfg.get("num_nextn_predict_layers", 0):
        L = int(cfg["num_hidden_layers"])
        raw = _read(path, prefix=f"model.layers.{L}.")
        if not raw:
            raise HeadLoadError(f"{path}: num_nextn_predict_layers is set but no 'model.layers.{L}.*' tensors exist")
        if any(k.startswith(("self_attn.kv_a_proj", "self_attn.q_a_proj")) for k in raw):
            raise HeadLoadError(f"{path}: the MTP layer uses multi-head latent attention, which verispec does not run")
        names = {"shared_head.norm.weight": "norm.weight", "shared_head.head.weight": "lm_head.weight"}
        names["embed_tokens.weight"] = "embed_tokens.weight"
        own = ("enorm.", "hnorm.", "eh_proj.")  # the rest is the decoder layer
        out = {names.get(k, k if k.startswith(own) else "layers.0." + k): v for k, v in raw.items()}
    else:
        if "qwen3_next" in str(cfg.get("model_type")) or "Qwen3Next" in " ".join(cfg.get("architectures") or []):
            raise HeadLoadError(
                f"{path}: Qwen3-Next's MTP layer (gated attention, zero-centred norms, experts) is not a Llama-layout "
                "layer, which is all verispec runs"
            )
        raw = _read(path, prefix="mtp.")
        if not raw:
            raise HeadLoadError(f"{path}: mtp_num_hidden_layers is set but no 'mtp.*' tensors exist")
        names = {"fc.weight": "eh_proj.weight", "pre_fc_norm_embedding.weight": "enorm.weight"}
        names["pre_fc_norm_hidden.weight"] = "hnorm.weight"
        # the first layer drafts at every depth (vLLM cycles through the layers by depth; DeepSeek's: layer L alone)
        out = {names.get(k, k): v for k, v in raw.items() if not k.startswith("layers.") or k.startswith("layers.0.")}
    if any(".mlp.experts." in k or ".mlp.gate.weight" in k for k in out):
        raise HeadLoadError(f"{path}: the MTP layer's MLP is a mixture of experts, which verispec does not run")
    return out


def _load_state(module: torch.nn.Module, tensors: dict[str, Tensor], path: Path) -> None:
    """Every parameter present with its shape, nothing unknown."""
    want = {k: v for k, v in module.state_dict().items() if not k.startswith("rotary.")}
    for what, names in (("missing", set(want) - set(tensors)), ("unexpected", set(tensors) - set(want))):
        if names:
            names = sorted(names)
            raise HeadLoadError(f"{path}: {what} tensor(s) {', '.join(names[:5])}{' ...' if len(names) > 5 else ''}")
    for k, v in want.items():
        if tuple(tensors[k].shape) != tuple(v.shape):
            raise HeadLoadError(f"{path}: tensor {k!r} has shape {list(tensors[k].shape)}, expected {list(v.shape)}")
    module.load_state_dict({k: tensors[k] for k in want}, strict=False)


def _medusa(cfg: dict, path: Path) -> MedusaHeads:
    def count(key: str, default: int | None = None) -> int:
        value = cfg.get(key, default)
        if not isinstance(value, int) or isinstance(value, bool):
            raise HeadLoadError(f"{path}: config.json's {key!r} must be an integer, got {value!r}")
        return value

    tensors = _read(path)
    if "medusa_num_heads" in cfg:  # FasterDecoding: {k}.{j}.linear.* then {k}.{n}.weight
        n_heads, n_layers = count("medusa_num_heads"), count("medusa_num_layers", 1)
        tensors = {_fasterdecoding_name(k, n_layers): v for k, v in _renamed(tensors, "medusa_head.").items()}
        bias = True  # FasterDecoding's ResBlock: nn.Linear(H, H) with its bias
    else:  # vLLM: blocks.{k}.layers.{j}.*, lm_heads.{k}.* (`medusa_heads.` before them in some checkpoints)
        n_heads, n_layers = count("num_heads", 0), count("num_hidden_layers", 1)
        tensors = {k.replace(".layers.", "."): v for k, v in _renamed(tensors, "medusa_heads.").items()}
        bias = bool(cfg.get("medusa_fc_bias", False))
        if cfg.get("original_lm_head") and "lm_heads.0.weight" in tensors:  # one output layer for every head
            tensors.update({f"lm_heads.{k}.weight": tensors["lm_heads.0.weight"] for k in range(1, n_heads)})
        truncated = cfg.get("truncated_vocab_size")
        if "token_map" in tensors or (truncated is not None and truncated != cfg.get("vocab_size", truncated)):
            raise HeadLoadError(f"{path}: a Medusa checkpoint with a truncated vocabulary (token_map) is not supported")
    if n_heads < 1:
        raise HeadLoadError(f"{path}: the Medusa config gives {n_heads} heads; a Medusa checkpoint needs at least one")
    if n_layers < 0:
        raise HeadLoadError(f"{path}: the Medusa config gives {n_layers} residual blocks per head")
    first = tensors.get("lm_heads.0.weight")
    if first is None or first.dim() != 2:
        where = f"'0.{n_layers}.weight'" if "medusa_num_heads" in cfg else "'lm_heads.0.weight'"
        raise HeadLoadError(f"{path}: missing tensor {where} (head 0's output layer [vocab, hidden])")
    heads = MedusaHeads(first.shape[1], first.shape[0], n_heads, n_layers, bias=bias)
    heads.logit_scale = float(cfg.get("logit_scale", 1.0))
    _load_state(heads, tensors, path)
    return heads


def _fasterdecoding_name(k: str, n_layers: int) -> str:
    parts = k.split(".")
    if len(parts) == 4 and parts[2] == "linear":
        return f"blocks.{parts[0]}.{parts[1]}.{parts[3]}"
    if len(parts) == 3 and parts[1] == str(n_layers) and parts[2] == "weight":
        return f"lm_heads.{parts[0]}.weight"
    return k


def bind_head(head: LoadedHead, target: LoadedModel) -> int:
    """Tie a head to its target: the embedding (shared unless the checkpoint has one), the output layer where it has
    none, the target layers it reads; every mismatch a HeadLoadError. Returns the pair's (the target's) vocab size."""
    model = target.model
    if not isinstance(model, torch.nn.Module):
        raise HeadLoadError(
            f"{head.described} reads the target's hidden states, which the llama.cpp runner does not expose: "
            "load the target with torch (--runner fast or hf)"
        )
    cfg = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    H_t, L = cfg.hidden_size, cfg.num_hidden_layers
    vocab = shared_vocab_size(target, None)
    m = head.model
    where = f"head {head.name!r} and target {target.name!r}"
    if isinstance(m, MedusaHeads):
        _bind_medusa(m, where, H_t, vocab)
        m.to(next(model.parameters()).device)
        return vocab
    if m.kind == "eagle3":
        _bind_eagle3(m, where, H_t, L, vocab)
    elif m.hidden_size != H_t:
        raise HeadLoadError(f"{where}: the head's hidden size is {m.hidden_size}, the target's {H_t}")
    embed = model.get_input_embeddings().weight
    m.to(embed.device)  # the head runs beside the target (its own dtype: inputs are cast at its boundaries)
    if m.embed is None or not head.embedded:  # the target's, bound anew to each target the head drafts for
        if embed.shape[1] != m.hidden_size:
            raise HeadLoadError(
                f"{where}: the head has no embedding and the target's has width {embed.shape[1]}, not {m.hidden_size}"
            )
        m.embed = embed.detach()  # a plain tensor sharing the target's storage (updated in place with it)
    elif tuple(m.embed.shape[1:]) != (m.hidden_size,) or m.embed.shape[0] < vocab:
        raise HeadLoadError(f"{where}: the head's embedding has shape {list(m.embed.shape)}")
    if m.lm_head is None:
        object.__setattr__(m, "target_head", model.get_output_embeddings())  # not a submodule of the head
    elif m.kind != "eagle3" and m.lm_head.weight.shape[0] < vocab:
        raise HeadLoadError(
            f"{where}: the head's output layer has {m.lm_head.weight.shape[0]} rows, fewer than {vocab}"
        )
    return vocab


def _bind_medusa(m: MedusaHeads, where: str, H_t: int, vocab: int) -> None:
    lm = m.lm_heads[0]
    if lm.in_features != H_t:
        raise HeadLoadError(f"{where}: the Medusa heads read hidden size {lm.in_features}, the target's is {H_t}")
    if lm.out_features < vocab:
        raise HeadLoadError(
            f"{where}: the Medusa heads' output layers have {lm.out_features} rows, fewer than the target's "
            f"vocabulary ({vocab})"
        )


def _bind_eagle3(m: PairHead, where: str, H_t: int, L: int, vocab: int) -> None:
    """An EAGLE-3 head's target layers (its aux ids, or the default 2, L // 2, L - 3) and d2t, checked."""
    read = m.layers_read = m.aux_ids or ((2, L // 2, L - 3) if L >= 4 else tuple(range(min(3, L))))  # per target
    if any(not 0 <= i <= L for i in read):
        raise HeadLoadError(f"{where}: aux layer ids {list(read)} must lie in [0, {L}] (the target has {L} layers)")
    need = m.fc.in_features
    if need != len(read) * H_t:
        raise HeadLoadError(
            f"{where}: fc reads {need} features, the target gives {len(read)} layers x {H_t} "
            f"(target_hidden_size {need // max(len(read), 1)} != the target's hidden size {H_t})"
        )
    ids = torch.arange(len(m.d2t)) + m.d2t.cpu()
    if len(ids) and (int(ids.min()) < 0 or int(ids.max()) >= vocab):
        raise HeadLoadError(f"{where}: d2t maps draft ids outside the target's vocabulary [0, {vocab})")
    if len(ids) != len(torch.unique(ids)):
        raise HeadLoadError(f"{where}: d2t maps two draft ids to one target id")
