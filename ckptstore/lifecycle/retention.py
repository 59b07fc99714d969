"""Retention: which committed steps to keep. Small pure policy objects (no I/O), as orbax's composable
preservation policies (``LatestN``, ``EveryNSteps``, ``BestN``, their union), plus :func:`apply`, the one code
path that deletes what a policy drops (after a save, locally; after an upload, on the remote; ``gc``).

A policy sees the committed steps as :class:`StepInfo` (step + the metrics its commit marker recorded) and
returns the steps it keeps. Whatever it says, :func:`apply` never deletes the newest committed step, the best
step (by the policy's criterion), or a step in ``protected`` (a pending upload, a step a save is writing).

The best step is derived from the commit markers alone (:func:`best_step`), so it survives restarts: every
commit marker written under a :class:`Retention` records its criterion (``best: {"metric", "mode"}``), and a
reader finds "best" without knowing the policy.
"""
from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field
from typing import Any, Dict, Iterable, List, Mapping, Optional, Sequence, Set, Tuple

from ..util.errors import CheckpointError

log = logging.getLogger("ckptstore")

MODES = ("min", "max")


@dataclass(frozen=True)
class StepInfo:
    """One committed step as a policy sees it: its number and the metrics recorded in its commit marker."""
    step: int
    metrics: Mapping[str, Any] = field(default_factory=dict)


def metric_value(metrics: Optional[Mapping[str, Any]], metric: str) -> Optional[float]:
    """``metrics[metric]`` as a float when it is a finite number (not a bool), else ``None``: a step without
    the metric (or with NaN / inf / a non-number) never counts as best."""
    if not metrics or metric not in metrics:
        return None
    v = metrics[metric]
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return None
    v = float(v)
    return v if math.isfinite(v) else None


def _check_mode(mode: str) -> str:
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    return mode


def _check_count(name: str, v) -> Optional[int]:
    if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
        raise ValueError(f"{name} must be a positive int or None, got {v!r}")
    return v


def rank_best(infos: Iterable[StepInfo], metric: str, mode: str) -> List[int]:
    """Steps that have ``metric``, best first (ties: the newer step first)."""
    scored = [(v, s.step) for s in infos if (v := metric_value(s.metrics, metric)) is not None]
    sign = 1.0 if _check_mode(mode) == "min" else -1.0
    scored.sort(key=lambda vs: (sign * vs[0], -vs[1]))
    return [s for _, s in scored]


# -- policies ------------------------------------------------------------------------------------------------
class Policy:
    """A preservation policy: ``keep(infos) -> set of steps`` (``infos`` ascending by step). Pure."""
    needs_metrics = False

    def keep(self, infos: Sequence[StepInfo]) -> Set[int]:
        raise NotImplementedError


@dataclass(frozen=True)
class LatestN(Policy):
    """The newest ``n`` committed steps."""
    n: int

    def __post_init__(self):
        _check_count("n", self.n)

    def keep(self, infos):
        return {s.step for s in sorted(infos, key=lambda s: s.step)[-self.n:]}


@dataclass(frozen=True)
class EveryNSteps(Policy):
    """Every step divisible by ``k`` (milestones)."""
    k: int

    def __post_init__(self):
        _check_count("k", self.k)

    def keep(self, infos):
        return {s.step for s in infos if s.step % self.k == 0}


@dataclass(frozen=True)
class BestN(Policy):
    """The ``n`` best steps by ``metrics[metric]`` (``mode`` "min" or "max"); steps without it never count."""
    n: int
    metric: str = "loss"
    mode: str = "min"
    needs_metrics = True

    def __post_init__(self):
        _check_count("n", self.n)
        _check_mode(self.mode)

    def keep(self, infos):
        return set(rank_best(infos, self.metric, self.mode)[: self.n])


@dataclass(frozen=True)
class AnyOf(Policy):
    """The union of what each policy keeps."""
    policies: Tuple[Policy, ...]

    @property
    def needs_metrics(self):
        return any(p.needs_metrics for p in self.policies)

    def keep(self, infos):
        out: Set[int] = set()
        for p in self.policies:
            out |= p.keep(infos)
        return out


@dataclass(frozen=True)
class Retention:
    """What ``Store(keep=...)`` keeps: the union of the newest ``last`` committed steps, every ``every``-th
    step, and the ``best`` steps by ``metrics[metric]`` (``mode`` "min" or "max"). Never deleted whatever
    the policy: the newest committed step, the best step (by ``metric`` / ``mode``; ``metric=None``: no best
    criterion), a step whose upload is pending, a step a save is writing. ``Retention()`` keeps everything.
    Counts are numbers of steps; ``every`` is a step interval."""
    last: Optional[int] = None
    every: Optional[int] = None
    best: Optional[int] = None
    metric: Optional[str] = "loss"
    mode: str = "min"

    def __post_init__(self):
        for name in ("last", "every", "best"):
            _check_count(name, getattr(self, name))
        _check_mode(self.mode)
        if self.metric is not None and (not isinstance(self.metric, str) or not self.metric):
            raise ValueError(f"metric must be a non-empty str or None, got {self.metric!r}")
        if self.best is not None and self.metric is None:
            raise ValueError("Retention(best=...) needs a metric")

    @property
    def deletes(self) -> bool:
        """Whether this policy ever deletes anything (``Retention()`` keeps all)."""
        return any(v is not None for v in (self.last, self.every, self.best))

    @property
    def criterion(self) -> Optional[Dict[str, str]]:
        """``{"metric", "mode"}`` recorded in every commit marker, or ``None`` without a metric."""
        return None if self.metric is None else {"metric": self.metric, "mode": self.mode}

    @property
    def policy(self) -> Policy:
        parts: List[Policy] = []
        if self.last is not None:
            parts.append(LatestN(self.last))
        if self.every is not None:
            parts.append(EveryNSteps(self.every))
        if self.best is not None:
            parts.append(BestN(self.best, self.metric, self.mode))
        return AnyOf(tuple(parts))

    @property
    def needs_metrics(self) -> bool:
        return self.metric is not None and self.deletes

    def keep(self, infos: Sequence[StepInfo], protected: Iterable[int] = ()) -> Set[int]:
        """Steps kept: the policy's union, plus the newest step, the best step and ``protected``."""
        infos = sorted(infos, key=lambda s: s.step)
        if not infos:
            return set(protected)
        if not self.deletes:
            return {s.step for s in infos} | set(protected)
        keep = self.policy.keep(infos) | {infos[-1].step} | set(protected)
        if self.metric is not None:
            ranked = rank_best(infos, self.metric, self.mode)
            if ranked:
                keep.add(ranked[0])
        return keep

    def to_delete(self, infos: Sequence[StepInfo], protected: Iterable[int] = ()) -> List[int]:
        keep = self.keep(infos, protected)
        return sorted(s.step for s in infos if s.step not in keep)


