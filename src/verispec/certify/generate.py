"""Generator-level certificate: do a generator's continuations follow the target model's own distribution?

Draw N continuations of L tokens per prompt from a method (verispec in any configuration, plain decoding, HF
transformers `generate` with or without `assistant_model`, or a user callable), score every emitted token under
the target's processed conditionals (transformers forward, the reference precision), and test:
  (a) first token: chi-square goodness of fit against p(. | prompt), exactly; for small vocabularies also the
      whole first m-token sequence against its exact law (all V^m sequences enumerated from the target);
  (b) randomized PIT: u_t = F_t(x_t - 1) + v p_t(x_t) is i.i.d. U(0, 1) over all positions (Rosenblatt);
      Kolmogorov-Smirnov test;
  (c) log-likelihood: sum_t log p_t(x_t) against its expectation -sum_t H(p_t), standardized by the conditional
      variances (catches sharpened / flattened output, e.g. a temperature mismatch);
  (d) two-sample: tokens at positions 1..m against as many samples of plain decoding (chi-square homogeneity),
      or of a reference endpoint (`reference_fn`), the test that assumes nothing about numerics.
Methods that return their tokens' logprobs (verispec; an OpenAI endpoint, `method="openai"`, see endpoint.py)
also get a logprob-parity table: the returned logprobs against the float32 recompute of the same tokens.
With `tv_tolerance` > 0 (another engine's numerics), (a) becomes a test of TV <= tolerance (stats'
tolerant_tv_test) and the exact-equality tests (b), (c) and the sequence test are left out.
All p-values are Holm-corrected into one verdict at a stated family-wise level, with each test's detectable
effect at power 0.99. A first-token test that cannot detect any deviation makes the verdict INCONCLUSIVE (never
PASS), with the N that would detect TV TARGET_TV.

Samples are independent (sample i of prompt j uses seed base + j * N + i whatever the batching), so `workers`
processes can share them and the result does not depend on how many there are.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import numpy as np
import torch

from .. import strict_json
from ..drafting import TreeSpec
from ..engine.generator import SpeculativeGenerator
from ..engine.stats import SpecStats
from ..model import loading
from ..sampling import CHAIN_RULES, SamplingParams, probs_from_logits
from ..sampling.coupling import COUPLINGS
from ..sampling.lossy import lenient_verifier, spec_rl_verifier, typical_verifier
from .bugs import (
    BLOCK_BUGS,
    BUGS,
    TREE_BUGS,
    TREE_NON_BUGS,
    broken_block_verifier,
    broken_tree_verifier,
    broken_verifier,
)
from .endpoint import Endpoint, TokenMapper
from .kernel import DEFAULT_LEVEL, POWER, Verdict, has_power, load_sampler, samples_needed
from .stats import (
    chisquare_gof,
    chisquare_two_sample,
    detectable_tv,
    holm,
    loglik_test,
    pit_uniformity,
    tolerant_tv_test,
)

__all__ = ["METHODS", "GenerateReport", "MethodSpec", "build_method", "certify_generate", "write_report"]

DEFAULT_SAMPLES = 2000  # continuations per prompt
DEFAULT_LENGTH = 8  # tokens per continuation
METHODS = ("verispec", "plain", "hf", "hf-assisted", "hf-lookup", "callable", "openai")
REFERENCE_SEED_OFFSET = 7_919_000  # the two-sample reference's samples use seeds offset by this
PARITY_THRESHOLD = 1e-3  # logprob parity: the fraction of tokens whose |difference| exceeds this is reported


@dataclass(frozen=True)
class MethodSpec:
    """What to certify, as plain data (rebuilt inside each worker process)."""

    method: str = "verispec"  # one of METHODS
    target: str | None = None  # model path / hub id (None: verispec's default model)
    draft: str = "ngram"  # verispec: draft model path, 'ngram', 'self' or 'none'; hf-assisted: the assistant model
    draft_quant: str | None = None
    gamma: int | str = 4
    runner: str = "auto"
    dtype: str = "float32"  # the method's target precision (the reference score is always float32)
    draft_dtype: str = "float32"
    callable: str | None = None  # method 'callable': module:function mapping (prompt_ids, params, seed) -> tokens
    verifier: str | None = None  # a bug from verispec.certify.bugs, or a lossy rule: LOSSY_VERIFIERS
    threads: int | None = None
    tree: str | None = None  # verispec: a tree shape ('4-2-2-1', 'dynamic-D-K-M'); None = chains
    tree_rule: str | None = None  # 'deterministic' (default), 'iid', 'without_replacement'
    verify: str = "token"  # verispec chains: 'token' or 'block' verification
    coupling: str | None = None  # verispec / plain: 'gumbel' (sampling.coupling)
    seeding: str = "stream"  # verispec / plain: 'position' (sampling.positional)
    base_url: str | None = None  # openai: the endpoint (http://host:port or .../v1)
    model_name: str | None = None  # openai: the model name the endpoint serves
    api_key: str | None = field(default=None, repr=False)  # openai: sent as a Bearer token
    max_in_flight: int = 8  # openai: concurrent requests

    def __post_init__(self):
        if self.method not in METHODS:
            raise ValueError(f"method must be one of {', '.join(METHODS)}, got {self.method!r}")
        if self.method == "hf-lookup" and not (isinstance(self.gamma, int) and self.gamma >= 1):
            raise ValueError(f"method 'hf-lookup' needs gamma >= 1 (prompt_lookup_num_tokens), got {self.gamma!r}")
        if self.method == "openai" and not (self.base_url and self.model_name):
            raise ValueError("method 'openai' needs base_url and model_name (the endpoint and the model it serves)")
        if self.method == "callable" and not self.callable:
            raise ValueError("method 'callable' needs callable='module:function'")
        if self.method == "hf-assisted" and self.draft in ("ngram", "self", "none", None):
            raise ValueError("method 'hf-assisted' needs a draft model (draft=PATH)")
        if self.verifier is not None and self.method != "verispec":
            raise ValueError(f"a verifier override (--inject) applies to method 'verispec', not {self.method!r}")
        if self.tree is not None and self.method != "verispec":
            raise ValueError(f"a tree applies to method 'verispec', not {self.method!r}")
        if self.tree is not None:
            TreeSpec.parse(self.tree, self.tree_rule)  # validate early
        elif self.tree_rule is not None:
            raise ValueError("tree_rule needs a tree")
        if self.verify not in CHAIN_RULES:
            raise ValueError(f"verify must be one of {', '.join(CHAIN_RULES)}, got {self.verify!r}")
        if self.verify != "token" and (self.method != "verispec" or self.tree is not None):
            raise ValueError(f"verify={self.verify!r} applies to method 'verispec' with chains (no tree)")
        if self.verifier is not None:
            _verifier(self.verifier, tree=self.tree is not None, block=self.verify == "block")  # validate early
        if self.seeding not in ("stream", "position"):
            raise ValueError(f"seeding must be 'stream' or 'position', got {self.seeding!r}")
        if self.seeding == "position" and (
            self.method not in ("verispec", "plain") or self.tree or self.draft == "ngram"
        ):
            raise ValueError("seeding 'position' applies to verispec with a draft model's chains, or to plain")
        if self.coupling is not None and self.verifier is not None:
            raise ValueError(
                "an injected verifier under coupling sees one-hot targets, where most bugs verify exactly: "
                "certify the coupled verifier with `certify kernel --coupling gumbel --inject ...`"
            )
        if self.coupling is not None and (self.coupling not in COUPLINGS or self.method not in ("verispec", "plain")):
            raise ValueError(f"coupling {self.coupling!r} applies to methods 'verispec' and 'plain' ({COUPLINGS})")

    def label(self) -> str:
        if self.method == "verispec":
            d = self.draft + (f" ({self.draft_quant})" if self.draft_quant else "")
            extra = f", verifier {self.verifier}" if self.verifier else ""
            extra += f", {self.verify} verification" if self.verify != "token" else ""
            extra += f", {self.coupling} coupling" if self.coupling else ""
            extra += ", seeding by position" if self.seeding == "position" else ""
            if self.tree:
                return (
                    f"verispec (draft {d}, tree {self.tree} {self.tree_rule or 'deterministic'}, "
                    f"target {self.dtype}{extra})"
                )
            return f"verispec (draft {d}, gamma {self.gamma}, target {self.dtype}{extra})"
        if self.method == "hf-assisted":
            return f"transformers generate(assistant_model={self.draft})"
        if self.method == "hf-lookup":
            return f"transformers generate(prompt_lookup_num_tokens={self.gamma})"
        if self.method == "callable":
            return f"callable {self.callable}"
        if self.method == "openai":
            return f"OpenAI endpoint {self.base_url} (model {self.model_name})"
        return {"plain": "verispec plain decoding", "hf": "transformers generate (plain sampling)"}[self.method]


LOSSY_VERIFIERS = "lenient:L (L in (0, 1]), typical, spec-rl[:L] (L >= 1)"  # the lossy rules _verifier knows


def _verifier(name: str, tree: bool = False, block: bool = False):
    if block:
        if name not in BLOCK_BUGS:
            raise ValueError(f"with verify='block' the verifier override must be a block bug: {', '.join(BLOCK_BUGS)}")
        return broken_block_verifier(name)
    if name in BLOCK_BUGS:
        raise ValueError(f"{name} is a block verification bug: it needs verify='block'")

    if tree:
        usable = [b for b in TREE_BUGS + TREE_NON_BUGS if not b.startswith("tree_mixed_")]
        if name in usable:
            return broken_tree_verifier(name)
        if name.startswith("tree_mixed_"):  # they act only on rule 'mixed', which these trees never use: a sure PASS
            raise ValueError(f"{name} breaks rule 'mixed' only; certify it with `certify kernel --tree mixed`")
        raise ValueError(f"with a tree the verifier override must be a tree bug: {', '.join(usable)}")
    if name in TREE_BUGS + TREE_NON_BUGS:
        raise ValueError(f"{name} is a tree bug: it needs a tree")
    if name in BUGS:
        return broken_verifier(name)
    if name.startswith("lenient"):
        try:
            return lenient_verifier(float(name.partition(":")[2] or 0.5))
        except ValueError:
            raise ValueError(f"lenient takes a lenience in (0, 1]: 'lenient:0.5', got {name!r}") from None
    if name == "typical":
        return typical_verifier()
    if name == "spec-rl" or name.startswith("spec-rl:"):
        try:
            return spec_rl_verifier(float(name.partition(":")[2] or 1.0))
        except ValueError:
            raise ValueError(
                f"spec-rl takes a finite lenience >= 1: 'spec-rl' (l = 1) or 'spec-rl:2', got {name!r}"
            ) from None
    raise ValueError(f"unknown verifier {name!r}: one of {', '.join(BUGS)}, {LOSSY_VERIFIERS}")


_LOADED: dict = {}


def _load(path: str | None, dtype: str):
    """Load once per process: the float32 reference target doubles as the method's float32 target."""

    key = (path, dtype)
    if key not in _LOADED:
        _LOADED[key] = loading.load_model(path, dtype=dtype)  # looked up at call time (tests patch it)
    return _LOADED[key]


