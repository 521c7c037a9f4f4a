"""verispec's benchmarks (`verispec bench ...`), each run by one harness (`verispec.bench.harness`). Every result
they write carries `provenance()`: the commit, date and command that made it."""

from ._provenance import command_line, git_commit, provenance, provenance_line, provenance_lines

__all__ = ["command_line", "git_commit", "provenance", "provenance_line", "provenance_lines"]
