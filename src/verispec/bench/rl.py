"""`verispec bench rl`: a real RL loop, GRPO with a verifiable reward, every drafting method (METHODS) side by side on
the same policy; what it measures: docs/benchmarks.md, "What each benchmark measures".

The task: two-digit additions in a few-shot completion prompt (`problem`), reward 1 where the completion's first
number is the sum (`reward`); the default model (SmolLM2-135M-Instruct) solves about a third of them at T = 1, so the
rewards of a group vary. A pool of `pool` problems comes back every `pool / prompts_per_step` steps (an epoch), as a
dataset does in RL.

Each step: every method's `RolloutEngine` samples G = `group` completions of the step's prompts (T = 1, the same
request seed for all); the policy (a torch copy of the target with grad) takes one Adam step on the first method's
rollouts with group-normalized advantages, A = (r - mean) / (std + eps), and loss -mean_i A_i * mean_t log pi(token)
over each completion's tokens (EOS included); then every engine gets the new weights (`update_weights`). The policy's
trajectory is therefore the same whatever methods run beside the first. All engines share the target's weights.

Methods: plain (no drafting), history (`RL_DEFAULTS`: drafts from earlier rollouts of the prompt), frozen (an EAGLE-3
head trained before the loop by `train-draft`'s code on the rollouts the first `frozen_steps` steps would draw under
the initial policy: P x G x frozen_steps samples, the budget the online head has seen by then) and online (an EAGLE-3
head trained by the engine from what it verifies, `draft=online`).
"""

from __future__ import annotations

import copy
import random
import re
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor

from ..engine.config import SpecConfig
from ..model.loading import LoadedModel
from ..rollout import RolloutEngine
from ..rollout.engine import RL_DEFAULTS
from ..sampling import SamplingParams
from .harness import Col, ModelBenchConfig, report_head, side_by_side, started, table, timed

__all__ = ["METHODS", "PolicyTrainer", "RLBenchConfig", "advantages", "method_config", "plot", "problem"]
__all__ += ["reward", "run_rl_bench", "step_prompts", "to_markdown"]

METHODS = {  # name -> its SpecConfig (the runner is the benchmark's); every rollout on its own stream
    "plain": "draft=none,random=stream",
    "history": RL_DEFAULTS.spec(),  # the RL default: history tries at gamma 4
    "frozen": "draft=model,random=stream",  # the head trained before the loop, gamma auto (never slower than plain)
    "online": "draft=online,random=stream",  # prompt lookup and the online head, gamma auto
    # the heads at a fixed gamma 3 (drafting every step whether it pays or not): what each head's drafts are worth
    "frozen@3": "draft=model,gamma=3,stop_below=none,random=stream",
    "online@3": "draft=online,gamma=3,stop_below=none,random=stream",
}
FEW_SHOT = "12 + 13 = 25\n24 + 14 = 38\n"  # the task's prompt starts so (a completion prompt: no chat template)
WARM_UP = f"{FEW_SHOT}67 + 78 ="  # the engines' warm-up prompt: the task's shape, never in the pool (operands > 50)
EPS = 1e-4  # advantages: (r - mean) / (std + EPS), as TRL's GRPO
WINDOW = 10  # steps per window of the summary table (tau over steps 0-9, 10-19, ...)


