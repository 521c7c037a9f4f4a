"""What a generator certificate certifies: a method as plain data (`MethodSpec`) and the adapters that turn it into
a sample function (`build_method`): verispec, plain decoding, transformers `generate` (plain, assisted, prompt lookup),
an OpenAI-compatible endpoint (endpoint.py) or a user callable. Models load once per process (`_load`)."""

from __future__ import annotations

import copy
import itertools
import weakref
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace

import torch

from ..crossvocab import same_tokenizer
from ..engine.config import SpecConfig
from ..engine.generator import SpeculativeGenerator
from ..model import loading
from ..model.threads import set_threads
from ..sampling import SamplingParams
from .endpoint import Endpoint, TokenMapper
from .kernel import load_sampler
from .mutants import mutant

__all__ = ["CERTIFY_DEFAULTS", "METHODS", "MethodSpec", "SampleFn", "build_method", "eos_set", "hf_assistant_kwargs"]

METHODS = ("verispec", "plain", "hf", "hf-assisted", "hf-lookup", "callable", "openai")


# a certificate's verispec runs a fixed gamma (seeded samples reproducible run after run; gamma auto follows timings)
# and the stream randomness (auto would Gumbel-couple every seeded sample: the rule would see one-hot targets)
CERTIFY_DEFAULTS = {"gamma": 4, "random": "stream"}
CERTIFY_SPEC = SpecConfig(**CERTIFY_DEFAULTS)


@dataclass(frozen=True)
class MethodSpec:
    """What `certify_generate` certifies, as plain data (rebuilt inside each worker process).

    Attributes:
        method: One of METHODS: "verispec", "plain", "hf", "hf-assisted", "hf-lookup", "callable", "openai".
        target: The target's path or hub id (None: verispec's default model).
        config: verispec's speculation (a SpecConfig, or its string form): a draft model by its path
            (draft=model,model=PATH), gamma, tree, verification rule, randomness, runner. plain takes its random
            and runner, hf-assisted's assistant is its model, hf-lookup's prompt_lookup_num_tokens its gamma.
        dtype: The method's target precision (the reference score is always float32).
        draft_dtype: The draft model's precision.
        callable: Method "callable": `module:function` mapping (prompt_ids, params, seed) to token ids.
        verifier: An injection (`--inject`): a mutant of `verispec.certify.mutants` (a broken verifier of
            `certify.bugs`, an engine-level bug) or a lossy rule (LOSSY_VERIFIERS).
        threads: Torch CPU threads per worker.
        base_url: Method "openai": the endpoint (http://host:port or .../v1).
        model_name: Method "openai": the model name the endpoint serves.
        api_key: Method "openai": sent as a Bearer token.
        max_in_flight: Method "openai": concurrent requests.

    Raises:
        ValueError: An unknown method, or fields that do not fit it.
    """

    method: str = "verispec"
    target: str | None = None
    config: SpecConfig = CERTIFY_SPEC
    dtype: str = "float32"
    draft_dtype: str = "float32"
    callable: str | None = None
    verifier: str | None = None
    threads: int | None = None
    base_url: str | None = None
    model_name: str | None = None
    api_key: str | None = field(default=None, repr=False)
    max_in_flight: int = 8

    def __post_init__(self):
        if isinstance(self.config, str):
            object.__setattr__(self, "config", SpecConfig.parse(self.config))
        if not isinstance(self.config, SpecConfig):
            raise ValueError(f"config must be a SpecConfig or its string form, got {self.config!r}")
        if self.method not in METHODS:
            raise ValueError(f"method must be one of {', '.join(METHODS)}, got {self.method!r}")
        self._check_method()
        self._check_speculation()

    def _check_method(self) -> None:
        cfg = self.config
        if self.method == "hf-lookup" and not (isinstance(cfg.gamma, int) and cfg.gamma >= 1):
            raise ValueError(f"method 'hf-lookup' needs gamma >= 1 (prompt_lookup_num_tokens), got {cfg.gamma!r}")
        if self.method == "openai" and not (self.base_url and self.model_name):
            raise ValueError("method 'openai' needs base_url and model_name (the endpoint and the model it serves)")
        if self.method == "callable" and not self.callable:
            raise ValueError("method 'callable' needs callable='module:function'")
        if self.method == "hf-assisted" and not (cfg.draft == "model" and cfg.model):
            raise ValueError("method 'hf-assisted' needs a draft model (draft=model,model=PATH)")
        if self.verifier is not None and self.method != "verispec":
            raise ValueError(f"a verifier override (--inject) applies to method 'verispec', not {self.method!r}")

    def _check_speculation(self) -> None:
        """What of the config applies to the method (the config checked itself)."""
        cfg = self.config
        if cfg.tree is not None and self.method != "verispec":
            raise ValueError(f"a tree applies to method 'verispec', not {self.method!r}")
        if cfg.verify == "block" and self.method != "verispec":
            raise ValueError(f"verify='block' applies to method 'verispec' with chains (no tree), not {self.method!r}")
        if self.verifier is not None:
            mutant(self.verifier, cfg)  # an injection that does not apply to this config: refused early
        if cfg.random == "position" and self.method not in ("verispec", "plain"):
            raise ValueError("seeding 'position' applies to verispec with a draft model's chains, or to plain")
        if cfg.random == "gumbel" and self.method not in ("verispec", "plain"):
            raise ValueError(f"coupling 'gumbel' applies to methods 'verispec' and 'plain', not {self.method!r}")
        if self.method == "verispec" and cfg.draft == "model" and cfg.model is None:
            raise ValueError("method 'verispec' with draft=model needs the draft model's path (model=PATH)")

    def label(self) -> str:
        if self.method == "verispec":
            extra = f", verifier {self.verifier}" if self.verifier else ""
            return f"verispec ({self.config}, target {self.dtype}{extra})"
        if self.method == "hf-assisted":
            if _tokenizers_differ(self):
                return (
                    f"transformers universal assisted generation: generate(assistant_model={self.config.model}, "
                    "tokenizer=the target's, assistant_tokenizer=the assistant's)"
                )
            return f"transformers generate(assistant_model={self.config.model})"
        if self.method == "hf-lookup":
            return f"transformers generate(prompt_lookup_num_tokens={self.config.gamma})"
        if self.method == "callable":
            return f"callable {self.callable}"
        if self.method == "openai":
            return f"OpenAI endpoint {self.base_url} (model {self.model_name})"
        return {"plain": "verispec plain decoding", "hf": "transformers generate (plain sampling)"}[self.method]


