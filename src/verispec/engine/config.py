"""One speculation configuration for every entry point (`SpeculativeGenerator`, `RolloutEngine`, the CLI's `--spec`,
`verispec bench e2e`, the certifier's `MethodSpec`, a cluster's `EngineSpec`): `SpecConfig`, validated once, with
one string form (`SpecConfig.parse(str(cfg)) == cfg`; keys printed in the order of `KEYS`; docs/guides/generating.md).
ngram, stop_below, draft_context and max_gamma are read only by the drafters they concern (kept and printed elsewhere,
no error).
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Callable
from contextlib import suppress
from dataclasses import dataclass, fields

from ..drafting.tree import TreeSpec
from ..model.fast import RUNNER_KINDS
from ..model.linear import QUANT_MODES
from ..sampling.tree import TREE_RULES
from .adaptive import MAX_GAMMA

__all__ = ["DRAFTERS", "KEYS", "SpecConfig", "SpecError", "canonical", "format_value", "parse_items", "spec_name"]

CHAIN_VERIFY = ("token", "block")  # sampling.CHAIN_RULES' names
TREE_VERIFY = ("deterministic", *(r for r in TREE_RULES if r != "deterministic"))  # default first
VERIFIES = (*CHAIN_VERIFY, *TREE_VERIFY, "mixed")
RANDOMS = ("auto", "stream", "position", "gumbel")  # the default first
CROSS_VOCABS = ("auto", "tli", "slem")  # the default first
HISTORY_TREE = "dynamic-8-3-16"  # HistoryProposer's default trie
MAX_BUDGET = 0.9  # online_budget's largest: training takes at most 9 times the decoding time
MAX_JUMP = 64  # jump-forward tokens per step (structured.grammar.JUMP_CAP: what a grammar state forces at most)


@dataclass(frozen=True)
class Drafter:
    """What one kind of drafter needs and drafts. Validation reads only this table: a new drafter (EAGLE heads, a
    cross-vocabulary draft model) is one row here and one branch where proposers are built."""

    chain_rules: tuple[str, ...]  # verification rules without a `tree` key (the first: the default)
    tree_rules: tuple[str, ...] = ()  # rules with a tree (the first: the default); (): no trees
    model: bool = False  # drafts with a separate draft model: a `model=` path or a LoadedModel given separately
    target_weights: bool = False  # drafts with the target's own weights, quantized (needs `quant`)
    history: bool = False  # drafts from earlier rollouts (always trees): a RolloutEngine builds it
    given: bool = False  # a Proposer given separately drafts; the config only says so
    target_head: bool = False  # drafts with a head stored in the target's checkpoint (its MTP layer)
    position: bool = False  # random=position applies (q at every position; chains, not where a step starts)
    online: bool = False  # learns an EAGLE-3 head from what the engine verifies (`model=`: a saved head to start from)

    @property
    def uses_model(self) -> bool:
        return self.model or self.target_weights

    @property
    def built_by_generator(self) -> bool:
        """Whether `SpeculativeGenerator` builds this drafter from the config (and what it is given) alone."""
        return not (self.history or self.given)


DRAFTERS = {
    "ngram": Drafter(CHAIN_VERIFY, ("deterministic",)),
    "none": Drafter(CHAIN_VERIFY, position=True),
    "model": Drafter(CHAIN_VERIFY, TREE_VERIFY, model=True, position=True),
    "self": Drafter(CHAIN_VERIFY, TREE_VERIFY, target_weights=True, position=True),
    "history": Drafter(("deterministic",), ("deterministic",), history=True),
    "model+history": Drafter(("mixed",), ("mixed",), model=True, history=True),
    "self+history": Drafter(("mixed",), ("mixed",), target_weights=True, history=True),
    "custom": Drafter(CHAIN_VERIFY, given=True, position=True),  # the generator checks the Proposer itself
    "mtp": Drafter(CHAIN_VERIFY, TREE_VERIFY, target_head=True, position=True),
    # per row and step, prompt lookup or the draft model (the controller picks by measured gain; chains only)
    "ngram+model": Drafter(CHAIN_VERIFY, model=True),
    "ngram+self": Drafter(CHAIN_VERIFY, target_weights=True),
    # per row and step, prompt lookup or an EAGLE-3 head trained online from the verified tokens (heads.online)
    "online": Drafter(CHAIN_VERIFY, online=True),
}

ALWAYS_PRINTED = ("draft", "gamma", "verify", "random")


def spec_name(key: str, value: str | None) -> str:
    """How a message names a key (or a key's value) in the string form: `quant`, `draft=self`."""
    return key if value is None else f"{key}={value}"


class SpecError(ValueError):
    """An invalid speculation configuration (a ValueError).

    `render(name)` spells the message for a front end: `str(e)` names keys in the string form (`draft=self needs
    quant`), the CLI names those its shorthand flags set as the flags (`--draft self needs --spec quant`).

    Attributes:
        key: The key to blame (None: the configuration as a whole).
        template: The message, naming keys as `[key]` or `[key=value]`.
    """

    def __init__(self, key: str | None, template: str):
        self.key, self.template = key, template
        super().__init__(self.render(spec_name))

    def render(self, name: Callable[[str, str | None], str]) -> str:
        return _MENTION.sub(lambda m: name(m[1], m[2]), self.template)

    def __reduce__(self):
        return SpecError, (self.key, self.template)


@dataclass(frozen=True, repr=False)
class SpecConfig:
    """How to speculate: drafter, draft length, tree, verification rule, randomness and runner.

    Validated at construction; `parse` reads the string form and `str(config)` prints it (canonical: draft,
    gamma, verify and random always, other keys where they differ from their defaults).

    ```python
    cfg = SpecConfig(draft="model", gamma=4, verify="block")
    str(cfg)                                   # 'draft=model,gamma=4,verify=block,random=auto'
    assert SpecConfig.parse(str(cfg)) == cfg
    ```

    Attributes:
        draft: The drafter: "ngram" (prompt lookup, default), "none" (plain decoding), "model" (a draft model,
            or a hidden-state head's directory), "self" (the target's own weights, quantized), "history",
            "model+history", "self+history" (earlier rollouts, built by a `RolloutEngine`), "custom" (a
            `Proposer` given separately), "mtp" (the multi-token-prediction layer of the target's checkpoint), or
            "ngram+model" / "ngram+self" (per row and step, prompt lookup where it pays, the draft model otherwise:
            gamma "auto" chooses by measured gain; a fixed gamma: prompt lookup wherever it matches), or "online"
            (prompt lookup and an EAGLE-3 head the engine trains from the tokens it verifies, per row and step by
            measured gain; `model=DIR` starts from a saved head: docs/guides/online-heads.md).
        model: The draft model's path or hub id; None when it is given separately (or there is none).
        quant: "int8" or "int4": weight-only quantized draft weights (draft=self needs one); None: full precision.
        ngram: Prompt-lookup n-gram sizes, longest first.
        stop_below: A draft model stops a chain once its own probability of a drafted token falls below this
            (None: always draft gamma tokens).
        draft_context: A draft model (draft=model, draft=self, their cross-vocabulary, history and ngram+ forms)
            reads only this many tokens of a request when it joins, its first min(64, W // 4) and its last, so
            its prefill of a long prompt costs at most this many tokens; generated tokens then append (the window
            is not slid). None: the whole prompt. Exact at any value (q is what the draft sampled from, whatever
            it read); hidden-state heads always read the whole context. 512 by default: prompts up to 512 tokens
            are read whole; on a 1,560-token prompt (Qwen2.5-Coder 1.5B / 0.5B int4, CPU) it cut the draft's
            prefill from 8 s to 2.4 s for an acceptance of 0.42 / 0.30 (T = 0 / 1) instead of 0.58 / 0.59,
            0.97x / 0.89x plain's tokens/s over 32 new tokens with the prefill (the whole prompt: 0.85x / 0.80x).
        min_share: History tries keep nodes at least this share of matched continuations pass through.
        choose_depth: model+history drafts the trie alone where it is at least this deep, else the chain
            (None: both in one tree).
        gamma: Drafts per step (0..64), or "auto" (picked every step from measured acceptance and costs).
        max_gamma: The most drafts per step gamma "auto" picks.
        tree: None (chains), widths per depth ("4-2-2-1") or "dynamic-D-K-M" (EAGLE-2's dynamic tree); with
            history, the trie's shape (dynamic only; None: dynamic-8-3-16).
        jump: Structured outputs: the most grammar-forced tokens appended to a chain per step (0: off).
        verify: The verification rule: "token" or "block" for chains; "deterministic", "iid" or
            "without_replacement" for a tree; "mixed" for model+history. None resolves to the first the
            drafter allows.
        random: "auto" (default: a seeded request Gumbel-coupled, an unseeded one on its own stream), "stream"
            (every request on its own stream), "position" (uniforms keyed by seed and output position) or
            "gumbel" (every request Gumbel-coupled: plain decoding's tokens whatever drafted).
        runner: The model forward: "auto", "fast", "hf" or "llamacpp".
        cross_vocab: A draft model with another tokenizer: "auto" (= "tli" where needed), "tli" (token-level
            intersection) or "slem" (string-level exact match).
        online_budget: draft=online: the share of time training the head may take, in (0, 0.9] (training seconds
            <= budget x (decoding + training) seconds; a `RolloutEngine` trains between batches within it).
        online_buffer: draft=online: the replay buffer's size in tokens (the oldest sequences dropped first); per
            token it keeps 3 x hidden size bfloat16 features and 32 target probabilities (SmolLM2-135M: ~3.6 KB).

    Raises:
        SpecError: A value is out of range, or the combination cannot run (`draft=ngram,random=position`,
            `tree=2-1,verify=block`, `draft=self` without `quant`); it names the key at fault.
    """

    draft: str = "ngram"  # the drafter (DRAFTERS)
    model: str | None = None  # the draft model's path or hub id; None: given separately (or no draft model)
    quant: str | None = None  # "int8" / "int4": quantized draft weights (draft=self needs one)
    ngram: tuple[int, ...] = (3, 2, 1)  # prompt-lookup n-gram sizes, longest first
    stop_below: float | None = 0.3  # a draft model's chain stops below this own probability (None: never)
    draft_context: int | None = 512  # a draft model reads this many of a prompt's tokens (None: all)
    min_share: float = 0.0  # history tries: the least share of matched continuations through a node
    choose_depth: int | None = None  # model+history: the trie alone where it is this deep (None: both)
    gamma: int | str = "auto"  # drafts per step, or "auto"
    max_gamma: int = 8  # the most drafts gamma "auto" picks
    tree: str | None = None  # None (chains) or a tree shape: "4-2-2-1", "dynamic-D-K-M"
    jump: int = 16  # structured outputs: grammar-forced tokens appended to a chain per step (0: off)
    verify: str | None = None  # the verification rule; None: the first the drafter allows (stored resolved)
    random: str = "auto"  # "auto", "stream", "position" or "gumbel"
    runner: str = "auto"  # "auto", "fast", "hf" or "llamacpp"
    cross_vocab: str = "auto"  # a draft model with another tokenizer: "tli" (auto) or "slem"
    online_budget: float = 0.2  # draft=online: the share of time training the head may take
    online_buffer: int = 32768  # draft=online: the replay buffer's size in tokens

    def __post_init__(self):
        self._check_values()
        self._check_drafter()
        self._resolve_verify()
        self._check_random()

    @classmethod
    def parse(cls, text: str) -> SpecConfig:
        """The configuration of a string form.

        Args:
            text: Comma-separated `key=value` items in any order, each key at most once, e.g.
                `"draft=model,model=org/draft,gamma=4,verify=block"`; the empty string is the default.

        Returns:
            The validated configuration.

        Raises:
            SpecError: An unknown key, a bad value or an invalid combination; it names the key at fault.
        """
        return cls(**parse_items(text))

    def spec(self) -> str:
        """The canonical string form (also `str(cfg)`).

        Returns:
            The string that `SpecConfig.parse` reads back to this configuration: `SpecConfig.parse(cfg.spec())
            == cfg`.
        """
        return ",".join(
            f"{key}={format_value(getattr(self, key))}"
            for key in KEYS
            if key in ALWAYS_PRINTED or getattr(self, key) != getattr(_DEFAULTS, key)
        )

    __str__ = spec

    def __repr__(self) -> str:
        return f"SpecConfig.parse({self.spec()!r})"

    @property
    def drafter(self) -> Drafter:
        return DRAFTERS[self.draft]

    @property
    def chain_rule(self) -> str:
        """How chains are verified (`sampling.CHAIN_RULES`): token or block; "token" where trees are drafted."""
        return self.verify if self.verify in CHAIN_VERIFY else "token"

    @property
    def tree_spec(self) -> TreeSpec | None:
        """The TreeSpec of `tree` with its rule (history: the trie's, default dynamic-8-3-16), or None for chains."""
        if self.drafter.history:
            return TreeSpec.parse(self.tree or HISTORY_TREE, "deterministic")
        if self.tree is None:
            return None
        return TreeSpec.parse(self.tree, self.verify if self.verify in TREE_VERIFY else "deterministic")

    def _set(self, name: str, value) -> None:
        object.__setattr__(self, name, value)

    def _check_values(self) -> None:
        """Each key's value alone (and its canonical form)."""
        choices = {"draft": tuple(DRAFTERS), "cross_vocab": CROSS_VOCABS, "verify": (None, *VERIFIES)}
        for key, allowed in (choices | {"random": RANDOMS, "runner": RUNNER_KINDS}).items():
            if getattr(self, key) not in allowed:
                shown = [a for a in allowed if a is not None]
                hint = _did_you_mean(getattr(self, key), shown)
                raise SpecError(key, f"[{key}] must be one of {', '.join(shown)}, got {getattr(self, key)!r}{hint}")
        model = self.model
        if model is not None and not (isinstance(model, str) and model.strip() == model != "" and "," not in model):
            raise SpecError("model", f"[model] must be a path or hub id without commas, got {model!r}")
        if self.quant is not None and self.quant not in QUANT_MODES:
            raise SpecError("quant", f"[quant] must be {', '.join(QUANT_MODES)} or none, got {self.quant!r}")
        self._set("ngram", _ngram_sizes(self.ngram))
        self._set("stop_below", _fraction("stop_below", self.stop_below, none=True))
        self._set("min_share", _fraction("min_share", self.min_share, none=False))
        if self.draft_context is not None and not _integer(self.draft_context, 1):
            raise SpecError(
                "draft_context", f"[draft_context] must be an integer >= 1 or none, got {self.draft_context!r}"
            )
        if self.choose_depth is not None and not _integer(self.choose_depth, 1):
            raise SpecError(
                "choose_depth", f"[choose_depth] must be an integer >= 1 or none, got {self.choose_depth!r}"
            )
        if self.gamma != "auto" and not _integer(self.gamma, 0, MAX_GAMMA):
            raise SpecError("gamma", f"[gamma] must be auto or an integer from 0 to {MAX_GAMMA}, got {self.gamma!r}")
        for key, low, high in (("max_gamma", 1, MAX_GAMMA), ("jump", 0, MAX_JUMP)):
            if not _integer(getattr(self, key), low, high):
                raise SpecError(key, f"[{key}] must be an integer from {low} to {high}, got {getattr(self, key)!r}")
        if self.tree is not None:
            self._set("tree", _tree_shape(self.tree, self.verify if self.verify in TREE_VERIFY else None))
        b = self.online_budget
        if isinstance(b, bool) or not isinstance(b, (int, float)) or not 0 < b <= MAX_BUDGET:
            raise SpecError("online_budget", f"[online_budget] must be a number in (0, {MAX_BUDGET}], got {b!r}")
        self._set("online_budget", float(b))
        if not _integer(self.online_buffer, 1024):
            raise SpecError("online_buffer", f"[online_buffer] must be an integer >= 1024, got {self.online_buffer!r}")

    def _check_drafter(self) -> None:
        """What the drafter needs and takes: a model, a quantization, trees, history's keys."""
        d, name = self.drafter, self.draft
        if self.model is not None and not (d.model or d.online):
            raise SpecError(
                "model",
                f"[model] names a draft model: it needs [draft=model] or [draft=model+history], not [draft={name}]",
            )
        for key in ("online_budget", "online_buffer"):
            if getattr(self, key) != SpecConfig.__dataclass_fields__[key].default and not d.online:
                raise SpecError(key, f"[{key}] applies to [draft=online], not to [draft={name}]")
        if self.cross_vocab != "auto" and name != "model":
            raise SpecError(
                "cross_vocab", f"[cross_vocab] applies to a draft model ([draft=model]), not to [draft={name}]"
            )
        if self.cross_vocab == "slem" and self.tree is not None:
            raise SpecError("tree", "[cross_vocab=slem] drafts chains (re-tokenized text): a [tree] does not apply")
        if self.quant is not None and not d.uses_model:
            raise SpecError("quant", f"[quant] applies to a draft model or [draft=self], not to [draft={name}]")
        if d.target_weights and self.quant is None:
            raise SpecError(
                "draft",
                f"[draft={name}] needs [quant] ({' or '.join(QUANT_MODES)}): an unquantized copy of the target "
                "costs as much as the target",
            )
        if self.tree is not None and not d.tree_rules:
            if d.given:
                raise SpecError(
                    "tree", "pass the tree to the Proposer itself (its `tree`), not in the config ([draft=custom])"
                )
            raise SpecError("tree", "a [tree] needs a drafter ([draft=model], [draft=self] or [draft=ngram])")
        if d.history and self.tree is not None and not TreeSpec.parse(self.tree).dynamic:
            raise SpecError(
                "tree",
                f"[tree={self.tree}]: history tries are dynamic trees (dynamic-D-K-M: depth, children per node, node budget)",
            )
        if self.min_share != 0.0 and not d.history:
            raise SpecError("min_share", f"[min_share] applies to history drafting, not to [draft={name}]")
        if self.choose_depth is not None and not (d.history and d.uses_model):
            raise SpecError(
                "choose_depth",
                f"[choose_depth] applies to a draft model with history ([draft=model+history], [draft=self+history]), not to [draft={name}]",
            )
        if d.history and d.uses_model and (self.gamma == "auto" or self.gamma < 1):
            raise SpecError(
                "gamma",
                f"a draft model with history drafts a chain of fixed length: [gamma] must be an integer >= 1, got {self.gamma!r}",
            )

    def _resolve_verify(self) -> None:
        """The verification rule: the first the drafter allows when not given, else one it allows."""
        d, tree = self.drafter, self.tree is not None
        rules = d.tree_rules if tree else d.chain_rules
        if self.verify is None:
            self._set("verify", rules[0])
            return
        if self.verify in rules:
            return
        v = self.verify
        if v in CHAIN_VERIFY and (tree or d.history):
            where = "a [tree]" if tree and not d.history else f"[draft={self.draft}] drafts trees: it"
            raise SpecError(
                "verify",
                f"[verify={v}] verifies chains; {where} is verified by [verify={rules[0]}]"
                + (f" (or {', '.join(rules[1:])})" if rules[1:] else ""),
            )
        if v in TREE_VERIFY and not tree and not d.history:
            raise SpecError("verify", f"[verify={v}] is a tree rule: it needs [tree] (a tree shape such as 4-2-2-1)")
        if self.draft == "ngram":
            raise SpecError(
                "verify",
                f"prompt-lookup trees are deterministic (one-hot q): [verify={v}] does not apply, use [verify=deterministic]",
            )
        raise SpecError(
            "verify",
            f"[verify={v}] does not apply to [draft={self.draft}]"
            + (" with a tree" if tree else "")
            + f": use {' or '.join(rules)}",
        )

    def _check_random(self) -> None:
        if self.random != "position":
            return
        if not self.drafter.position or self.tree is not None or self.cross_vocab == "slem":
            raise SpecError(
                "random",
                "[random=position] needs a draft model drafting chains ([draft=model] or [draft=self], no [tree]) or "
                f"[draft=none], not [draft={self.draft}]"
                + (" with [cross_vocab=slem]" if self.cross_vocab == "slem" else "")
                + (" with a tree" if self.tree else "")
                + ": prompt lookup's and history's proposals depend on where a step starts, trees on their shape",
            )
        if self.verify != "token":
            raise SpecError(
                "random",
                "[random=position] verifies token-wise ([verify=token]): block verification's decisions read later positions",
            )


def _integer(value, low: int, high: int | None = None) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= low and (high is None or value <= high)


def _fraction(key: str, value, none: bool) -> float | None:
    if value is None and none:
        return None
    if isinstance(value, (int, float)) and not isinstance(value, bool) and 0.0 <= value <= 1.0:
        return float(value)
    raise SpecError(key, f"[{key}] must be a number in [0, 1]{' or none' if none else ''}, got {value!r}")


def _ngram_sizes(value) -> tuple[int, ...]:
    ok = isinstance(value, (tuple, list)) and value and all(_integer(n, 1) for n in value)
    if not ok:
        raise SpecError("ngram", f"[ngram] must be integers >= 1, longest first (e.g. 3-2-1), got {value!r}")
    return tuple(sorted(set(value), reverse=True))


def _tree_shape(value, rule: str | None) -> str:
    """A tree's canonical shape string ('4-2-2-1', 'dynamic-6-4-16'), checked by TreeSpec with its rule."""
    if not isinstance(value, str):
        raise SpecError("tree", f"[tree] must be a shape such as 4-2-2-1 or dynamic-D-K-M, or none, got {value!r}")
    try:
        spec = TreeSpec.parse(value, rule)
    except ValueError as e:
        raise SpecError("tree", f"[tree={value}]: {e}") from None
    return f"dynamic-{spec.depth}-{spec.topk}-{spec.budget}" if spec.dynamic else "-".join(map(str, spec.widths))


def format_value(value) -> str:
    """A value as the string form writes it."""
    if value is None:
        return "none"
    if isinstance(value, tuple):
        return "-".join(map(str, value))
    return str(value)  # floats: repr, which float() reads back exactly


def _read(key: str, text: str):
    """A value of the string form as the Python value SpecConfig takes (checked there)."""
    if text == "none" and key in ("model", "quant", "stop_below", "draft_context", "choose_depth", "tree"):
        return None
    if key in ("gamma", "max_gamma", "draft_context", "choose_depth", "jump", "online_buffer") and re.fullmatch(
        r"[+-]?\d+", text
    ):
        return int(text)
    if key in ("stop_below", "min_share", "online_budget"):
        try:
            return float(text)
        except ValueError:
            return text
    if key == "ngram" and re.fullmatch(r"\d+(-\d+)*", text):
        return tuple(int(n) for n in text.split("-"))
    return text


def parse_items(text: str) -> dict:
    """The keys a string form names, with their values (not yet checked together: `SpecConfig(**items)` does)."""
    if not isinstance(text, str):
        raise SpecError(None, f"a speculation spec is a string such as 'draft=model,gamma=4', got {text!r}")
    items: dict = {}
    for part in text.split(","):
        part = part.strip()
        if not part and text.strip() == "":
            continue
        key, eq, value = part.partition("=")
        key, value = key.strip(), value.strip()
        if not eq or not key:
            raise SpecError(
                None, f"each item of a spec is key=value (keys: {', '.join(KEYS)}), got {part!r} in {text!r}"
            )
        if key not in KEYS:
            raise SpecError(
                None, f"unknown key {key!r} in spec {text!r}; the keys are {', '.join(KEYS)}{_did_you_mean(key, KEYS)}"
            )
        if key in items:
            raise SpecError(key, f"[{key}] is given twice in spec {text!r}")
        items[key] = _read(key, value)
    return items


def _did_you_mean(typed, known) -> str:
    """ "; did you mean 'gamma'?" for a misspelt key or value ('' when nothing known is close)."""
    close = difflib.get_close_matches(typed, list(known), n=1) if isinstance(typed, str) else []
    return f"; did you mean {close[0]!r}?" if close else ""


def canonical(key: str, value):
    """A key's value as a SpecConfig holds it (n-gram sizes sorted, numbers as floats, a tree's shape normalised):
    what two spellings of one key are compared on. A value SpecConfig would refuse is returned as it is."""
    with suppress(SpecError):
        if key == "ngram":
            return _ngram_sizes(value)
        if key in ("stop_below", "min_share"):
            return _fraction(key, value, none=key == "stop_below")
        if key == "tree" and value is not None:
            return _tree_shape(value, None)
    return value


KEYS = tuple(f.name for f in fields(SpecConfig))  # the string form's keys, in printing order
_MENTION = re.compile(r"\[(" + "|".join(KEYS) + r")(?:=([^\]]*))?\]")  # a template's [key] / [key=value]
_DEFAULTS = SpecConfig()  # what `spec()` leaves out