# fn(prompt_ids, params, seeds, length) -> (one token list per seed, SpecStats or None[, logprobs]): logprobs,
# when the method returns them, one list per seed of the tokens' raw logprobs (as an engine reports them)
SampleFn = Callable[[list[int], SamplingParams, Sequence[int], int], tuple]


def build_method(spec: MethodSpec) -> SampleFn:
    """spec -> a SampleFn.

    The models come from the per-process cache (`_load`) and are shared: nothing here modifies them."""
    if spec.threads:
        torch.set_num_threads(spec.threads)
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

    draft = "none" if spec.method == "plain" else spec.draft
    if draft not in ("ngram", "none", "self"):
        draft = _load(draft, spec.draft_dtype)
    kwargs = {}
    if spec.verifier:  # the override replaces the rule's verifier (a block bug replaces verify_block)
        override = _verifier(spec.verifier, tree=spec.tree is not None, block=spec.verify == "block")
        kwargs["tree_verifier" if spec.tree else "verifier"] = override
    elif spec.verify != "token":
        kwargs["verify"] = spec.verify
    if spec.coupling is not None:
        kwargs["coupling"] = spec.coupling
    if spec.seeding != "stream":
        kwargs["seeding"] = spec.seeding
    if spec.tree:
        kwargs.update(tree=spec.tree, tree_rule=spec.tree_rule)
    gen = SpeculativeGenerator(
        target,
        draft,
        gamma=spec.gamma if draft != "none" else 0,
        runner=spec.runner,
        draft_quant=spec.draft_quant,
        **kwargs,
    )

    def sample_verispec(prompt, params, seeds, length):
        outs = gen.generate(
            [list(prompt)] * len(seeds),
            [replace(params, seed=s) for s in seeds],
            max_new_tokens=length,
            ignore_eos=True,
        )
        return [o.token_ids for o in outs], gen.last_stats, [o.raw_logprobs for o in outs]

    return sample_verispec


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
    """transformers generate with EOS off for this call only (eos_token_id=None; the assistant takes the
    target's), so every sample has `length` tokens, like ignore_eos in verispec. The cached models'
    generation configs are left as they are."""
    model = target.model
    assistant = _load(spec.draft, spec.draft_dtype).model if spec.method == "hf-assisted" else None
    lookup = {"prompt_lookup_num_tokens": spec.gamma} if spec.method == "hf-lookup" else {}

    def sample_hf(prompt, params, seeds, length):
        kw = _hf_sampling_kwargs(params) | lookup
        ids = torch.tensor([list(prompt)], device=model.device)
        out = []
        for s in seeds:
            torch.manual_seed(s)
            with torch.no_grad():
                seq = model.generate(
                    ids,
                    attention_mask=torch.ones_like(ids),
                    max_new_tokens=length,
                    min_new_tokens=0,
                    pad_token_id=0,
                    eos_token_id=None,
                    assistant_model=assistant,
                    **kw,
                )
            out.append(seq[0, ids.shape[1] :].tolist())
        return out, None

    return sample_hf


