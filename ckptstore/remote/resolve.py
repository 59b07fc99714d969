"""Which step to resume from: local first, then remote, then ``load_path``; newest first within a tier.

Pure policy over catalogs: yields candidates; the store tries each and falls back on damage. A step that
both tiers hold is taken from local disk (the remote is the fallback when the local copy is damaged). A remote
step newer than every local one wins over the local ones (the job ran on, elsewhere, after this disk's last
save), so "freshest valid" holds across tiers.
"""
from __future__ import annotations

import re
from typing import Iterator, List, Optional, Tuple

from ..format.layout import check_step

_STEP_URL = re.compile(r"^(?P<store>.+?)/+steps/+(?P<step>[0-9]{1,12})/*$")


def candidates(local_catalog, remote_catalog=None, *, newest_only: bool = False) -> Iterator[Tuple[int, str]]:
    """``(step, tier)`` newest first; ``tier`` is ``"local"`` or ``"remote"``. Remote commit markers are
    looked up lazily (one request per step tried, not per step stored). ``newest_only``: of the remote, only
    the steps :meth:`~ckptstore.format.catalog.Catalog.newest_committed` finds (the latest pointer's and any newer:
    a few requests whatever the number of steps), every local step still."""
    local = set(local_catalog.committed_steps())
    if remote_catalog is not None and newest_only:
        remote = remote_catalog.newest_committed()[0]
        for step in sorted(local | set(remote), reverse=True):
            yield step, ("local" if step in local else "remote")
        return
    remote_dirs: List[int] = remote_catalog.step_dirs() if remote_catalog is not None else []
    for step in sorted(local | set(remote_dirs), reverse=True):
        if step in local:
            yield step, "local"
        elif remote_catalog.is_committed(step):
            yield step, "remote"


def split_load_path(url: str) -> Tuple[str, Optional[int]]:
    """``'s3://b/run/steps/000000001000'`` -> ``('s3://b/run', 1000)``; a store URL -> ``(url, None)``."""
    m = _STEP_URL.match(str(url))
    if m:
        return m.group("store"), check_step(int(m.group("step")))
    return str(url).rstrip("/"), None
