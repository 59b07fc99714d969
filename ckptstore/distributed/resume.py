"""Resume: which step a run continues from (agreed by every rank), and how a step's values reach ``state``.

Two small pieces, kept apart from :class:`~ckptstore.orchestration.loading.Loader` (which wires them to a store's
catalogs, pulls and pools):

* :func:`first_valid_step` walks the candidate steps newest first (:func:`ckptstore.remote.resolve.candidates`: local,
  then remote). Under ``torch.distributed`` discovery happens once: rank 0 finds the candidates (the remote's
  latest pointer and the steps after it; the whole listing only if none of them loads), then broadcasts them
  (never every rank LISTing the bucket); each candidate then costs one gather and one broadcast of the ranks'
  outcomes, so a step that is damaged for one rank falls back for all, and an incompatibility on any rank raises
  on all.
* :func:`restore_into` applies one step, read by a :class:`~ckptstore.io.restore.StepLoader`, to ``state``:
  Stateful objects get ``load_state_dict``, other entries are replaced, only once every plain value is read and
  verified (DTensor targets are filled in place by the loader).
"""
from __future__ import annotations

import logging
from typing import Any, Callable, Dict, Iterable, List, MutableMapping, Optional, Tuple

from .collective import Coordinator
from ..util.errors import CheckpointError, CorruptCheckpointError, IncompatibleCheckpointError, TransferError
from ..state.flatten import gc_paused, is_stateful

log = logging.getLogger("ckptstore")

Tier = Tuple[int, str]          # (step, "local" | "remote")


def first_valid_step(list_candidates: Callable[[], List[Tier]], attempt: Callable[[int, str], str], *,
                     coord: Optional[Coordinator] = None, tag: Optional[str] = None,
                     timeout: float = 600.0, substitute: bool = True,
                     more: Optional[Callable[[], List[Tier]]] = None) -> Optional[Tier]:
    """Load the newest candidate step that loads on every rank; return ``(step, tier)`` or ``None``.

    ``list_candidates()`` -> ``[(step, tier), ...]`` newest first; called on rank 0 only under a coordinator
    (the list is broadcast). ``attempt(step, tier)`` loads the step into this rank's state and returns the tier
    it really came from (a damaged local step repaired from the remote is ``"remote"``); it raises
    ``CheckpointError`` for a step that cannot be used (the next one is tried), and
    ``IncompatibleCheckpointError`` for one that must not be skipped, nor any older one (raised on every rank at
    once). A :class:`~ckptstore.util.errors.TransferError` (the step could not be read from an object store within
    the retry policy's deadline: it may be intact) is raised on every rank too, naming the step: a fault of
    the transfer never makes resume fall back to an older step or start fresh (README "Resume order").
    ``substitute=False`` (a step chosen by the caller): a candidate that fails is raised on every rank, not
    skipped. ``more()``: the complete candidate list, asked for (on rank 0, broadcast) only when every
    candidate of the first list failed (the first is then the cheap one: the latest pointer's step)."""
    tiers = _discovered(list_candidates, coord, f"{tag}/steps", timeout)
    tried = set()
    for round_ in range(2 if more is not None else 1):
        if round_ == 1:                               # every cheap candidate failed: the whole listing
            tiers = [t for t in _discovered(more, coord, f"{tag}/more", timeout) if t not in tried]
        for step, tier in tiers:
            i = len(tried)
            tried.add((step, tier))
            error: Optional[BaseException] = None
            fatal = False
            try:
                tier = attempt(step, tier)
            except (IncompatibleCheckpointError, TransferError) as e:
                error, fatal = e, True
            except CheckpointError as e:
                error = e
            except Exception as e:        # any other failure still ends in the agreement (else the other ranks
                error, fatal = e, True    # wait for this one until the timeout), then is raised on every rank
            if coord is not None:
                error, fatal = agree_outcome(coord, f"{tag}/{i}", step, error, fatal, timeout)
            if isinstance(error, TransferError) and substitute:
                raise TransferError(f"cannot read step {step} ({tier}) within the retry policy's deadline; it may "
                                    "well be intact, so resume neither falls back to an older step nor starts "
                                    f"fresh: run it again once the object store answers ({error})", step=step,
                                    key=error.key, blob=error.blob) from error
            if fatal or (error is not None and not substitute):
                raise error
            if error is not None:
                log.warning("cannot resume from step %d, trying an older step: %s", step, error)
                continue
            return step, tier
    return None


READERS_WAIT = 30.0       # seconds rank 0 waits for every rank to read an error it broadcast before raising it


