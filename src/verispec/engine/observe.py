"""Step observers: the engine's hooks into each speculative step, for tools that watch it (benchmarks' probes) or
deliberately change it (the certifier's mutants); `SpeculativeGenerator(..., observers=[...])` calls every
observer's hooks in order. An observer that returns a replacement Draft, or wraps a grammar state, changes what is
verified: exactness holds for the default (no observer changes anything), and the certifier uses the seam to show
its tests catch such changes.
"""

from __future__ import annotations

__all__ = ["StepObserver"]


class StepObserver:
    """Hooks into each speculative step; every hook's default does nothing: subclass and override what you need.

    `keep_top`: an observer that learns from the target (an online draft head) asks for its top-K raw
    log-probabilities at every emitted token (`StepOutput.targets`); the engine computes the most any observer asks
    (0: none)."""

    keep_top = 0

    def grammar(self, request, state):
        """A request's GrammarState (or None: no constraint) as its row joins; returns the state the row uses."""
        return state

    def after_draft(self, view, draft):
        """The proposer's draft (`drafting.Draft`) for the batch `view`; a returned Draft replaces it."""
        return None

    def after_fit(self, view, drafted, fitted):
        """The draft the grammar fitted (`fitted`, from `drafted`); a returned Draft replaces it."""
        return None

    def after_verify(self, view, draft, out) -> None:
        """The verified step: `draft` as verified, `out` its `StepOutput`."""

    def after_commit(self, view, out) -> None:
        """The step committed: every row has taken its tokens of `out`."""