# -- reading the criterion back from the commit markers -----------------------------------------------------
def criterion(commits: Iterable[Any], metric: Optional[str] = None, mode: Optional[str] = None,
              default: Tuple[str, str] = ("loss", "min")) -> Tuple[str, str]:
    """``(metric, mode)`` for judging "best" among decoded commits: the given ones; else the newest commit's
    recorded criterion (``commit.best``; its mode only goes with its own metric); else ``default``."""
    recorded: Mapping[str, Any] = {}
    for c in sorted(commits, key=lambda c: c.step, reverse=True):
        rec = getattr(c, "best", None)
        if isinstance(rec, Mapping) and isinstance(rec.get("metric"), str):
            recorded = rec
            break
    if metric and metric != recorded.get("metric"):
        recorded = {}
    return metric or recorded.get("metric") or default[0], _check_mode(mode or recorded.get("mode") or default[1])


def best_step(commits: Iterable[Any], metric: Optional[str] = None, mode: Optional[str] = None) -> Optional[int]:
    """The best step among decoded :class:`~ckptstore.format.manifest.Commit` objects, or ``None``.

    The criterion is ``metric`` / ``mode`` when given, else the one recorded in the newest commit marker that
    records one (``commit.best``); every commit is then judged by it (``metrics[metric]``, a finite number;
    steps without it never count; ties go to the newer step). ``mode`` defaults to "min" with an explicit
    ``metric``. No criterion anywhere -> ``None``."""
    commits = sorted(commits, key=lambda c: c.step)
    if metric is None:
        for c in reversed(commits):
            crit = getattr(c, "best", None)
            if crit:
                metric, mode = crit["metric"], mode or crit["mode"]
                break
        if metric is None:
            return None
    ranked = rank_best((StepInfo(c.step, c.metrics or {}) for c in commits), metric, mode or "min")
    return ranked[0] if ranked else None


# -- applying a policy to a store ------------------------------------------------------------------------------
def step_infos(catalog, steps: Iterable[int], cache: Optional[Dict[int, Mapping[str, Any]]] = None
               ) -> List[StepInfo]:
    """:class:`StepInfo` of ``steps`` read from their commit markers (``cache``: step -> metrics, filled as
    markers are read). An unreadable marker counts as a step without metrics."""
    out = []
    for s in sorted(steps):
        if cache is not None and s in cache:
            out.append(StepInfo(s, cache[s]))
            continue
        try:
            metrics = catalog.read_commit(s).metrics or {}
        except CheckpointError as e:
            log.warning("retention: cannot read the commit marker of step %d (%s): judged without metrics", s, e)
            metrics = {}
        else:
            if cache is not None:
                cache[s] = metrics
        out.append(StepInfo(s, metrics))
    return out


def plan(catalog, policy: Optional[Retention], protected: Iterable[int] = (),
         cache: Optional[Dict[int, Mapping[str, Any]]] = None) -> List[int]:
    """The committed steps of ``catalog`` that ``policy`` drops (never the newest, the best, ``protected``)."""
    if policy is None or not policy.deletes:
        return []
    steps = catalog.committed_steps()
    if policy.needs_metrics:
        infos = step_infos(catalog, steps, cache)
    else:
        infos = [StepInfo(s) for s in steps]
    return policy.to_delete(infos, protected)


def apply(catalog, policy: Optional[Retention], protected: Iterable[int] = (), *,
          cache: Optional[Dict[int, Mapping[str, Any]]] = None, dry_run: bool = False,
          before_delete=None) -> List[int]:
    """Delete the committed steps ``policy`` drops from ``catalog`` (commit marker first, then the step's
    files: :meth:`Catalog.delete_step`); return them, ascending. The newest committed step, the best step
    and ``protected`` are never deleted. Freeing the blobs and packs only these steps used is gc's business
    (:func:`ckptstore.lifecycle.gc.collect`, under the gc lease). ``before_delete(step)``: called before each deletion
    (the store moves its latest pointer away). ``dry_run``: only say what would go."""
    doomed = plan(catalog, policy, protected, cache)
    if dry_run:
        return doomed
    for s in doomed:
        if before_delete is not None:
            before_delete(s)
        catalog.delete_step(s)
        if cache is not None:
            cache.pop(s, None)
    return doomed
