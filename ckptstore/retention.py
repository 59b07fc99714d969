"""Retention policy: which committed steps to keep. Pure policy, no I/O (orbax keeps it apart the same way)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, List, Optional


@dataclass(frozen=True)
class RetentionPolicy:
    """``keep_last``: keep the newest N committed steps (None: keep all). ``keep_every``: also keep forever
    every step divisible by K (milestones). The newest committed step is always kept."""
    keep_last: Optional[int] = None
    keep_every: Optional[int] = None

    def __post_init__(self):
        for name in ("keep_last", "keep_every"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, int) or v < 1):
                raise ValueError(f"{name} must be a positive int or None, got {v!r}")

    def to_delete(self, committed: Iterable[int]) -> List[int]:
        steps = sorted(committed)
        if self.keep_last is None or not steps:
            return []
        keep = set(steps[-self.keep_last:])
        if self.keep_every:
            keep.update(s for s in steps if s % self.keep_every == 0)
        return [s for s in steps if s not in keep]