def _discovered(listing: Callable[[], List[Tier]], coord: Optional[Coordinator], tag: str,
                timeout: float) -> List[Tier]:
    """``listing()`` on rank 0, broadcast to every rank (discovery once). A listing that raises on rank 0 is
    raised on every rank (a :class:`~ckptstore.util.errors.TransferError` as one, anything else as a
    ``CheckpointError`` naming rank 0), so no rank waits for a broadcast that never comes."""
    if coord is None:
        return list(listing())
    msg: dict = {"steps": None}
    error: Optional[BaseException] = None
    if coord.rank == 0:
        try:
            msg["steps"] = [list(t) for t in listing()]
        except BaseException as e:  # noqa: B902 - every rank learns of it, then rank 0 raises it
            error = e
            msg = {"steps": None, "error": f"{type(e).__name__}: {e}"[:4000],
                   "transfer": isinstance(e, TransferError)}
    got = coord.broadcast(tag, msg, timeout)
    if error is not None:
        coord.await_readers(tag, min(timeout, READERS_WAIT))     # the caller's process may exit on it
        raise error
    if got["steps"] is None:
        cls = TransferError if got.get("transfer") else CheckpointError
        raise cls(f"rank 0 could not list the steps to resume from: {got['error']}")
    return [(int(s), str(t)) for s, t in got["steps"]]


def agree_outcome(coord: Coordinator, tag: str, step: int, error: Optional[BaseException], fatal: bool,
                  timeout: float) -> Tuple[Optional[BaseException], bool]:
    """Every rank's outcome for ``step`` -> rank 0 -> the same answer everywhere: ``(None, False)`` when all
    loaded it, else this rank's error or one naming the failing ranks (fatal if any rank's was fatal: an
    ``IncompatibleCheckpointError``, or a ``TransferError`` when every fatal one was a transfer error). A rank
    that does not answer within ``timeout`` s counts as fatal: the ranks no longer agree on what they hold."""
    transfer = isinstance(error, TransferError)
    msg = {"ok": error is None, "fatal": fatal, "transfer": transfer,
           "error": None if error is None else str(error)[:2000]}
    try:
        outcomes = coord.gather(f"{tag}/outcome", msg, timeout)
    except CheckpointError as e:                      # rank 0: some rank never answered
        outcomes = [{"ok": False, "fatal": True, "error": str(e)}]
    verdict = None
    if coord.rank == 0:
        bad = [(r, o) for r, o in enumerate(outcomes) if not o["ok"]]
        verdict = {"ok": not bad, "fatal": any(o["fatal"] for _, o in bad),
                   "transfer": all(o.get("transfer", False) for _, o in bad if o["fatal"]),
                   "error": "; ".join(f"rank {r}: {o['error']}" for r, o in bad)[:8000]}
    verdict = coord.broadcast(f"{tag}/verdict", verdict, timeout)
    if verdict["ok"]:
        return None, False
    if verdict["fatal"]:
        if coord.rank == 0:               # the resume raises next: deliver the verdict before this process may exit
            coord.await_readers(f"{tag}/verdict", min(timeout, READERS_WAIT))
        if fatal:
            return error, True
        cls = TransferError if verdict["transfer"] else IncompatibleCheckpointError
        return cls(verdict["error"], step=step), True
    return (error or CorruptCheckpointError(f"another rank could not load it: {verdict['error']}",
                                            step=step)), False


def check_against(live: Any, saved: Any, key: str, step: int, path: Tuple = ()) -> None:
    """Compare the values about to be handed to a Stateful's ``load_state_dict`` with what its
    ``state_dict()`` holds now, where both have a value: a tensor must meet a tensor of the same shape and dtype
    (else ``IncompatibleCheckpointError``: the model or optimizer changed, as for DTensor targets), and a
    tensor, a mapping or a sequence must not meet a value of another kind (else ``CorruptCheckpointError``:
    no legitimate save produces it). Keys present on one side only are left to ``load_state_dict`` (a fresh
    optimizer's ``state`` is empty). Raises before anything is loaded."""
    import torch

    where = "/".join([key, *map(str, path)])
    if isinstance(live, torch.Tensor):
        if not isinstance(saved, torch.Tensor):
            raise CorruptCheckpointError(f"{where}: saved value is {type(saved).__name__}, not a tensor", step=step)
        if tuple(live.shape) != tuple(saved.shape) or live.dtype != saved.dtype:
            raise IncompatibleCheckpointError(
                f"{where}: checkpoint holds {str(saved.dtype).replace('torch.', '')} of shape "
                f"{list(saved.shape)}, the state holds {str(live.dtype).replace('torch.', '')} of shape "
                f"{list(live.shape)}", step=step)
    elif isinstance(live, dict):
        if not isinstance(saved, dict):
            raise CorruptCheckpointError(f"{where}: saved value is {type(saved).__name__}, not a mapping", step=step)
        for k in live.keys() & saved.keys():
            check_against(live[k], saved[k], key, step, path + (k,))
    elif isinstance(live, (list, tuple)):
        if not isinstance(saved, (list, tuple)):
            raise CorruptCheckpointError(f"{where}: saved value is {type(saved).__name__}, not a sequence",
                                         step=step)
        for i, (a, b) in enumerate(zip(live, saved)):
            check_against(a, b, key, step, path + (i,))
    elif isinstance(live, (bool, int, float, str, bytes)) and live is not None and saved is not None:
        num = (int, float)
        same = (isinstance(saved, num) and not isinstance(saved, bool)) if isinstance(live, num) and \
            not isinstance(live, bool) else isinstance(saved, type(live))
        if not same:
            raise CorruptCheckpointError(f"{where}: saved value is {type(saved).__name__}, the state holds "
                                         f"{type(live).__name__}", step=step)


