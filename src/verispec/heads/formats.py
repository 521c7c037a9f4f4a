"""Reading hidden-state heads from disk, in the layouts their trainers write and serving engines load:

  eagle3     SafeAILab EAGLE `traineagle3` / SpecForge (what vLLM's `llama_eagle3.py` and SGLang load): config.json
             with `draft_vocab_size` (architectures `LlamaForCausalLMEagle3`), optional `target_hidden_size` and
             `eagle_config.eagle_aux_hidden_state_layer_ids`; tensors `fc`, `midlayer.*`, `norm`, `lm_head`, `d2t`,
             `t2d` (optional `embed_tokens`). The `speculators` layout (`speculators_model_type: eagle3`,
             `transformer_layer_config`, `layers.0.*`) is read too.
  eagle      EAGLE-1/2: a Llama config; tensors `fc` (weight [H, 2H] and bias), `layers.{i}.*`.
  medusa     FasterDecoding Medusa (`medusa_num_heads`, tensors `{k}.{j}.linear.*`, `{k}.{n}.weight`) or vLLM's
             (`model_type: medusa`, `blocks.{k}.layers.{j}.*`, `lm_heads.{k}.*`).
  mtp        a target checkpoint's multi-token-prediction layer: DeepSeek-V3 (`num_nextn_predict_layers`,
             `model.layers.{L}.{enorm,hnorm,eh_proj,shared_head.*}` and a Llama-layout block) or Qwen3-Next
             (`mtp_num_hidden_layers`, `mtp.{fc,pre_fc_norm_embedding,pre_fc_norm_hidden,layers.0.*,norm}`, the
             target's lm_head); the first layer drafts at every depth. Only a Llama-layout block runs: multi-head
             latent attention, a mixture-of-experts MLP and Qwen3-Next's own layer are refused. Such a directory
             is the target model (`load_model` loads the model from it): the MTP layer is `load_head(dir)`, or
             `draft=mtp` (`--draft mtp`, `mtp_head`), which reads it from the target's own checkpoint.

Aux layer ids follow vLLM and `speculators`: id i is the input of target layer i (the default: 2, L // 2, L - 3),
id L the last layer's output. Every problem (a missing or misshapen tensor, `d2t` out of range, a target of
another hidden size or depth) is a `HeadLoadError` naming it, before anything runs.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor
from transformers import LlamaConfig

from ..model.loading import LoadedModel, ModelLoadError
from .modules import MedusaHeads, PairHead

__all__ = ["HEAD_KINDS", "HeadLoadError", "LoadedHead", "bind_head", "head_kind", "load_head", "mtp_head"]

HEAD_KINDS = ("eagle3", "eagle", "medusa", "mtp")


class HeadLoadError(ModelLoadError, ValueError):
    """A head checkpoint that cannot be used, or not with this target (a ModelLoadError and a ValueError): the
    message names the problem (hidden size, aux layer ids, `d2t` out of range, a setting heads refuse, ...)."""


@dataclass
class LoadedHead(LoadedModel):
    """A hidden-state head read from disk (`load_head`). Pass it as a generator's `draft`.

    `bind_head` ties it to a target (its embedding, output layer and hidden layers); the generator does that.

    Attributes:
        model: The head's module: a PairHead (EAGLE-3, EAGLE, MTP) or MedusaHeads.
        tokenizer: None: the head reads the target's ids.
        name: The directory it was read from.
        kind: "eagle3", "eagle", "medusa" or "mtp".
        config: The checkpoint's config.json.
        embedded: The checkpoint carries its own embedding (else the target's is shared).
    """

    kind: str = "eagle3"
    config: dict | None = None
    embedded: bool = False  # the checkpoint carries its own embedding (else the target's is shared)

    @property
    def described(self) -> str:
        """How a message names it: 'an EAGLE-3 head', 'Medusa heads', ..."""
        return DESCRIBED[self.kind]


DESCRIBED = {"eagle3": "an EAGLE-3 head", "eagle": "an EAGLE head", "medusa": "Medusa heads", "mtp": "an MTP layer"}


def head_kind(path) -> str | None:
    """The head kind a directory holds, from its config.json.

    Args:
        path (str | os.PathLike): A directory.

    Returns:
        "eagle3", "eagle", "medusa" or "mtp" (a checkpoint with a multi-token-prediction layer); None when it is
        not a head (e.g. a plain model) or not a directory with a readable config.json.
    """
    cfg_path = Path(path) / "config.json"
    if not Path(path).is_dir() or not cfg_path.is_file():
        return None
    try:
        cfg = json.loads(cfg_path.read_text())
    except (OSError, json.JSONDecodeError):
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
    files = sorted(path.glob("*.safetensors"))
    if files:
        return files
    files = sorted(path.glob("*.bin")) + sorted(path.glob("*.pt"))
    if files:
        return files
    raise HeadLoadError(f"{path}: no weights (*.safetensors, *.bin or *.pt)")


def _tensor_names(path: Path) -> set[str]:
    try:
        return set(_read(path, prefix=None, names_only=True))
    except HeadLoadError:
        return set()


def _read(path: Path, prefix: str | None = None, names_only: bool = False):
    """The checkpoint's tensors {name: tensor} (only those under prefix, with it removed), or just their names."""
    from safetensors import safe_open

    out = {}
    for f in _weight_files(path):
        if f.suffix == ".safetensors":
            with safe_open(str(f), "pt") as fh:
                for k in fh.keys():  # noqa: SIM118 - safe_open is not iterable
                    if prefix is None or k.startswith(prefix):
                        key = k if prefix is None else k[len(prefix) :]
                        out[key] = None if names_only else fh.get_tensor(k)
        else:
            try:
                sd = _torch_load(f, mmap=names_only)  # (names only: mapped, no tensor data read)
            except Exception as e:
                raise HeadLoadError(f"{f}: not a tensor checkpoint ({type(e).__name__}: {e})") from None
            for k, v in sd.items():
                if prefix is None or k.startswith(prefix):
                    out[k if prefix is None else k[len(prefix) :]] = None if names_only else v
    return out


def _torch_load(f: Path, mmap: bool) -> dict:
    if mmap:
        try:
            return torch.load(f, map_location="cpu", weights_only=True, mmap=True)
        except Exception:  # (a legacy, non-zip file cannot be mapped)
            pass
    return torch.load(f, map_location="cpu", weights_only=True)


def load_head(
    path, *, dtype: torch.dtype = torch.float32, device: str = "cpu", kinds: tuple[str, ...] = HEAD_KINDS
) -> LoadedHead:
    """Read the hidden-state head in a directory (its kind from config.json).

    Layouts read: EAGLE-3 (SafeAILab / SpecForge, vLLM's `speculators`), EAGLE-1/2, Medusa (FasterDecoding's or
    vLLM's), and the MTP layer of a DeepSeek-V3 / Qwen3-Next checkpoint (see the module docstring).

    Args:
        path (str | os.PathLike): The head's directory (config.json and its weights).
        dtype: The weights' dtype.
        device: The device to load onto.
        kinds: The kinds accepted.

    Returns:
        The head, to pass as a generator's draft.

    Raises:
        HeadLoadError: The directory holds no head of `kinds`, or its weights do not fit its config.
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
    if kind == "medusa":
        module, embedded = _medusa(cfg, path), False
    else:
        module, embedded = _pair(kind, cfg, path)
    module = module.to(device=device, dtype=dtype).eval()
    if getattr(module, "embed", None) is not None:
        module.embed = module.embed.to(device=device, dtype=dtype)
    for p in module.parameters():
        p.requires_grad_(False)
    return LoadedHead(module, None, str(path), None, kind=kind, config=cfg, embedded=embedded)


def mtp_head(target: LoadedModel) -> LoadedHead:
    """The multi-token-prediction layer in the checkpoint the target was loaded from (what draft=mtp drafts with).

    Args:
        target: A torch model loaded from a checkpoint directory, or from a hub id already in the local Hugging
            Face cache.

    Returns:
        The MTP layer as a head, in the target's dtype and on its device.

    Raises:
        HeadLoadError: The target was loaded from a GGUF file, its checkpoint cannot be found, or it has no MTP
            layer.
    """
    what = f"draft=mtp reads the multi-token-prediction layer of the target's checkpoint, and target {target.name!r}"
    if not isinstance(target.model, torch.nn.Module) or target.gguf is not None:
        raise HeadLoadError(f"{what} was loaded from a GGUF file: load the checkpoint directory with torch")
    p = next(target.model.parameters())
    return load_head(_checkpoint_dir(target, what), dtype=p.dtype, device=str(p.device), kinds=("mtp",))


def _checkpoint_dir(target: LoadedModel, what: str) -> Path:
    for name in (target.name, getattr(target.model.config, "_name_or_path", None)):
        if name and Path(name).expanduser().is_dir():
            return Path(name).expanduser()
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(str(target.name), local_files_only=True))
    except Exception:
        raise HeadLoadError(f"{what} is neither a local directory nor in the Hugging Face cache") from None


def _llama_config(cfg: dict) -> LlamaConfig:
    inner = cfg.get("transformer_layer_config") or cfg  # speculators nest the layer's config
    keys = {k: v for k, v in inner.items() if k not in ("architectures", "model_type", "auto_map", "torch_dtype")}
    for k in ("hidden_size", "num_attention_heads", "intermediate_size"):
        if not isinstance(inner.get(k), int) or inner[k] < 1:
            raise HeadLoadError(f"the head's config.json needs a positive integer {k!r}, got {inner.get(k)!r}")
    try:
        lc = LlamaConfig(**keys)
    except Exception as e:  # TypeError, ValueError, huggingface_hub's strict-dataclass validation errors
        raise HeadLoadError(f"the head's config is not a Llama-layout config: {e}") from None
    return lc


def _aux_layers(cfg: dict) -> tuple[int, ...] | None:
    """The target layers an EAGLE-3 head reads, as verispec's capture ids (id i: the input of layer i), or None for
    the default. Two conventions are in use: SafeAILab / SpecForge's nested `eagle_config` ids name layer *outputs*
    (SGLang reads id k as the input of layer k + 1), `speculators`' top-level ids name layer inputs (vLLM)."""
    nested = (cfg.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    if nested:
        return tuple(int(i) + 1 for i in nested)
    ids = cfg.get("eagle_aux_hidden_state_layer_ids")
    return tuple(int(i) for i in ids) if ids else None


def _pair(kind: str, cfg: dict, path: Path) -> tuple[PairHead, bool]:
    """An EAGLE-3 / EAGLE / MTP head and whether its checkpoint carries an embedding."""
    lc = _llama_config(cfg)
    H = lc.hidden_size
    if kind == "mtp":
        tensors, lc = _mtp_tensors(cfg, path, lc)
    else:
        tensors = _read(path)
    if kind == "eagle3":
        aux = _aux_layers(cfg)
        n_aux = 3 if aux is None else len(aux)
        feature = n_aux * int(cfg.get("target_hidden_size") or H)
        vd = int(cfg.get("draft_vocab_size") or lc.vocab_size)
        tensors = {
            ("layers.0." + k[len("midlayer.") :] if k.startswith("midlayer.") else k): v for k, v in tensors.items()
        }
        lc.num_hidden_layers = 1 + max((int(k.split(".")[1]) for k in tensors if k.startswith("layers.")), default=0)
        head = PairHead(
            kind, lc, feature, vd, layers=aux or (), norm_before_residual=bool(cfg.get("norm_before_residual"))
        )
    elif kind == "eagle":
        tensors = {k[len("model.") :] if k.startswith("model.") else k: v for k, v in tensors.items()}
        lc.num_hidden_layers = 1 + max((int(k.split(".")[1]) for k in tensors if k.startswith("layers.")), default=0)
        head = PairHead(kind, lc, H, 0, layers=(-1,))
    else:
        has_head = "lm_head.weight" in tensors
        head = PairHead(kind, lc, H, lc.vocab_size if has_head else 0, layers=(-1,))
        head.feed_normed = not cfg.get("num_nextn_predict_layers", 0)  # Qwen3-Next feeds its normed output back
    embedded = "embed_tokens.weight" in tensors
    embed = tensors.pop("embed_tokens.weight", None)
    tensors.pop("t2d", None)
    for k in [k for k in tensors if k.startswith("verifier_") or k.endswith("rotary_emb.inv_freq")]:
        tensors.pop(k)
    if kind == "eagle3" and "d2t" not in tensors:
        if head.lm_head.weight.shape[0] != (lc.vocab_size or 0) and "lm_head.weight" in tensors:
            raise HeadLoadError(f"{path}: the EAGLE-3 head has a draft vocabulary but no 'd2t' tensor")
        tensors["d2t"] = torch.zeros(head.lm_head.weight.shape[0], dtype=torch.int64)
    _load_state(head, tensors, path)
    if embed is not None:
        head.embed = embed
    return head, embedded


def _mtp_tensors(cfg: dict, path: Path, lc: LlamaConfig) -> tuple[dict, LlamaConfig]:
    """The MTP layer's tensors in the PairHead's names, from a DeepSeek-V3 or Qwen3-Next checkpoint."""
    if cfg.get("num_nextn_predict_layers", 0):
        L = int(cfg["num_hidden_layers"])
        raw = _read(path, prefix=f"model.layers.{L}.")
        if not raw:
            raise HeadLoadError(f"{path}: num_nextn_predict_layers is set but no 'model.layers.{L}.*' tensors exist")
        if any(k.startswith(("self_attn.kv_a_proj", "self_attn.q_a_proj")) for k in raw):
            raise HeadLoadError(f"{path}: the MTP layer uses multi-head latent attention, which verispec does not run")
        out = {}
        for k, v in raw.items():
            if k.startswith(("enorm.", "hnorm.", "eh_proj.")):
                out[k] = v
            elif k == "shared_head.norm.weight":
                out["norm.weight"] = v
            elif k == "shared_head.head.weight":
                out["lm_head.weight"] = v
            elif k == "embed_tokens.weight":
                out[k] = v
            else:
                out["layers.0." + k] = v
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
    lc.num_hidden_layers = 1 + max((int(k.split(".")[1]) for k in out if k.startswith("layers.")), default=0)
    return out, lc


def _load_state(module: torch.nn.Module, tensors: dict[str, Tensor], path: Path) -> None:
    """Every parameter present with its shape, nothing unknown."""
    want = {k: v for k, v in module.state_dict().items() if not k.startswith("rotary.")}
    missing = sorted(set(want) - set(tensors))
    if missing:
        raise HeadLoadError(f"{path}: missing tensor(s) {', '.join(missing[:5])}{' ...' if len(missing) > 5 else ''}")
    extra = sorted(set(tensors) - set(want))
    if extra:
        raise HeadLoadError(f"{path}: unexpected tensor(s) {', '.join(extra[:5])}{' ...' if len(extra) > 5 else ''}")
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
        tensors = {(k[len("medusa_head.") :] if k.startswith("medusa_head.") else k): v for k, v in tensors.items()}
        names = {}
        for k in tensors:
            parts = k.split(".")
            if len(parts) == 4 and parts[2] == "linear":
                names[k] = f"blocks.{parts[0]}.{parts[1]}.{parts[3]}"
            elif len(parts) == 3 and parts[1] == str(n_layers) and parts[2] == "weight":
                names[k] = f"lm_heads.{parts[0]}.weight"
        tensors = {names.get(k, k): v for k, v in tensors.items()}
        bias = True  # FasterDecoding's ResBlock: nn.Linear(H, H) with its bias
    else:  # vLLM: blocks.{k}.layers.{j}.*, lm_heads.{k}.* (`medusa_heads.` before them in some checkpoints)
        n_heads, n_layers = count("num_heads", 0), count("num_hidden_layers", 1)
        tensors = {
            (k[len("medusa_heads.") :] if k.startswith("medusa_heads.") else k).replace(".layers.", "."): v
            for k, v in tensors.items()
        }
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


def bind_head(head: LoadedHead, target: LoadedModel) -> int:
    """Tie a head to the target it drafts for: its embedding (shared unless the checkpoint has one), its output layer
    where it has none, the target layers it reads; every mismatch a HeadLoadError. Returns the vocabulary size the
    pair uses (the target's)."""
    from ..model.loading import shared_vocab_size

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
        if m.lm_heads[0].in_features != H_t:
            raise HeadLoadError(
                f"{where}: the Medusa heads read hidden size {m.lm_heads[0].in_features}, the target's is {H_t}"
            )
        if m.lm_heads[0].out_features < vocab:
            raise HeadLoadError(
                f"{where}: the Medusa heads' output layers have {m.lm_heads[0].out_features} rows, fewer than the "
                f"target's vocabulary ({vocab})"
            )
        m.to(next(model.parameters()).device)
        return vocab
    if m.kind == "eagle3":
        m.layers_read = m.aux_ids or ((2, L // 2, L - 3) if L >= 4 else tuple(range(min(3, L))))  # per target
        if any(not 0 <= i <= L for i in m.layers_read):
            raise HeadLoadError(
                f"{where}: aux layer ids {list(m.layers_read)} must lie in [0, {L}] (the target has {L} layers)"
            )
        need = m.fc.in_features
        if need != len(m.layers_read) * H_t:
            raise HeadLoadError(
                f"{where}: fc reads {need} features, the target gives {len(m.layers_read)} layers x {H_t} "
                f"(target_hidden_size {need // max(len(m.layers_read), 1)} != the target's hidden size {H_t})"
            )
        ids = torch.arange(len(m.d2t)) + m.d2t.cpu()
        if len(ids) and (int(ids.min()) < 0 or int(ids.max()) >= vocab):
            raise HeadLoadError(f"{where}: d2t maps draft ids outside the target's vocabulary [0, {vocab})")
        if len(ids) != len(torch.unique(ids)):
            raise HeadLoadError(f"{where}: d2t maps two draft ids to one target id")
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