@dataclass(frozen=True)
class RLBenchConfig(ModelBenchConfig):
    """`verispec bench rl`'s settings (its options of the same names)."""

    steps: int = 30  # policy steps
    group: int = 8  # G samples per prompt
    prompts_per_step: int = 1  # P
    pool: int = 10  # distinct problems, cycled (an epoch every pool / P steps)
    max_new_tokens: int = 32
    lr: float = 2e-5  # the policy's Adam learning rate
    max_grad_norm: float = 1.0
    frozen_steps: int = 20  # the frozen head's data: the rollouts of this many steps under the initial policy
    head_steps: int = 40  # the frozen head's optimizer steps (train-draft's settings otherwise)
    methods: tuple[str, ...] = ("plain", "history", "frozen", "online")
    chat: bool = False  # the task's prompts are few-shot completions

    def __post_init__(self):
        for name in ("steps", "group", "prompts_per_step", "pool", "max_new_tokens", "frozen_steps", "head_steps"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {v!r}")
        if self.group < 2:
            raise ValueError(f"group must be >= 2 (advantages compare a group's samples), got {self.group}")
        if not (self.lr > 0 and self.max_grad_norm > 0):
            raise ValueError(f"lr and max_grad_norm must be > 0, got {self.lr} and {self.max_grad_norm}")
        unknown = [m for m in self.methods if m not in METHODS]
        if unknown or not self.methods or len(set(self.methods)) < len(self.methods):
            raise ValueError(f"methods must be distinct, from {', '.join(METHODS)}; got {', '.join(self.methods)}")


def method_config(method: str, runner: str = "auto") -> SpecConfig:
    """A method's SpecConfig (SpecError where its drafter does not exist in this build)."""
    return SpecConfig.parse(f"{METHODS[method]},runner={runner}")


# --- the task ----------------------------------------------------------------------------------------------------


def problem(rng: random.Random) -> tuple[str, int]:
    """One problem: (prompt, answer), a + b with a, b uniform in [10, 50]."""
    a, b = rng.randint(10, 50), rng.randint(10, 50)
    return f"{FEW_SHOT}{a} + {b} =", a + b


_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


def reward(text: str, answer: int) -> float:
    """1.0 where the completion's first number (an optional minus, digits, an optional decimal part) equals the
    answer, else 0.0 (no number: 0.0)."""
    m = _NUMBER.search(text)
    return float(m is not None and float(m.group()) == answer)


def step_prompts(pool: list[tuple[str, int]], step: int, per_step: int) -> list[tuple[str, int]]:
    """The problems of a step: the pool's next `per_step`, cycling."""
    return [pool[(step * per_step + k) % len(pool)] for k in range(per_step)]


# --- the policy --------------------------------------------------------------------------------------------------


def advantages(rewards: Tensor, eps: float = EPS) -> Tensor:
    """GRPO's group-normalized advantages (r - mean) / (std + eps), std unbiased as TRL's; rewards [P, G] -> [P, G]
    (a group of equal rewards: all 0)."""
    mean, std = rewards.mean(dim=-1, keepdim=True), rewards.std(dim=-1, keepdim=True)
    return (rewards - mean) / (std + eps)


def _batch(rollouts, device) -> tuple[Tensor, Tensor, Tensor]:
    """Rollouts as one batch, right-padded with id 0 (masked; causal attention keeps it out of every real position):
    ids [B, L], attention mask [B, L] and the labels [B, L] of the completion tokens (EOS included where it ended
    the sample; -100 elsewhere) at the position that predicts them."""
    seqs = [(list(r.prompt_token_ids), r.with_eos()[0]) for r in rollouts]
    width = max(len(p) + len(c) for p, c in seqs)
    ids = torch.zeros((len(seqs), width), dtype=torch.long)
    mask = torch.zeros((len(seqs), width), dtype=torch.long)
    labels = torch.full((len(seqs), width), -100, dtype=torch.long)
    for i, (p, c) in enumerate(seqs):
        n = len(p) + len(c)
        ids[i, :n] = torch.tensor(p + c)
        mask[i, :n] = 1
        labels[i, len(p) - 1 : n - 1] = torch.tensor(c, dtype=torch.long)  # position t predicts token t + 1
    return ids.to(device), mask.to(device), labels.to(device)


class PolicyTrainer:
    """The policy being trained: a torch copy of the target's model (with grad) and its Adam optimizer.

    Args:
        target: The target, whose weights the rollout engines hold (a torch model).
        lr: Adam's learning rate.
        max_grad_norm: The gradients' norm is clipped to this.
    """

    def __init__(self, target: LoadedModel, lr: float, max_grad_norm: float):
        self.model = copy.deepcopy(target.model).requires_grad_(True)
        self.opt = torch.optim.Adam(self.model.parameters(), lr=lr, fused=True)  # (CPU and CUDA: 3-6x the loop's speed)
        self.max_grad_norm = max_grad_norm
        self.device = next(self.model.parameters()).device

    def logprobs(self, rollouts) -> tuple[Tensor, Tensor]:
        """The policy's log pi of every completion token [N] (EOS included where it ended the sample; rollout by
        rollout) and their mean per rollout [B]; with grad where grad is enabled."""
        ids, mask, labels = _batch(rollouts, self.device)
        picked = labels != -100  # [B, L]
        rows = picked.nonzero()[:, 0]  # [N] the rollout of each completion token
        hidden = self.model.get_decoder()(input_ids=ids, attention_mask=mask, use_cache=False).last_hidden_state
        logits = self.model.get_output_embeddings()(hidden[picked])  # [N, V]: the completions' positions only
        logp = -F.cross_entropy(logits.float(), labels[picked], reduction="none")  # [N]
        count = torch.bincount(rows, minlength=len(rollouts)).clamp(min=1)  # [B]
        return logp, logp.new_zeros(len(rollouts)).index_add(0, rows, logp) / count

    def step(self, rollouts, adv: Tensor) -> dict:
        """One optimizer step on rollouts (in group order) with their advantages [P, G]: loss, gradient norm, and
        logprob_gap (mean |rollout logprob - the policy's|, over the completion tokens before the step: ~0 while
        the engines hold the policy's weights)."""
        with torch.enable_grad():
            logp, per_seq = self.logprobs(rollouts)  # [N], [B]
            loss = -(adv.reshape(-1).to(per_seq) * per_seq).mean()
            self.opt.zero_grad()
            loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.max_grad_norm)
        self.opt.step()
        theirs = torch.tensor([x for r in rollouts for x in r.with_eos()[1]], dtype=logp.dtype)
        gap = (logp.detach().cpu() - theirs).abs().mean().item() if len(theirs) == len(logp) else None
        return dict(loss=loss.item(), grad_norm=norm.item(), logprob_gap=gap)

    def weights(self) -> list[tuple[str, Tensor]]:
        """The policy's weights, named as in the target's state_dict (detached, for `update_weights`)."""
        return [(n, p.detach()) for n, p in self.model.named_parameters()]