_LOADED: dict = {}


def _load(path: str | None, dtype: str, draft: bool = False):
    """Load once per process: the float32 reference target doubles as the method's float32 target. draft: a draft
    (`engine.drafters.load_draft`: a hidden-state head's directory loads as that head)."""
    from ..engine.drafters import load_draft

    key = (path, dtype)
    if key not in _LOADED:
        _LOADED[key] = load_draft(path, dtype=dtype) if draft else loading.load_model(path, dtype=dtype)
    return _LOADED[key]


# fn(prompt_ids, params, seeds, length) -> (one token list per seed, SpecStats or None[, logprobs]): logprobs,
# when the method returns them, one list per seed of the tokens' raw logprobs (as an engine reports them)
SampleFn = Callable[[list[int], SamplingParams, Sequence[int], int], tuple]


def build_method(spec: MethodSpec) -> SampleFn:
    """spec -> a SampleFn.

    The models come from the per-process cache (`_load`) and are shared: nothing here modifies them."""
    if spec.threads:
        set_threads(spec.threads)  # torch's and llama.cpp's (`load_model` then keeps it)
    if spec.method == "callable":
        return _callable_method(spec)
    target = _load(spec.target, "float32" if spec.method == "openai" else spec.dtype)
    if spec.method == "openai":
        return _openai_method(spec, target)
    if spec.method in ("verispec", "plain"):
        return _verispec_method(spec, target)
    return _hf_method(spec, target)


def _callable_method(spec: MethodSpec) -> SampleFn:
    fn = load_sampler(spec.callable)

    def sample_callable(prompt, params, seeds, length):
        out = []
        for s in seeds:
            toks = [int(t) for t in fn(list(prompt), asdict(replace(params, seed=s)) | {"max_tokens": length}, s)]
            out.append(toks[:length])
        return out, None

    return sample_callable


