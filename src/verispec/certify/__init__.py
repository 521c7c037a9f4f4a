"""Statistical certification that a sampler reproduces the target distribution."""

from .stats import GofResult, chisquare_gof, chisquare_power, merge_small_bins

__all__ = ["GofResult", "chisquare_gof", "chisquare_power", "merge_small_bins"]