def _hf_sampling_kwargs(params: SamplingParams) -> dict:
    if params.temperature == 0:
        return dict(do_sample=False)
    return dict(
        do_sample=True,
        temperature=params.temperature,
        top_k=params.top_k or None,
        top_p=params.top_p,
        min_p=params.min_p or None,
    )


# --- scoring ------------------------------------------------------------------------------------------------


@dataclass
class Scores:
    """Per emitted token, flattened over samples and positions (in sample order)."""

    logp: list[float] = field(default_factory=list)  # log p_t(x_t)
    raw_logp: list[float] = field(default_factory=list)  # log softmax(logits_t)(x_t): temperature 1, no truncation
    key: list[tuple] = field(default_factory=list)  # (the sample's key: (prompt, sample index), position)
    expected: list[float] = field(default_factory=list)  # sum_x p_t(x) log p_t(x)
    variance: list[float] = field(default_factory=list)  # Var_{x ~ p_t}[log p_t(x)]
    pit: list[float] = field(default_factory=list)  # randomized PIT value
    position: list[int] = field(default_factory=list)


@torch.no_grad()
def score(
    model,
    prompt: list[int],
    samples: list[list[int]],
    params: SamplingParams,
    rng: np.random.Generator,
    out: Scores,
    chunk: int = 8,
    keys: Sequence | None = None,
    eos: Sequence[int] = (),
) -> np.ndarray:
    """Score samples of one prompt under the processed target; returns p(. | prompt) [V] (float64).
    keys: each sample's key (recorded in out.key with each token's position; default 0, 1, ...). eos: an EOS set
    scored as one outcome, eos[0] (the probabilities of the others moved onto it)."""
    dev = next(model.parameters()).device
    first = None
    by_len: dict[int, list[tuple[int, list[int]]]] = {}
    for key, s in zip(range(len(samples)) if keys is None else keys, samples):
        by_len.setdefault(len(s), []).append((key, s))
    for length, keyed in by_len.items():
        if length == 0:
            continue
        for i in range(0, len(keyed), chunk):
            part = [s for _, s in keyed[i : i + chunk]]
            out.key += [(key, t) for key, _ in keyed[i : i + chunk] for t in range(length)]
            ids = torch.tensor([prompt + s[:-1] for s in part], device=dev)  # [b, P + L - 1]
            logits = model(input_ids=ids, logits_to_keep=length).logits[:, -length:].float()  # [b, L, V]
            p = _merge(probs_from_logits(logits, params).double(), eos)  # [b, L, V]
            if first is None:
                first = p[0, 0].cpu().numpy()
            tok = torch.tensor(part, device=dev).unsqueeze(-1)  # [b, L, 1]
            px = p.gather(-1, tok).squeeze(-1)
            out.raw_logp += torch.log_softmax(logits.double(), -1).gather(-1, tok).flatten().tolist()
            before = p.cumsum(-1).gather(-1, tok).squeeze(-1) - px
            logp_all = torch.where(p > 0, p.clamp_min(1e-300).log(), torch.zeros_like(p))
            e = (p * logp_all).sum(-1)
            var = (p * logp_all**2).sum(-1) - e**2
            v = torch.from_numpy(rng.random(px.shape)).to(dev)
            out.logp += (
                torch.where(px > 0, px.clamp_min(1e-300).log(), torch.full_like(px, -math.inf)).flatten().tolist()
            )
            out.expected += e.flatten().tolist()
            out.variance += var.clamp_min(0).flatten().tolist()
            out.pit += (before + v * px).flatten().tolist()
            out.position += list(range(length)) * len(part)
    if first is None:
        logits = model(input_ids=torch.tensor([prompt], device=dev), logits_to_keep=1).logits[:, -1:].float()
        first = _merge(probs_from_logits(logits, params).double(), eos)[0, 0].cpu().numpy()
    return first


