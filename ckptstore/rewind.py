"""Rewinding a run: what ``save`` does with a step not newer than the newest committed one.

``Store(on_rewind="error")`` (default) refuses it; ``"truncate"`` first drops every later step, locally and on
the remote (FORMAT.md "Rewinding a run"), so a run rolled back after a loss spike continues on a clean
timeline. The newest committed step is judged over the local root and the remote this store uploads to (with
``keep_local`` the local root may hold fewer steps than the remote).
"""
from __future__ import annotations

import logging
from typing import Callable, List, Optional

from .errors import IncompatibleCheckpointError

log = logging.getLogger("ckptstore")

ON_REWIND = ("error", "truncate")


def newest_of(local: List[int], remote_newest: Optional[int]) -> Optional[int]:
    """The newest committed step over the local steps (ascending) and the remote's newest (``None``: none)."""
    newest = local[-1] if local else None
    if remote_newest is not None and (newest is None or remote_newest > newest):
        newest = remote_newest
    return newest


def must_truncate(step: int, newest: Optional[int], on_rewind: str) -> bool:
    """Whether saving ``step`` first needs the steps after it dropped. Raises ``IncompatibleCheckpointError``
    naming both steps (``.step``, ``.latest``) when ``step`` is not newer than ``newest`` and ``on_rewind`` is
    ``"error"``."""
    if newest is None or step > newest:
        return False
    if on_rewind == "error":
        what = "re-saving" if step == newest else "rewinding to"
        err = IncompatibleCheckpointError(
            f"{what} step {step}: the newest committed step is {newest}; a save must be newer. Pass "
            f"Store(..., on_rewind=\"truncate\") to drop the steps after {step} and continue from it")
        err.step, err.latest = step, newest
        raise err
    return True


def drop_local_after(catalog, step: int, point_away_from: Callable[[int], None]) -> List[int]:
    """Delete the committed steps of ``catalog`` newer than ``step``, newest first, each after the latest
    pointer was moved away from it (it never names an uncommitted step). Returns them, ascending."""
    dropped = sorted((s for s in catalog.committed_steps() if s > step), reverse=True)
    for s in dropped:
        point_away_from(s)
        catalog.delete_step(s)
    if dropped:
        log.warning("on_rewind=truncate: dropped local steps %s of %s to save step %d", sorted(dropped),
                    catalog.storage.url, step)
    return sorted(dropped)
