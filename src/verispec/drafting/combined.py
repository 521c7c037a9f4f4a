"""Chosen branches and a sampled chain in one tree: e.g. trie branches from earlier rollouts (`HistoryProposer`)
beside a chain sampled by a draft model (`DraftModelProposer`), verified in one target pass.

Node order per row: the sampled chain first, then the chooser's tree (its parents shifted past the chain). Rule
"mixed" tests each child against the running residual with the distribution it came from (the draft's q for the
chain, one-hot for chosen nodes): exact because neither part looks at the other's tokens (a chain token equal to a
branch token is not deduplicated: whether a node exists must never depend on a sampled value).
"""

from __future__ import annotations

from .base import BatchView, Draft, Proposer
from .draft_model import DraftModelProposer
from .tree import TreeSpec

__all__ = ["CombinedProposer"]


class CombinedProposer(Proposer):
    """chooser: a proposer of deterministic trees; sampler: a chain-drafting DraftModelProposer; gamma: the chain's
    length (at most; a row's cap bounds both parts). choose_depth: None drafts both parts for every row; d picks one
    part per row and step: the chooser's tree alone where it reaches depth d, else the chain alone. Still exact: the
    pick looks only at the chooser's tree, which does not depend on anything sampled."""

    name = "combined"

    def __init__(self, chooser: Proposer, sampler: DraftModelProposer, gamma: int, choose_depth: int | None = None):
        spec = chooser.tree
        if spec is None or spec.rule != "deterministic":
            raise ValueError("the chooser must draft deterministic trees (a TreeSpec with rule 'deterministic')")
        if not isinstance(sampler, DraftModelProposer) or sampler.tree is not None:
            raise ValueError("the sampler must be a DraftModelProposer that drafts chains (tree=None)")
        if isinstance(gamma, bool) or not isinstance(gamma, int) or gamma < 1:
            raise ValueError(f"gamma (the sampled chain's length) must be an integer >= 1, got {gamma!r}")
        if choose_depth is not None and (isinstance(choose_depth, bool) or not isinstance(choose_depth, int)):
            raise ValueError(f"choose_depth must be None or an integer, got {choose_depth!r}")
        self.chooser, self.sampler, self.gamma, self.choose_depth = chooser, sampler, gamma, choose_depth
        topk = (spec.topk if spec.dynamic else max(spec.widths)) + 1  # the slots and nodes of the tree plus the chain
        self.tree = TreeSpec(dynamic=True, depth=max(spec.max_depth, gamma), topk=topk, budget=spec.max_nodes + gamma)
        self.accepted_by_source = {"chain": 0, "branches": 0}  # accepted tokens per part, over the proposer's life

    def start(self, view: BatchView, capacity: int) -> None:
        self.chooser.start(view, capacity)
        self.sampler.start(view, capacity)

    def add(self, view: BatchView, capacity: int) -> None:
        self.chooser.add(view, capacity)
        self.sampler.add(view, capacity)

    def select(self, rows: list[int]) -> None:
        self.chooser.select(rows)
        self.sampler.select(rows)

    def weights_changed(self, model) -> float:
        return self.chooser.weights_changed(model) + self.sampler.weights_changed(model)

    def release(self) -> None:
        self.chooser.release()
        self.sampler.release()

    def propose(self, view: BatchView, caps: list[int]) -> Draft:
        self._branches = branches = self.chooser.propose(view, caps)  # chosen first: it never sees the chain
        pick = self.choose_depth
        trie = [pick is not None and d >= pick for d in branches.depth]  # rows drafted by the chooser alone
        chain_caps = [0 if t else min(self.gamma, c) for t, c in zip(trie, caps)]
        self._chain = chain = self.sampler.propose(view, chain_caps)
        c_ids, b_ids, b_par = chain.token_ids.tolist(), branches.token_ids.tolist(), branches.parents.tolist()
        tokens, parents, sampled = [], [], []
        kept = [t if trie[b] or pick is None else 0 for b, t in enumerate(branches.num_nodes)]
        for b, (k, t) in enumerate(zip(chain.num_nodes, kept)):
            tokens.append(c_ids[b][:k] + b_ids[b][:t])
            parents.append(list(range(-1, k - 1)) + [p + k if p >= 0 else -1 for p in b_par[b][:t]])
            sampled.append([True] * k + [False] * t)
        # q for the chain's slots (root, then each chain node); the branches' slots lie beyond and are never read
        return Draft.tree_of(tokens, parents, chain.probs, "mixed", view.device, sampled=sampled)

    def update(self, view: BatchView, old_lengths: list[int], draft: Draft, paths: list[list[int]]) -> None:
        """Each part keeps the accepted path where it went through its own nodes."""
        chains = self._chain.num_nodes  # per row: the chain's length (its nodes come first)
        chain_paths = [path if path and path[0] < k else [] for path, k in zip(paths, chains)]
        branch_paths = [[n - k for n in path] if path and path[0] >= k else [] for path, k in zip(paths, chains)]
        self.accepted_by_source["chain"] += sum(map(len, chain_paths))
        self.accepted_by_source["branches"] += sum(map(len, branch_paths))
        self.sampler.update(view, old_lengths, self._chain, chain_paths)
        self.chooser.update(view, old_lengths, self._branches, branch_paths)