def _merge(p, eos: Sequence[int]):
    """p [..., V] with the probabilities of eos[1:] moved onto eos[0] (one outcome, "the sequence ended")."""
    if len(eos) <= 1:
        return p
    rest = list(eos[1:])
    p[..., eos[0]] += p[..., rest].sum(-1)
    p[..., rest] = 0
    return p


@torch.no_grad()
def exact_sequence_law(model, prompt: list[int], params: SamplingParams, m: int) -> np.ndarray:
    """P(x_1..x_m | prompt) under the processed target, flattened over V^m sequences (small V only)."""
    dev = next(model.parameters()).device
    joint = torch.ones(1, dtype=torch.float64, device=dev)
    prefixes = torch.empty((1, 0), dtype=torch.int64, device=dev)
    V = None
    for _ in range(m):
        n = prefixes.shape[0]
        ids = torch.cat([torch.tensor(prompt, device=dev).expand(n, -1), prefixes], 1)
        p = probs_from_logits(model(input_ids=ids, logits_to_keep=1).logits[:, -1].float(), params).double()
        V = p.shape[-1]
        joint = (joint.unsqueeze(1) * p).reshape(-1)
        prefixes = torch.cat([prefixes.repeat_interleave(V, 0), torch.arange(V, device=dev).repeat(n).unsqueeze(1)], 1)
    return joint.cpu().numpy()


# --- the certificate -----------------------------------------------------------------------------------------


@dataclass
class TestResult:
    name: str
    kind: str  # first-token, sequence, pit, loglik, two-sample
    statistic: float
    pvalue: float
    n: int
    detectable: float  # smallest effect detected with power 0.99 (unit in `effect`)
    effect: str
    holm_pvalue: float = float("nan")
    # where the counts differ most from the law (or from the reference's): token, observed / expected frequency
    deviations: list[dict] = field(default_factory=list)

    @property
    def powered(self) -> bool:
        """Some effect short of the largest possible is detectable (no upper bound for nats per token)."""
        return math.isfinite(self.detectable) if self.kind == "loglik" else has_power(self.detectable)