# --- the engines and the frozen head -----------------------------------------------------------------------------


def train_frozen(target: LoadedModel, pool: list[tuple[str, int]], cfg: RLBenchConfig, log=print):
    """The frozen method's head: `train-draft`'s sampling and training (train_eagle3, `head_steps` steps) on the
    initial policy's rollouts of the first `frozen_steps` steps' prompts (G samples each); (the head, what it cost)."""
    from ..engine.drafters import load_draft
    from ..training.heads import TrainConfig, sample_data, train_eagle3

    prompts = [p for s in range(cfg.frozen_steps) for p, _ in step_prompts(pool, s, cfg.prompts_per_step)]
    tc = TrainConfig(samples_per_prompt=cfg.group, max_new_tokens=cfg.max_new_tokens, seed=cfg.seed + 10**6)
    tc.chat, tc.max_steps, tc.checkpoint_every, tc.cache_features = cfg.chat, cfg.head_steps, cfg.head_steps, True
    log(f"frozen head: sampling {len(prompts) * cfg.group} rollouts of {cfg.max_new_tokens} tokens at most ...")
    sample_s, data = timed(sample_data, target, prompts, tc)
    with tempfile.TemporaryDirectory() as tmp:
        train_s, summary = timed(train_eagle3, target, data, Path(tmp), tc)
        dtype = next(target.model.parameters()).dtype
        head = load_draft(tmp, dtype=dtype, device=str(target.device))
    top1 = [round(x, 3) for x in summary["final_top1_by_step"]]
    log(f"frozen head: {summary['tokens']} tokens, {summary['steps']} steps in {train_s:.1f}s, top-1 {top1}")
    info = dict(samples=len(data["seqs"]), tokens=summary["tokens"], sample_seconds=sample_s, train_seconds=train_s)
    return head, info | dict(steps=summary["steps"], final_loss=summary["final_loss"], final_top1_by_step=top1)


