"""Statistical certification that a sampler or a generator reproduces the target distribution.

kernel: any chain-verification function against exactly known laws (`verispec certify kernel`);
generate: a generator's continuations against the target model's own conditionals (`verispec certify generate`;
  methods: what is certified, scoring: the scores and tests, report: the report);
bugs: deliberately broken verifiers that prove the tests bite (`--inject`).
"""

from .stats import GofResult, chisquare_gof, chisquare_power, detectable_tv, holm, merge_small_bins

__all__ = ["GofResult", "chisquare_gof", "chisquare_power", "detectable_tv", "holm", "merge_small_bins"]