def _verispec_method(spec: MethodSpec, target) -> SampleFn:
    plain = SpecConfig(draft="none", random=spec.config.random, runner=spec.config.runner)
    cfg = spec.config if spec.method == "verispec" else plain
    if not cfg.drafter.built_by_generator:
        raise ValueError(f"draft={cfg.draft} drafts with objects a MethodSpec cannot name: give certify a sample_fn")
    draft = _load(cfg.model, spec.draft_dtype, draft=True) if cfg.drafter.model else None
    if spec.verifier is None:
        gen = SpeculativeGenerator(target, draft, config=cfg)
    else:  # the mutant's engine (certify.mutants)
        gen = mutant(spec.verifier, cfg).generator(target, draft, cfg)
    eos = eos_set(target)

    def sample_verispec(prompt, params, seeds, length):
        constrained = params.constraint is not None  # the output ends where the grammar does (no ignore_eos)
        outs = gen.generate(
            [list(prompt)] * len(seeds),
            [replace(params, seed=s) for s in seeds],
            max_new_tokens=length,
            ignore_eos=not constrained,
        )
        ended = [_ended(o, eos if constrained else []) for o in outs]
        return [tokens for tokens, _ in ended], gen.last_stats, [logprobs for _, logprobs in ended]

    return sample_verispec


def _ended(o, eos: list[int]) -> tuple[list[int], list[float] | None]:
    """A completion's tokens and raw logprobs, with eos[0] appended when it stopped at an EOS-set id (one outcome,
    as the scores merge it), its logprob the EOS token's own when that was eos[0] (else NaN: not compared)."""
    if not (o.finish_reason == "stop" and o.stop_reason in eos):
        return list(o.token_ids), None if o.raw_logprobs is None else list(o.raw_logprobs)
    own = o.eos_raw_logprob if o.stop_reason == eos[0] and o.eos_raw_logprob is not None else float("nan")
    return list(o.token_ids) + [eos[0]], None if o.raw_logprobs is None else [*o.raw_logprobs, own]


def _openai_method(spec: MethodSpec, target) -> SampleFn:
    """Continuations from an OpenAI-compatible endpoint (endpoint.py); the local target supplies the tokenizer
    (token texts back to ids) and the EOS set. `sample_openai.endpoint.log` records what the run did."""
    endpoint = Endpoint(spec.base_url, spec.model_name, spec.api_key, spec.max_in_flight)
    tok = target.tokenizer
    mapper = TokenMapper(tok)
    eos = eos_set(target)
    adds_bos = tok.bos_token_id is not None and tok("a")["input_ids"][:1] == [tok.bos_token_id]

    def sample_openai(prompt, params, seeds, length):
        ids = list(prompt)
        # as text, a leading BOS is left to a server whose tokenizer adds one itself (as this tokenizer does)
        text = tok.decode(ids[1:] if adds_bos and ids[:1] == [tok.bos_token_id] else ids)
        tokens, logprobs = endpoint.draw(ids, params, list(seeds), length, mapper, eos, text)
        return tokens, None, logprobs

    sample_openai.endpoint = endpoint
    return sample_openai


def _hf_method(spec: MethodSpec, target) -> SampleFn:
    """transformers generate with EOS off for this call only (eos_token_id=None), so every sample has `length`
    tokens, like ignore_eos in verispec; the cached models and their generation configs are left as they are."""
    model = target.model
    draft = _load(spec.config.model, spec.draft_dtype) if spec.method == "hf-assisted" else None
    same = draft is None or same_tokenizer(target, draft)
    lookup = {"prompt_lookup_num_tokens": spec.config.gamma} if spec.method == "hf-lookup" else {}

    def sample_hf(prompt, params, seeds, length):
        kw = _hf_sampling_kwargs(params) | lookup
        if draft is not None:
            kw |= hf_assistant_kwargs(target, draft, sample=kw["do_sample"], same=same)
        ids = torch.tensor([list(prompt)], device=model.device)
        kw |= dict(attention_mask=torch.ones_like(ids), max_new_tokens=length, min_new_tokens=0, pad_token_id=0)
        out = []
        for s in seeds:
            torch.manual_seed(s)
            with torch.no_grad():
                seq = model.generate(ids, eos_token_id=None, **kw)
            out.append(seq[0, ids.shape[1] :].tolist())
        return out, None

    return sample_hf


