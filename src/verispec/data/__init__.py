"""Data shipped with verispec: the benchmark prompt sets, by name.

`--prompts code math chat` in every command that reads prompt files means the files in
`verispec/data/prompts/` (their origin and licences: `verispec/data/prompts/NOTICE.md`). One JSON object a line,
`{"id", "category", "prompt"}`:

* `chat`: 80 open-ended instructions (Alpaca questions),
* `code`: 80 Python function completions (HumanEval prompts),
* `math`: 77 grade-school math word problems (GSM8K questions).
"""

from __future__ import annotations

import errno
from difflib import get_close_matches
from importlib import resources
from pathlib import Path

__all__ = ["PROMPT_SETS", "UnknownPromptSet", "prompt_file"]

PROMPT_SETS = ("chat", "code", "math")


class UnknownPromptSet(FileNotFoundError):
    """A `--prompts` value that is neither a file nor a built-in prompt set's name (an OSError: callers that report
    an unreadable prompt file report it the same way)."""

    def __init__(self, value: str):
        close = get_close_matches(value, PROMPT_SETS, n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        what = f"no such file, nor a built-in prompt set ({', '.join(PROMPT_SETS)}){hint}"
        super().__init__(errno.ENOENT, what, value)

    def __str__(self) -> str:  # the reason alone: callers name the value ("cannot read prompts from X: ...")
        return self.strerror


def prompt_file(value: str | Path) -> Path:
    """The prompt file `value` names: an existing file (it wins over a built-in name), else a built-in prompt set
    (`chat`, `code`, `math`; a `.jsonl` suffix may be given: `code.jsonl`).

    Raises:
        UnknownPromptSet: `value` is neither (a FileNotFoundError whose message lists the built-in names).
    """
    path = Path(value)
    if path.is_file():
        return path
    name = str(value).removesuffix(".jsonl")
    if name in PROMPT_SETS:
        return Path(str(resources.files(__name__).joinpath("prompts", f"{name}.jsonl")))
    raise UnknownPromptSet(str(value))
