"""What each committed step occupies: per-rank bytes and the bytes only that step references (read-only).

``bytes_unique`` of a step is the raw size of the chunks that no other committed step references: what
deleting that step alone would release (for packed chunks, once gc repacks their packs). Chunks are counted
once per step however many ranks or keys reference them. Reads one manifest per rank and step.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, Iterable, List, Optional

from ..util.errors import CheckpointError
from ..format.manifest import Commit


@dataclass
class StepUsage:
    step: int
    world_size: int = 0
    rank_bytes: List[int] = field(default_factory=list)    # logical bytes of each rank's tensors and arrays
    chunks: Dict[str, int] = field(default_factory=dict)   # chunk id -> raw bytes, distinct over ranks
    bytes_unique: Optional[int] = None
    error: Optional[str] = None


def step_usage(catalog, steps: Iterable[int], commits: Optional[Dict[int, Commit]] = None) -> Dict[int, StepUsage]:
    """:class:`StepUsage` of each step (``error`` set, no sizes, for a step whose metadata is unreadable).
    ``commits``: markers already read (step -> Commit), to avoid reading them twice."""
    out: Dict[int, StepUsage] = {}
    for step in steps:
        u = out[step] = StepUsage(step)
        try:
            commit = (commits or {}).get(step) or catalog.read_commit(step)
            u.world_size = commit.world_size
            for rank in sorted(commit.manifests):
                m = catalog.read_manifest(commit, rank)
                u.rank_bytes.append(m.bytes_total)
                for c in m.chunk_refs():
                    u.chunks[c.blob_id] = c.nbytes
        except CheckpointError as e:
            u.error = str(e)
            u.chunks = {}
    refs: Dict[str, int] = {}
    for u in out.values():
        for cid in u.chunks:
            refs[cid] = refs.get(cid, 0) + 1
    for u in out.values():
        if u.error is None:
            u.bytes_unique = sum(n for cid, n in u.chunks.items() if refs[cid] == 1)
    return out


def bytes_released(usage: Dict[int, StepUsage], dropped: Iterable[int]) -> int:
    """Raw bytes of the chunks referenced only by the ``dropped`` steps (none of the others in ``usage``)."""
    dropped = set(dropped)
    kept = set()
    for s, u in usage.items():
        if s not in dropped:
            kept.update(u.chunks)
    gone: Dict[str, int] = {}
    for s in dropped:
        if s in usage:
            gone.update({cid: n for cid, n in usage[s].chunks.items() if cid not in kept})
    return sum(gone.values())