def hf_assistant_kwargs(target, draft, sample: bool, same: bool | None = None) -> dict:
    """The keywords of `target.model.generate` that make `draft` its assistant (sample: do_sample; same: the result
    of `same_tokenizer`, when known): `assistant_model`, and with different tokenizers `tokenizer` and
    `assistant_tokenizer` too (universal assisted generation: docs/guides/certify.md; its sampling path gets a copy
    of the draft's modules, `_uag_sampling_assistant`). Tokenizers that differ with one vocab_size: ValueError."""
    if same if same is not None else same_tokenizer(target, draft):
        return {"assistant_model": draft.model}
    rows = [m.config.get_text_config().vocab_size for m in (target.model, draft.model)]
    if rows[0] == rows[1]:
        raise ValueError(
            f"the assistant {draft.name!r} and the target {target.name!r} have different tokenizers but the same "
            f"vocab_size ({rows[0]}): transformers runs universal assisted generation only for models whose "
            "vocab_size differs (with equal sizes it refuses assistant_tokenizer and would treat the ids as shared)"
        )
    assistant = _uag_sampling_assistant(target, draft) if sample else draft.model
    return {"assistant_model": assistant, "tokenizer": target.tokenizer, "assistant_tokenizer": draft.tokenizer}


# draft model -> (target tokenizer, draft tokenizer, the copy transformers' UAG sampling may prune)
_UAG_ASSISTANTS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _uag_sampling_assistant(target, draft):
    """The assistant for universal assisted generation's sampling path, which transformers prunes in place once per
    tokenizer pair (its translator cached on the two tokenizers): a copy of the draft's modules sharing its weights,
    one per draft model and tokenizer pair; a new copy drops the pair's cached translator, so it is pruned in turn."""
    held = _UAG_ASSISTANTS.get(draft.model)
    if held is not None and held[0] is target.tokenizer and held[1] is draft.tokenizer:
        return held[2]
    from transformers.generation.candidate_generator import AssistantVocabTranslatorCache

    translators = AssistantVocabTranslatorCache._cache.get(target.tokenizer)
    if translators is not None:
        translators.pop(draft.tokenizer, None)
    shared = {id(t): t for t in itertools.chain(draft.model.parameters(), draft.model.buffers())}
    twin = copy.deepcopy(draft.model, memo=shared)
    _UAG_ASSISTANTS[draft.model] = (target.tokenizer, draft.tokenizer, twin)
    return twin


_TOKENIZERS: dict = {}


def _tokenizer(path: str | None):
    """A model's tokenizer: the loaded model's when this process holds it, else the tokenizer alone (once)."""
    held = next((lm.tokenizer for (p, _), lm in _LOADED.items() if p == path), None)
    if held is not None:
        return held
    if path not in _TOKENIZERS:
        from transformers import AutoTokenizer

        source, _, kwargs = loading._resolve(path)
        _TOKENIZERS[path] = AutoTokenizer.from_pretrained(source, **kwargs)
    return _TOKENIZERS[path]


def _tokenizers_differ(spec: MethodSpec) -> bool:
    """Whether hf-assisted's assistant has another tokenizer than the target (universal assisted generation); False
    when a tokenizer cannot be read (building the method then says why)."""
    try:
        return _tokenizer(spec.target).get_vocab() != _tokenizer(spec.config.model).get_vocab()
    except (OSError, ValueError, loading.ModelLoadError):
        return False


def _hf_sampling_kwargs(params: SamplingParams) -> dict:
    if params.temperature == 0:
        return dict(do_sample=False)
    p = params
    return dict(do_sample=True, temperature=p.temperature, top_k=p.top_k or None, top_p=p.top_p, min_p=p.min_p or None)


def eos_set(loaded) -> list[int]:
    """The ids that end a sequence (the tokenizer's EOS first, then the generation config's), for endpoints that do
    not say which one they stopped at."""
    ids = [loaded.tokenizer.eos_token_id]
    gen = getattr(getattr(loaded.model, "generation_config", None), "eos_token_id", None)
    ids += gen if isinstance(gen, list) else [gen]
    return list(dict.fromkeys(i for i in ids if isinstance(i, int)))
