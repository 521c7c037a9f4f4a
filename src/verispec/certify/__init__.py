"""Statistical certification that a sampler (kernel, tree_kernel) or a generator (generate: methods, scoring,
report) reproduces the target distribution; bugs, mutants and known_bugs prove that the tests bite."""

from .stats import GofResult, chisquare_gof, chisquare_power, detectable_tv, holm, merge_small_bins

__all__ = ["GofResult", "chisquare_gof", "chisquare_power", "detectable_tv", "holm", "merge_small_bins"]