def make_engines(target: LoadedModel, head, cfg: RLBenchConfig) -> dict[str, RolloutEngine]:
    """One RolloutEngine per method, all over the target's one copy of the weights (an update through any of them
    writes them for all; each engine counts its own weight version)."""
    rows = cfg.group * cfg.prompts_per_step
    engines = {}
    for m in cfg.methods:
        config = method_config(m, cfg.runner)
        draft = head if config.drafter.model else None
        engines[m] = RolloutEngine(target, draft, config=config, max_batch_size=rows)
    return engines


def warm_up(engines: dict[str, RolloutEngine], cfg: RLBenchConfig) -> None:
    """One untimed group per engine on a problem outside the pool (WARM_UP), so that no method's first step pays for
    first calls (kernels picked, buffers allocated) that the others then reuse."""
    params = SamplingParams(temperature=1.0)
    for eng in engines.values():
        eng.generate([WARM_UP], n=cfg.group, params=params, max_new_tokens=cfg.max_new_tokens, seed=0, chat=cfg.chat)


def learner_of(engine: RolloutEngine):
    """The online head's learner of an engine (draft=online), else None."""
    return getattr(engine, "learner", None)


def _trained(engine: RolloutEngine) -> float:
    """Seconds the engine's online head has trained so far (0 without one)."""
    learner = learner_of(engine)
    return 0.0 if learner is None else float(learner.stats()["train_seconds"])


# --- the loop ----------------------------------------------------------------------------------------------------


def _rollouts(engine: RolloutEngine, prompts: list[tuple[str, int]], cfg: RLBenchConfig, seed: int):
    """One method's rollouts of a step, and their record (rollout seconds exclude the head's training inside)."""
    before = _trained(engine)
    params = SamplingParams(temperature=1.0)
    texts = [p for p, _ in prompts]
    kwargs = dict(n=cfg.group, params=params, max_new_tokens=cfg.max_new_tokens, seed=seed, chat=cfg.chat)
    seconds, outs = timed(engine.generate, texts, **kwargs)
    trained = _trained(engine) - before
    st, learner = engine.last_stats, learner_of(engine)
    tokens = sum(len(o.completion_token_ids) for o in outs)
    rewards = [reward(o.text, prompts[o.prompt_index][1]) for o in outs]
    rollout_s = seconds - trained
    rec = dict(reward=sum(rewards) / len(rewards), tokens=tokens, emitted=st.emitted, passes=st.target_passes)
    rec |= dict(accepted=st.accepted, drafted=st.drafted, tau=st.emitted / max(st.target_passes, 1))
    rec |= dict(alpha=st.accepted / st.drafted if st.drafted else None, rollout_seconds=rollout_s)
    rec |= dict(tokens_per_s=tokens / rollout_s, head_train_seconds=trained, weight_version=outs[0].weight_version)
    rec["head_version"] = None if learner is None else learner.stats()["version"]
    return outs, rec


def _push(engines: dict[str, RolloutEngine], trainer: PolicyTrainer) -> dict[str, tuple[float, float]]:
    """The policy's new weights into every engine: method -> (seconds of the update, of head training inside it)."""
    out = {}
    for m, eng in engines.items():
        before = _trained(eng)
        seconds, _ = timed(eng.update_weights, trainer.weights())
        trained = _trained(eng) - before
        out[m] = (seconds - trained, trained)
    return out