def parts_needed(saved_world_size: int, world_size: int, rank: int) -> Optional[List[int]]:
    """The saved ranks whose parts ``rank`` pulls from a remote step: its own when the world size is unchanged
    (a node pulls only what its ranks read), else all (resharding may read any rank's shards)."""
    if world_size > 1 and saved_world_size == world_size:
        return [rank]
    return None


def restore_into(state: MutableMapping[str, Any], loader, *, strict: bool,
                 components: Optional[Iterable[str]] = None, rank_local: str = "error") -> None:
    """Apply the step ``loader`` (a :class:`~ckptstore.io.restore.StepLoader`) reads to ``state``.

    ``components``: only these top-level keys (each must be in both); else ``strict`` requires the top-level
    keys of ``state`` and the step to match, and ``strict=False`` loads the common ones (logged). Stateful
    values get ``load_state_dict`` first (they may still refuse: a shape mismatch), then plain entries are
    replaced, so a failed restore leaves plain entries as they were. DTensors in what a Stateful's
    ``state_dict()`` returns are filled in place (``loader.touched`` says whether any was).

    Raises ``IncompatibleCheckpointError`` (keys, or a Stateful's ``load_state_dict`` raised one: the step does
    not fit this run's configuration, and no older step would), ``CorruptCheckpointError`` (a damaged chunk, or
    a Stateful refused the values with another exception: resume then tries an older step)."""
    step = loader.commit.step
    saved_keys = loader.saved_keys()
    if components is not None:
        components = set(components)
        missing = (components - saved_keys) | (components - set(state))
        if missing:
            raise IncompatibleCheckpointError("load_components not found", step=step, missing=missing)
        wanted, unexpected = components, set()
    else:
        missing, unexpected = set(state) - saved_keys, saved_keys - set(state)
        if strict and (missing or unexpected):
            raise IncompatibleCheckpointError("state keys do not match the checkpoint (pass strict=False "
                                              "to load the common keys)", step=step, missing=missing,
                                              unexpected=unexpected)
        wanted = set(state) & saved_keys
    sharded = loader.sharded_keys()
    targets: Dict[str, Any] = {
        k: (state[k].state_dict() if is_stateful(state[k]) and (k in sharded or rank_local == "fresh")
            else state[k]) for k in wanted}
    with gc_paused():
        loaded = loader.load(wanted, targets, rank_local=rank_local)
    keys = [k for k in list(state) if k in loaded]
    for key in keys:
        if is_stateful(state[key]) and not (key in sharded or rank_local == "fresh"):
            check_against(state[key].state_dict(), loaded[key], key, step)
    for key in keys:
        if is_stateful(state[key]):
            try:
                state[key].load_state_dict(loaded[key])
            except IncompatibleCheckpointError:
                raise       # the Stateful says the checkpoint does not fit this run (an older step will not either)
            except Exception as e:
                # the values passed every check above and the Stateful still refused them: this step is not
                # usable for it (resume tries an older one), never an exception escaping resume
                raise CorruptCheckpointError(f"state[{key!r}].load_state_dict refused the saved values "
                                             f"({type(e).__name__}: {str(e)[:500]})", step=step) from e
    for key in keys:
        if not is_stateful(state[key]):
            state[key] = loaded[key]
    if components is None and not strict and (missing or unexpected):
        log.warning("resumed step %d partially: not in checkpoint %s, not in state %s", step, sorted(missing),
                    sorted(unexpected))
