"""Which step is *best*, and which steps a retention policy drops: pure functions over steps and metrics.

STOPGAP for the CLI (``ls``, ``show/pull/export --step best``, ``gc --keep-*``): ``ckptstore.retention`` is
getting ``Retention(last, every, best, metric, mode)`` and ``best_step(commits, metric=None, mode=None)`` in
another branch. At merge, replace :func:`best_step` and :func:`to_delete` by those (same meaning: see below) and
delete this module; the CLI calls nothing else from here.

Meaning:
* best: the step whose ``metrics[metric]`` is smallest (``mode="min"``) or largest (``"max"``); steps without
  that metric, or with a value that is not a finite real number, never count; ties go to the newest step.
  The criterion is the one given, else the one the newest commit recorded (``commit.best = {"metric",
  "mode"}``), else ``loss`` / ``min``; a metric given without a mode takes the recorded mode only if it is the
  recorded metric, else ``min``.
* retention: a step is kept when any given rule keeps it: one of the ``last`` newest, a multiple of
  ``every``, or one of the ``best`` best by the criterion. The newest step and the best step are always kept.
  No rule given: nothing is dropped.
"""
from __future__ import annotations

import math
from typing import Any, Iterable, List, Mapping, Optional, Tuple

DEFAULT_METRIC, DEFAULT_MODE = "loss", "min"
MODES = ("min", "max")


def criterion(commits: Iterable[Any], metric: Optional[str] = None,
              mode: Optional[str] = None) -> Tuple[str, str]:
    """``(metric, mode)``: the given ones, else the newest commit's recorded ``best``, else loss / min."""
    recorded = None
    for c in sorted(commits, key=lambda c: c.step, reverse=True):
        rec = getattr(c, "best", None)
        if isinstance(rec, Mapping) and isinstance(rec.get("metric"), str):
            recorded = rec
            break
    recorded = recorded or {}
    if metric and metric != recorded.get("metric"):
        recorded = {}                     # the recorded mode belongs to another metric
    metric = metric or recorded.get("metric") or DEFAULT_METRIC
    mode = mode or recorded.get("mode") or DEFAULT_MODE
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    return metric, mode


def _score(metrics: Any, metric: str) -> Optional[float]:
    if not isinstance(metrics, Mapping):
        return None
    v = metrics.get(metric)
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return None
    v = float(v)
    return v if math.isfinite(v) else None


def ranked(commits: Iterable[Any], metric: Optional[str] = None, mode: Optional[str] = None) -> List[int]:
    """Steps that have the metric, best first (ties: newest first)."""
    commits = list(commits)
    metric, mode = criterion(commits, metric, mode)
    scored = [(s, c.step) for c in commits if (s := _score(c.metrics, metric)) is not None]
    sign = 1.0 if mode == "min" else -1.0
    return [step for _, step in sorted(scored, key=lambda t: (sign * t[0], -t[1]))]


def best_step(commits: Iterable[Any], metric: Optional[str] = None, mode: Optional[str] = None) -> Optional[int]:
    """The best step of ``commits`` (objects with ``step``, ``metrics`` and maybe ``best``), or ``None``."""
    r = ranked(commits, metric, mode)
    return r[0] if r else None


def to_delete(commits: Iterable[Any], *, last: Optional[int] = None, every: Optional[int] = None,
              best: Optional[int] = None, metric: Optional[str] = None, mode: Optional[str] = None) -> List[int]:
    """Steps the policy drops, ascending. ``commits``: every committed step (objects with ``step`` and
    ``metrics``; ``metrics`` may be ``None`` for a step whose marker could not be read)."""
    for name, v in (("last", last), ("every", every), ("best", best)):
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
            raise ValueError(f"keep-{name} must be a positive int, got {v!r}")
    commits = sorted(commits, key=lambda c: c.step)
    if not commits or (last is None and every is None and best is None):
        return []
    steps = [c.step for c in commits]
    order = ranked(commits, metric, mode)
    keep = {steps[-1]} | set(order[:1])
    if last is not None:
        keep.update(steps[-last:])
    if every is not None:
        keep.update(s for s in steps if s % every == 0)
    if best is not None:
        keep.update(order[:best])
    return [s for s in steps if s not in keep]
