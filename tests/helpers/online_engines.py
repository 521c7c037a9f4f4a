"""A draft=online engine factory for the Ray tests (module-level and picklable, as tests/helpers/ray_engines.py's):
the 8-layer tiny target, its head trained between batches, failing on demand (`FaultyEngine`)."""

from __future__ import annotations

from dataclasses import dataclass

from verispec.engine.config import SpecConfig

from .ray_engines import FaultyEngine
from .tiny import loaded

ONLINE = "draft=online,gamma=3,stop_below=none,random=stream"


@dataclass(frozen=True)
class OnlineTinyEngine:
    crash_dir: str | None = None

    def __call__(self) -> FaultyEngine:
        return FaultyEngine(loaded(0, layers=8), config=SpecConfig.parse(ONLINE), crash_dir=self.crash_dir)