def _step(engines, trainer: PolicyTrainer, prompts, step: int, cfg: RLBenchConfig, log) -> tuple[list[dict], dict]:
    """One policy step: every method's rollouts, the policy's update on the first's, the weights to all; (records,
    the policy's record). A method's wall time: its rollouts, the update (shared), its push, its head training."""
    kept = {}

    def measure(m, case):
        kept[m], rec = _rollouts(engines[m], prompts, cfg, seed=cfg.seed * 1000 + step)
        return rec

    records = side_by_side([dict(step=step)], cfg.methods, measure, log)
    first = kept[cfg.methods[0]]
    rewards = torch.tensor([reward(o.text, prompts[o.prompt_index][1]) for o in first])
    adv = advantages(rewards.reshape(len(prompts), cfg.group))  # [P, G]
    update_s, info = timed(trainer.step, first, adv)
    pushes = _push(engines, trainer)
    for rec in records:
        push_s, trained = pushes[rec["method"]]
        rec |= dict(update_seconds=update_s, push_seconds=push_s)
        rec["head_train_seconds"] += trained
        rec["wall_seconds"] = rec["rollout_seconds"] + rec["head_train_seconds"] + update_s + push_s
    policy = dict(step=step, reward=float(rewards.mean()), update_seconds=update_s, **info)
    log(f"step {step}: reward {policy['reward']:.3f}, loss {info['loss']:.4f}, update {update_s:.2f}s")
    return records, policy


def run_rl_bench(target: LoadedModel, draft, prompts, cfg: RLBenchConfig, log=print) -> dict:
    """The RL loop, every method side by side (see the module docstring); `draft` and `prompts` are not used (the
    task makes its own prompts; the frozen head is trained here)."""
    result = started()
    rng = random.Random(cfg.seed)
    pool = [problem(rng) for _ in range(cfg.pool)]
    heads = any(m.startswith("frozen") for m in cfg.methods)
    head, frozen = train_frozen(target, pool, cfg, log) if heads else (None, None)
    engines = make_engines(target, head, cfg)
    warm_up(engines, cfg)
    trainer = PolicyTrainer(target, cfg.lr, cfg.max_grad_norm)
    records, policy = [], []
    for step in range(cfg.steps):
        recs, pol = _step(engines, trainer, step_prompts(pool, step, cfg.prompts_per_step), step, cfg, log)
        records, policy = records + recs, policy + [pol]
    learners = {m: learner_of(e).stats() for m, e in engines.items() if learner_of(e) is not None}
    extra = dict(config=asdict(cfg), target=target.name, pool=[dict(prompt=p, answer=a) for p, a in pool])
    extra |= dict(frozen_head=frozen, learners=learners, summary=summarize(records, cfg))
    return result | extra | dict(records=records, policy=policy)


# --- the report ----------------------------------------------------------------------------------------------------


def windows(steps: int) -> list[tuple[int, int]]:
    """The summary's windows of steps: [first, last] of every WINDOW steps."""
    return [(a, min(a + WINDOW, steps) - 1) for a in range(0, steps, WINDOW)]


def summarize(records: list[dict], cfg: RLBenchConfig) -> list[dict]:
    """Per method: tau pooled over each window (emitted / passes), alpha pooled, rollout tokens/s pooled and over
    plain's, wall and head-training seconds in all (wall also over plain's)."""
    out = []
    for m in cfg.methods:
        recs = [r for r in records if r["method"] == m]
        total = {k: sum(r[k] for r in recs) for k in ("emitted", "passes", "accepted", "drafted", "tokens")}
        total |= {k: sum(r[k] for r in recs) for k in ("rollout_seconds", "wall_seconds", "head_train_seconds")}
        taus = []
        for a, b in windows(cfg.steps):
            win = [r for r in recs if a <= r["step"] <= b]
            taus.append(sum(r["emitted"] for r in win) / max(sum(r["passes"] for r in win), 1))
        alpha = total["accepted"] / total["drafted"] if total["drafted"] else None
        tps = total["tokens"] / total["rollout_seconds"]
        out.append(dict(method=m, tau_windows=taus, alpha=alpha, tokens_per_s=tps, **total))
    base = next((s for s in out if s["method"] == "plain"), None)
    for s in out:
        s["tokens_per_s_x_plain"] = s["tokens_per_s"] / base["tokens_per_s"] if base else None
        s["wall_x_plain"] = s["wall_seconds"] / base["wall_seconds"] if base else None
    return out