@dataclass
class GenerateReport(Verdict):
    method: str
    target: str | None
    params: dict
    prompts: int
    samples: int
    length: int
    level: float
    power: float
    seed: int
    tests: list[TestResult]
    acceptance: list[float]  # per-position acceptance of the speculative method (empty otherwise)
    acceptance_rate: float
    tau: float
    pit: list[float]  # all PIT values (for the histogram)
    seconds: float
    errors: list[str] = field(default_factory=list)
    samples_needed: int | None = None  # INCONCLUSIVE: continuations per prompt to detect TARGET_TV everywhere
    tv_tolerance: float = 0.0  # > 0: the first-token tests test TV <= this (another engine's numerics)
    parity: dict | None = None  # logprob_parity: returned logprobs against the float32 recompute
    endpoint: dict | None = None  # method 'openai': requests, retries, refused fields, EOS appended, ...
    request_seeds: dict | None = None  # every request's seed (the rule and each prompt's range)
    reference_endpoint: dict | None = None  # the --reference-url endpoint's log, when it was the two-sample reference
    unusable: list[str] = field(default_factory=list)  # samples a method could not return: INCONCLUSIVE

    @property
    def rejected(self) -> bool:
        """As Verdict's, unless samples were dropped (their loss conditions the law: no FAIL, no PASS)."""
        return not self.unusable and Verdict.rejected.fget(self)

    @property
    def conclusive(self) -> bool:
        """Every prompt's first-token law is tested with power (a deviation below TV 1 is detectable)."""
        first = [t for t in self.tests if t.kind == "first-token"]
        return bool(first) and all(t.powered for t in first) and not self.unusable

    def power_note(self) -> str:
        if self.conclusive:
            return ""
        if self.unusable:
            return (
                "INCONCLUSIVE: some samples could not be returned as token ids (a token text no single id has: use "
                f"a server that honours return_tokens_as_token_ids): {'; '.join(self.unusable)}."
            )
        need = self.needed_note(f"N = {self.samples_needed} continuations per prompt")
        return (
            f"INCONCLUSIVE: with N = {self.samples} continuations per prompt a first-token test has no power "
            f"(it cannot detect any deviation){need}."
        )

    def to_json(self) -> dict:
        d = self.json_with_verdict()
        d.pop("pit")
        return d

    def to_markdown(self) -> str:
        lines = [
            f"# verispec certify generate: **{self.verdict}**",
            "",
            f"method: {self.method}; target `{self.target}`; params {self.params}",
            "",
            f"{self.prompts} prompt(s) x N = {self.samples} continuations x L = {self.length} tokens; "
            f"{len(self.tests)} tests, Holm-corrected at family-wise level {self.level}; power {self.power} for "
            f"the detectable effects (each at the Bonferroni level); seed {self.seed}; {self.seconds:.0f} s.",
        ]
        if not self.conclusive:
            lines += ["", self.power_note()]
        if self.acceptance:
            lines += [
                "",
                f"acceptance rate {self.acceptance_rate:.3f}, tau {self.tau:.2f} tokens per target pass; "
                f"per position: {' '.join(f'{a:.2f}' for a in self.acceptance)}",
            ]
        if self.tv_tolerance:
            lines += [
                "",
                f"Tolerance: the first-token tests test H0 TV <= {self.tv_tolerance:g} (numeric drift allowed; a "
                "distribution-free bound, stats.tolerant_tv_test); the exact-equality tests (PIT, log-likelihood, "
                "sequence) are left out.",
            ]
        if self.endpoint:
            e = self.endpoint
            lines += [
                "",
                f"endpoint: {e['requests']} requests, {e['retries']} retries; refused optional fields: "
                f"{', '.join(e['dropped_fields']) or 'none'}; {e['eos_appended']} continuations ended at EOS; "
                f"{e['mapped_by_text']} token ids mapped from their text (no token_id:N)."
                + (f" The server's speculation counters: {e['speculation']}." if e.get("speculation") else "")
                + (f" Unmappable: {'; '.join(e['unmappable_examples'])}." if e.get("unmappable_examples") else ""),
            ]
        if self.request_seeds:
            r = self.request_seeds
            lines += [
                "",
                f"seeds ({r['rule']}): {r['per_prompt_first_last']}"
                + (f"; {r['reference']}" if "reference" in r else ""),
            ]
        lines += self._parity_lines()
        if self.errors:
            lines += ["", "## Errors", ""] + [f"- {e}" for e in self.errors]
        lines += [
            "",
            "| test | kind | statistic | n | p-value | Holm p | detectable effect | verdict |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for t in self.tests:
            mark = "**reject**" if t.holm_pvalue < self.level else "ok" if t.powered else "no power"
            lines.append(
                f"| {t.name} | {t.kind} | {t.statistic:.3g} | {t.n} | {t.pvalue:.3g} | {t.holm_pvalue:.3g} | "
                f"{t.detectable:.4g} {t.effect} | {mark} |"
            )
        rejected = [t for t in self.tests if t.holm_pvalue < self.level and t.deviations]
        if rejected:
            lines += ["", "## Where it deviates (tokens whose frequency differs most: observed / expected)", ""]
            for t in rejected:
                cells = ", ".join(f"{d['token']}: {d['observed']:.4f} / {d['expected']:.4f}" for d in t.deviations)
                lines.append(f"- {t.name}: {cells}")
        return "\n".join(lines) + "\n"

    def _parity_lines(self) -> list[str]:
        if not self.parity:
            return []
        p = self.parity
        lines = [
            "",
            f"## Logprob parity ({p['tokens']} tokens: returned logprobs against the float32 recompute)",
            "",
            f"| against | max abs diff | mean abs diff | fraction > {p['threshold']:g} |",
            "|---|---|---|---|",
        ]
        for k in ("raw", "processed"):
            d = p[k]
            lines.append(f"| {k} | {d['max_abs']:.3g} | {d['mean_abs']:.3g} | {d['frac_over_threshold']:.4f} |")
        per = p["raw"]["per_position"]
        lines += [
            "",
            "raw, per position (max / mean): "
            + ", ".join(f"{r['position']}: {r['max']:.2g} / {r['mean']:.2g}" for r in per),
        ]
        return lines


def _progress():
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

    return Progress(
        TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn(), transient=True
    )


_WORKER: dict = {}


def _worker_init(spec: MethodSpec) -> None:
    _WORKER["fn"] = build_method(spec)


def _worker_run(task):
    prompt, params, seeds, length = task
    return _WORKER["fn"](prompt, params, seeds, length)


def draw_samples(
    spec: MethodSpec,
    prompts: list[list[int]],
    params: SamplingParams,
    n: int,
    length: int,
    seed: int,
    workers: int = 1,
    chunk: int = 16,
    label: str = "sampling",
    show_progress: bool = True,
    sample_fn: SampleFn | None = None,
):
    """N continuations per prompt: returns samples[prompt][i] (token lists), the pooled SpecStats (or None) and
    logprobs[prompt][i] (the method's returned logprobs of sample i, or None)."""

    tasks = [
        (j, list(prompts[j]), params, list(range(seed + j * n + i, seed + j * n + min(i + chunk, n))), length)
        for j in range(len(prompts))
        for i in range(0, n, chunk)
    ]
    samples: list[list[list[int]]] = [[] for _ in prompts]
    logprobs: list[list] = [[] for _ in prompts]
    pooled = SpecStats()
    seen_stats = False
    bar = _progress() if show_progress else None
    if bar:
        bar.start()
        task_id = bar.add_task(label, total=n * len(prompts))
    try:
        pool = None
        if workers > 1 and sample_fn is None:
            import multiprocessing as mp

            wspec = replace(spec, threads=max(1, (os.cpu_count() or 1) // workers))
            pool = ProcessPoolExecutor(
                workers, mp_context=mp.get_context("spawn"), initializer=_worker_init, initargs=(wspec,)
            )
            results = pool.map(_worker_run, [t[1:] for t in tasks])
        else:
            fn = sample_fn or build_method(spec)
            results = (fn(*t[1:]) for t in tasks)
        for (j, *_), (tokens, stats, *lps) in zip(tasks, results):  # one collection loop for both ways of sampling
            samples[j] += tokens
            logprobs[j] += lps[0] if lps and lps[0] is not None else [None] * len(tokens)
            if stats is not None:
                pooled.merge(stats)
                seen_stats = True
            if bar:
                bar.advance(task_id, len(tokens))
    finally:
        if pool is not None:
            pool.shutdown()
        if bar:
            bar.stop()
    return samples, (pooled if seen_stats else None), logprobs


def certify_generate(
    spec: MethodSpec,
    prompts: list[list[int]],
    params: SamplingParams,
    *,
    samples: int = DEFAULT_SAMPLES,
    length: int = DEFAULT_LENGTH,
    level: float = DEFAULT_LEVEL,
    power: float = POWER,
    seed: int = 0,
    workers: int = 1,
    two_sample_tokens: int = 2,
    sequence_tokens: int = 2,
    reference=None,
    show_progress: bool = True,
    sample_fn: SampleFn | None = None,
    reference_fn: SampleFn | None = None,
    tv_tolerance: float = 0.0,
) -> GenerateReport:
    """Run the generator certificate. `reference`: the scoring model (a LoadedModel in float32; loaded from
    spec.target when None; when given, the two-sample test's reference is plain decoding of it unless reference_fn
    says otherwise). `two_sample_tokens`: m for test (d) (0 = off; skipped for plain methods; with a tolerance,
    run only against a reference_fn). `sequence_tokens`: m for the whole-sequence test (a) (only when
    V^m <= 4096). `tv_tolerance`: see the module docstring."""
    _check_request(params, samples, length, prompts, level)
    if not 0 <= tv_tolerance < 1:
        raise ValueError(f"tv_tolerance must lie in [0, 1), got {tv_tolerance}")
    t0 = time.perf_counter()
    scorer = reference if reference is not None else _load(spec.target, "float32")
    model, V = scorer.model, scorer.model.get_output_embeddings().weight.shape[0]
    if sample_fn is None and spec.method == "openai":  # in this process: its concurrency is HTTP requests
        sample_fn = build_method(spec)
    eos = eos_set(scorer) if spec.method == "openai" else []  # endpoints: every EOS id one outcome (endpoint.py)
    chunk = 4 * spec.max_in_flight if spec.method == "openai" else 16
    got, stats, lps = draw_samples(
        spec, prompts, params, samples, length, seed, workers, chunk, spec.label(), show_progress, sample_fn
    )
    got, lps, unusable = _usable(got, lps, "")
    sc = Scores()
    tests, laws, tolerant = _exact_tests(
        model, prompts, got, params, np.random.default_rng(seed), sc, sequence_tokens, tv_tolerance, eos
    )
    fit = None if tv_tolerance else _fit_tests(sc, tests)
    if two_sample_tokens > 0 and spec.method != "plain" and (not tv_tolerance or reference_fn is not None):
        m = min(length, two_sample_tokens)
        ref_samples = _reference_samples(
            spec, reference, reference_fn, prompts, params, samples, m, seed, workers, show_progress
        )
        ref_samples, _, ref_unusable = _usable([[_cut_at_eos(x, eos) for x in g] for g in ref_samples], None, "ref ")
        unusable += ref_unusable
        _two_sample_tests(got, ref_samples, m, V, tests, laws)
    per_test = level / len(tests)
    _size_tests(tests, laws, per_test, power, fit, tolerant)
    return GenerateReport(
        method=spec.label(),
        target=spec.target,
        params=asdict(params),
        prompts=len(prompts),
        samples=samples,
        length=length,
        level=level,
        power=power,
        seed=seed,
        tests=tests,
        **_acceptance(stats),
        pit=sc.pit,
        seconds=time.perf_counter() - t0,
        errors=_sample_errors(got, length, V, eos[0] if eos else None),
        samples_needed=_samples_needed(laws, samples, per_test, power),
        tv_tolerance=tv_tolerance,
        parity=logprob_parity(sc, lps),
        endpoint=_endpoint_log(sample_fn),
        reference_endpoint=_endpoint_log(reference_fn) if any(t.kind == "two-sample" for t in tests) else None,
        request_seeds=_request_seeds(prompts, samples, seed, any(t.kind == "two-sample" for t in tests)),
        unusable=unusable,
    )


def eos_set(loaded) -> list[int]:
    """The ids that end a sequence (the tokenizer's EOS first, then the generation config's), for endpoints that do
    not say which one they stopped at."""
    ids = [loaded.tokenizer.eos_token_id]
    gen = getattr(getattr(loaded.model, "generation_config", None), "eos_token_id", None)
    ids += gen if isinstance(gen, list) else [gen]
    return list(dict.fromkeys(i for i in ids if isinstance(i, int)))


def _cut_at_eos(sample: list[int] | None, eos: Sequence[int]) -> list[int] | None:
    """A sample cut after its first EOS-set id, written as eos[0] (a reference decoded past EOS, endpoint.py)."""
    if sample is None or not eos:
        return sample
    cut = next((i for i, t in enumerate(sample) if t in eos), None)
    return sample if cut is None else sample[:cut] + [eos[0]]


def _usable(got, lps, label: str):
    """(samples, logprobs) without the samples a method could not return (None: a token text an endpoint printed
    maps to no single id), and one line per prompt that lost some: such a certificate is INCONCLUSIVE."""
    lps = lps if lps is not None else [[None] * len(g) for g in got]
    kept = [[(s, lp) for s, lp in zip(g, lg) if s is not None] for g, lg in zip(got, lps)]
    lost = [f"{label}prompt {j}: {len(g) - len(k)} samples dropped" for j, (g, k) in enumerate(zip(got, kept))]
    return (
        [[s for s, _ in k] for k in kept],
        [[lp for _, lp in k] for k in kept],
        [x for x, g, k in zip(lost, got, kept) if len(g) > len(k)],
    )


def _fit_tests(sc: Scores, tests: list[TestResult]):
    """Append the PIT-uniformity and log-likelihood tests (exact equality); returns their results."""
    u = pit_uniformity(sc.pit)
    tests.append(TestResult("all/pit-uniformity", "pit", u.statistic, u.pvalue, u.n, 0.0, "KS distance"))
    ll = loglik_test(sc.logp, sc.expected, sc.variance)
    tests.append(TestResult("all/log-likelihood", "loglik", ll.z, ll.pvalue, ll.n, 0.0, "nats/token"))
    return u, ll


def _endpoint_log(fn) -> dict | None:
    endpoint = getattr(fn, "endpoint", None)
    if endpoint is None:
        return None
    log = asdict(endpoint.log)
    return log | {"unmappable": len(log["unmappable"]), "unmappable_examples": log["unmappable"][:10]}


def _request_seeds(prompts, samples: int, seed: int, reference: bool) -> dict:
    """Every request's seed, to replay any sample alone: sample i of prompt j used seed + j * N + i."""
    ranges = [[seed + j * samples, seed + (j + 1) * samples - 1] for j in range(len(prompts))]
    out = {"rule": "sample i of prompt j: seed + j * N + i", "per_prompt_first_last": ranges}
    if reference:
        out["reference"] = f"two-sample reference: the same rule plus {REFERENCE_SEED_OFFSET}"
    return out


def logprob_parity(sc: Scores, logprobs: list[list]) -> dict | None:
    """The method's returned logprobs against the float32 recompute of the same tokens: against the raw
    log-softmax (what engines return by default) and against the processed distribution (temperature, top-k/p);
    max / mean |difference|, the fraction over PARITY_THRESHOLD, and per position. None when none were returned."""
    got, raw, proc, pos = [], [], [], []
    for ((j, i), t), r, q in zip(sc.key, sc.raw_logp, sc.logp):
        lp = logprobs[j][i] if j < len(logprobs) and i < len(logprobs[j]) else None
        if lp is None or t >= len(lp) or not math.isfinite(lp[t]):
            continue
        got.append(lp[t])
        raw.append(r)
        proc.append(q)
        pos.append(t)
    if not got:
        return None
    got_a, pos_a = np.array(got), np.array(pos)

    def summary(ref: list[float]) -> dict:
        d = np.abs(got_a - np.array(ref))
        d = np.where(np.isfinite(d), d, np.inf)  # a -inf recompute (a token outside the support) counts as inf
        per = [
            {"position": int(t), "max": float(d[pos_a == t].max()), "mean": float(d[pos_a == t].mean())}
            for t in np.unique(pos_a)
        ]
        return {
            "max_abs": float(d.max()),
            "mean_abs": float(d.mean()),
            "frac_over_threshold": float((d > PARITY_THRESHOLD).mean()),
            "per_position": per,
        }

    return {"tokens": len(got), "threshold": PARITY_THRESHOLD, "raw": summary(raw), "processed": summary(proc)}


def _size_tests(tests: list[TestResult], laws, per_test: float, power: float, pit_loglik, tolerant=()) -> None:
    """Each test's detectable effect (from its law; the PIT and log-likelihood results' own, when run; a tolerance
    test's from its ToleranceResult) and Holm p-value."""
    for t, law, n in laws:
        t.detectable = detectable_tv(law, n, per_test, power)
    for t, r in tolerant:
        t.detectable = r.detectable(per_test, power)
    for r, kind in zip(pit_loglik or (), ("pit", "loglik")):
        tests[[t.kind for t in tests].index(kind)].detectable = r.detectable(per_test, power)
    for t, a in zip(tests, holm([t.pvalue for t in tests])):
        t.holm_pvalue = float(a)


def _acceptance(stats: SpecStats | None) -> dict:
    """The report's acceptance fields: per position, the rate and tau of a speculative method (empty / nan else)."""
    acc = stats.per_position_acceptance if stats is not None and stats.drafted else []
    nan = float("nan")
    return dict(acceptance=acc, acceptance_rate=stats.acceptance_rate if acc else nan, tau=stats.tau if acc else nan)


def _reference_samples(spec: MethodSpec, reference, reference_fn, prompts, params, n, m, seed, workers, show_progress):
    """The two-sample test's reference: n continuations of m tokens per prompt by plain decoding of `reference`
    (when given, unless reference_fn says otherwise), else of spec.target."""
    ref_spec = MethodSpec(method="plain", target=spec.target, runner=spec.runner)
    if reference_fn is None and reference is not None:  # plain decoding of the model the scores come from
        reference_fn = _verispec_method(ref_spec, reference)
    ref_samples, _, _ = draw_samples(
        ref_spec,
        prompts,
        params,
        n,
        m,
        seed + REFERENCE_SEED_OFFSET,
        workers,
        sample_fn=reference_fn,
        show_progress=show_progress,
        label="plain decoding (two-sample reference)",
    )
    return ref_samples


def _check_request(params: SamplingParams, samples: int, length: int, prompts: list, level: float) -> None:
    if params.repetition_penalty != 1.0 or params.presence_penalty or params.frequency_penalty:
        raise ValueError(
            "certify generate scores tokens under temperature / top-k / top-p / min-p only; penalties "
            "make the target's law depend on the whole output and are not supported here"
        )
    if samples < 20 or length < 1:
        raise ValueError(f"need samples >= 20 and length >= 1, got {samples} and {length}")
    if not prompts:
        raise ValueError("no prompts")
    if not 0 < level < 1:
        raise ValueError(f"level must lie in (0, 1), got {level}")


def _sample_errors(got: list[list[list[int]]], length: int, V: int, eos: int | None = None) -> list[str]:
    """One line per prompt whose samples break the request (wrong length, a token outside the vocabulary); with
    `eos`, a shorter sample that ends with it (an endpoint that stopped at EOS) is well formed."""
    errors = []
    for j, group in enumerate(got):
        for s in group:
            if len(s) != length and not (eos is not None and 0 < len(s) < length and s[-1] == eos):
                errors.append(f"prompt {j}: a sample has {len(s)} tokens, expected {length}")
                break
            if any(not 0 <= t < V for t in s):
                errors.append(f"prompt {j}: a sample holds a token outside [0, {V})")
                break
    return errors


def _exact_tests(model, prompts, got, params, rng, sc: Scores, m: int, tolerance: float = 0.0, eos=()):
    """Score every sample into `sc` (the EOS set `eos` merged into one outcome); per prompt the first-token test
    (of TV <= tolerance, when one is given) and, for small vocabularies without a tolerance or an EOS set, the
    first-m-token sequence test. Returns the tests, (test, law, n) for the chi-square tests' detectable effects,
    and (test, ToleranceResult) for the tolerance tests'."""
    V = model.get_output_embeddings().weight.shape[0]
    tests: list[TestResult] = []
    laws, tolerant = [], []
    for j, group in enumerate(got):
        keys = [(j, i) for i, s in enumerate(group) if s]
        first = score(model, prompts[j], [s for s in group if s], params, rng, sc, keys=keys, eos=eos)
        first = first / first.sum()
        counts = np.bincount([s[0] for s in group if s], minlength=V)[:V]
        if tolerance:
            r = tolerant_tv_test(counts, first, tolerance)
            name, effect = f"prompt{j}/first-token-tv<={tolerance:g}", f"TV over {r.bins} bins"
            tests.append(TestResult(name, "first-token", r.tv, r.pvalue, r.n, 0.0, effect))
            tolerant.append((tests[-1], r))
        else:
            g = chisquare_gof(counts, first)
            tests.append(TestResult(f"prompt{j}/first-token", "first-token", g.statistic, g.pvalue, g.n, 0.0, "TV"))
            laws.append((tests[-1], first, g.n))
        tests[-1].deviations = top_deviations(counts, first)
        if not tolerance and len(eos) <= 1 and m >= 2 and V**m <= 4096 and all(len(s) >= m for s in group):
            law = exact_sequence_law(model, prompts[j], params, m)
            idx = np.array([sum(t * V ** (m - 1 - i) for i, t in enumerate(s[:m])) for s in group])
            g = chisquare_gof(np.bincount(idx, minlength=V**m), law / law.sum())
            tests.append(TestResult(f"prompt{j}/first-{m}-tokens", "sequence", g.statistic, g.pvalue, g.n, 0.0, "TV"))
            laws.append((tests[-1], law / law.sum(), g.n))
    return tests, laws, tolerant


def top_deviations(counts: np.ndarray, probs: np.ndarray, top: int = 5) -> list[dict]:
    """The `top` tokens whose observed frequency differs most from `probs` (the law, or the reference's
    frequencies), largest first: how a rejected test deviates."""
    freq = counts / max(1, counts.sum())
    order = np.argsort(-np.abs(freq - probs), kind="stable")[:top]
    return [{"token": int(i), "observed": float(freq[i]), "expected": float(probs[i])} for i in order]


def _two_sample_tests(got, ref_samples, m: int, V: int, tests: list[TestResult], laws: list) -> None:
    """Tokens at positions 0..m-1 against plain decoding's, per prompt (chi-square homogeneity)."""
    for j, (a, b) in enumerate(zip(got, ref_samples)):
        for t in range(m):
            ca = np.bincount([s[t] for s in a if len(s) > t], minlength=V)[:V]
            cb = np.bincount([s[t] for s in b if len(s) > t], minlength=V)[:V]
            g = chisquare_two_sample(ca, cb)
            tests.append(
                TestResult(f"prompt{j}/two-sample-pos{t}", "two-sample", g.statistic, g.pvalue, g.n, 0.0, "TV")
            )
            tests[-1].deviations = top_deviations(ca, cb / max(1, cb.sum()))
            pooled = (ca + cb) / max(1, (ca + cb).sum())
            laws.append((tests[-1], pooled, ca.sum() * cb.sum() / max(1, ca.sum() + cb.sum())))


def _samples_needed(laws, samples: int, per_test: float, power: float) -> int | None:
    """When a first-token test has no power: the continuations per prompt at which every one detects TARGET_TV."""
    first = [(t, law, n) for t, law, n in laws if t.kind == "first-token"]
    if all(t.powered for t, _, _ in first):
        return None
    return samples_needed([(law, n) for _, law, n in first], samples, per_test, power)


def write_report(report: GenerateReport, out: str | Path) -> list[Path]:
    """generate-certificate.{md,json,png} in `out`: the table, the raw figures, and three plots (PIT histogram,
    per-position acceptance, Holm-adjusted p-values against the level)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    md, js, png = out / "generate-certificate.md", out / "generate-certificate.json", out / "generate-certificate.png"
    md.write_text(report.to_markdown() + f"\n![plots]({png.name})\n")
    strict_json.write(js, report.to_json())
    fig, axes = plt.subplots(1, 4, figsize=(20, 4))
    bins = 20
    axes[0].hist(report.pit, bins=bins, range=(0, 1), color="tab:blue", alpha=0.8)
    axes[0].axhline(len(report.pit) / bins, color="k", ls="--", lw=1, label="uniform")
    axes[0].set_title("randomized PIT of emitted tokens")
    axes[0].legend()
    if report.acceptance:
        axes[1].bar(range(len(report.acceptance)), report.acceptance, color="tab:green")
        axes[1].set_ylim(0, 1)
    axes[1].set_title("per-position acceptance")
    axes[1].set_xlabel("draft position")
    names = [t.name for t in report.tests]
    vals = [-math.log10(max(t.holm_pvalue, 1e-300)) for t in report.tests]
    axes[2].barh(
        range(len(vals)), vals, color=["tab:red" if t.holm_pvalue < report.level else "tab:gray" for t in report.tests]
    )
    axes[2].axvline(-math.log10(report.level), color="k", ls="--", lw=1, label=f"level {report.level}")
    axes[2].set_yticks(range(len(vals)), names, fontsize=7)
    axes[2].set_title("-log10 Holm p-value")
    axes[2].legend()
    if report.parity:
        per = report.parity["raw"]["per_position"]
        xs = [r["position"] for r in per]
        axes[3].semilogy(xs, [max(r["max"], 1e-12) for r in per], "o-", label="max")
        axes[3].semilogy(xs, [max(r["mean"], 1e-12) for r in per], "s-", label="mean")
        axes[3].axhline(report.parity["threshold"], color="k", ls="--", lw=1)
        axes[3].legend()
    axes[3].set_title("logprob parity |returned - float32 raw|")
    axes[3].set_xlabel("position")
    fig.suptitle(f"{report.verdict}: {report.method}")
    fig.tight_layout()
    fig.savefig(png, dpi=90)
    plt.close(fig)
    return [md, js, png]


def encode_prompt(tokenizer, text: str, chat: bool) -> list[int]:
    """Token ids of a prompt as verispec's generator builds them (chat: the tokenizer's chat template)."""
    if not text:
        raise ValueError("a prompt is empty")
    if not chat:
        return list(tokenizer(text, add_special_tokens=True)["input_ids"])
    if getattr(tokenizer, "chat_template", None) is None:
        raise ValueError("--chat given but the tokenizer has no chat template")
    enc = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True)
    if hasattr(enc, "keys"):
        enc = enc["input_ids"]
    return [int(t) for t in enc]