def _summary_columns(steps: int) -> list:
    cols = ["method"]
    for k, (a, b) in enumerate(windows(steps)):
        cols.append(Col(f"tau {a}-{b}", lambda s, k=k: s["tau_windows"][k], ".2f"))
    cols += [("alpha", "alpha", ".2f"), ("tokens/s", "tokens_per_s", ".1f"), ("x plain", "tokens_per_s_x_plain", ".2f")]
    cols += [("head train s", "head_train_seconds", ".1f"), ("wall s", "wall_seconds", ".1f")]
    return cols + [("wall x plain", "wall_x_plain", ".2f")]


def _by_step(result: dict) -> list[dict]:
    """One row per step: the policy's record and every method's tau and tokens/s (fields tau_M, tps_M)."""
    rows = {p["step"]: dict(p) for p in result["policy"]}
    for r in result["records"]:
        rows[r["step"]] |= {f"tau_{r['method']}": r["tau"], f"tps_{r['method']}": r["tokens_per_s"]}
    return [rows[s] for s in sorted(rows)]


def to_markdown(result: dict) -> str:
    cfg, methods = result["config"], result["config"]["methods"]
    head = (
        f"bench rl: target {result['target']}, GRPO on two-digit additions (reward: the first number is the sum), "
        f"{cfg['steps']} steps of {cfg['prompts_per_step']} prompt(s) x G = {cfg['group']} at T = 1, "
        f"{cfg['max_new_tokens']} new tokens at most, Adam lr {cfg['lr']:g}, a pool of {cfg['pool']} problems; "
        f"the policy trains on {methods[0]}'s rollouts, every engine gets its weights after each step"
    )
    lines = report_head(result, head)
    rewards = [p["reward"] for p in result["policy"]]
    means = [sum(rewards[a : b + 1]) / (b - a + 1) for a, b in windows(cfg["steps"])]
    lines += ["reward by window of steps: " + ", ".join(f"{x:.3f}" for x in means), ""]
    frozen = result.get("frozen_head")
    if frozen:
        lines += [
            f"frozen head: {frozen['samples']} rollouts ({frozen['tokens']} tokens) sampled in "
            f"{frozen['sample_seconds']:.1f}s, {frozen['steps']} training steps in {frozen['train_seconds']:.1f}s, "
            f"top-1 agreement by unroll step {frozen['final_top1_by_step']}",
            "",
        ]
    lines += table(result["summary"], _summary_columns(cfg["steps"]))
    taus = tuple(f"tau_{m}" for m in methods)
    cols = ["step", ("reward", "reward", ".3f"), ("loss", "loss", ".4f"), ("logprob gap", "logprob_gap", ".1e")]
    cols += [("update s", "update_seconds", ".2f"), Col("tau " + " / ".join(methods), taus, ".2f")]
    cols += [Col("tokens/s " + " / ".join(methods), tuple(f"tps_{m}" for m in methods), ".1f")]
    return "\n".join([*lines, "", *table(_by_step(result), cols)])


def plot(result: dict, path) -> None:
    """Two panels: the reward of the policy's rollouts by step (and its mean over each pass over the pool); tau by
    step, one line per method."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4))
    policy, cfg = result["policy"], result["config"]
    left.plot([p["step"] for p in policy], [p["reward"] for p in policy], marker="o", markersize=3, label="step")
    per_epoch = max(cfg["pool"] // cfg["prompts_per_step"], 1)  # steps per pass over the pool
    for a in range(0, len(policy), per_epoch):
        epoch = policy[a : a + per_epoch]
        mean = sum(p["reward"] for p in epoch) / len(epoch)
        label = None if a else "mean over a pass over the pool"
        left.plot([epoch[0]["step"], epoch[-1]["step"]], [mean] * 2, color="black", label=label)
    left.legend(fontsize=8)
    left.set(title=f"reward of {cfg['methods'][0]}'s rollouts (the policy's)", xlabel="step")
    left.set(ylabel="mean reward", ylim=(-0.02, 1.02))
    for m in cfg["methods"]:
        recs = [r for r in result["records"] if r["method"] == m]
        right.plot([r["step"] for r in recs], [r["tau"] for r in recs], marker="o", markersize=3, label=m)
    right.set(title="tau (tokens per target pass) by step", xlabel="step", ylabel="tau")
    right.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
