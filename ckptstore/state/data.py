"""An elastic, Stateful data sampler: its saved state is one job-wide value, so a run saved at data-parallel
size W resumes at any W' mid-epoch and consumes every remaining sample of the epoch exactly once.

The job's data order is a **global order** of the epoch: ``torch.randperm(len, generator=seed + epoch)`` (the
same permutation as ``torch.utils.data.DistributedSampler``'s global one) or ``0 .. len-1`` without
shuffling; every rank computes it alone, nothing is communicated. A **cursor** ``consumed`` counts the
positions of that order which the whole job (all ranks together) has trained on. Each *step* takes the next
``world_size * batch_size`` positions: rank ``r`` trains on the ``r``-th block of ``batch_size`` of them. Since
every rank advances the cursor by the same amount at each step, the cursor and so the whole state (see
:meth:`ElasticSampler.state_dict`) is equal on every rank: ckptstore saves it as a value any world size loads
(``Store.resume`` refuses values that differ between ranks when the world size changes). A run resumed with
another world size or batch size simply starts its steps at the cursor.

**Why the training loop advances the cursor** (:meth:`ElasticSampler.advance`), not the sampler itself: a
``DataLoader`` iterates its sampler *ahead* of training (``prefetch_factor * num_workers`` batches with
worker processes, and the sampler's ``__iter__`` runs in the main process in both cases), so the indices a
sampler has handed out are not the samples that were trained on. Counting them would make a checkpoint skip
the prefetched batches on resume (samples lost). Only the loop knows a batch was trained on.

See ``docs/elastic-data.md`` for the protocol and its use with ``Store.save`` / ``Store.resume``.
"""
from __future__ import annotations

import hashlib
import logging
import os
from typing import Any, Dict, Iterator, Mapping, Optional, Sized, Tuple, Union

import torch
from torch.utils.data import Sampler

from ..util.errors import IncompatibleCheckpointError

log = logging.getLogger("ckptstore")

STATE_VERSION = 1
_STATE_KEYS = ("version", "epoch", "consumed", "len", "seed", "shuffle", "order", "world_size", "batch_size")


def _int(name: str, value: Any, lo: int = 0) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__} ({value!r})")
    if value < lo:
        raise ValueError(f"{name} must be >= {lo}, got {value}")
    return value


def _below_2_62(name: str, value: Any) -> int:
    """Seeds and epochs: ints in ``[0, 2**62)``, so ``seed + epoch`` is a valid generator seed."""
    v = _int(name, value)
    if v >= 1 << 62:
        raise ValueError(f"{name} must be < 2**62, got {v}")
    return v


def _topology(rank: Optional[int], world_size: Optional[int]) -> Tuple[int, int]:
    """``(rank, world_size)``: the given ones, else torch.distributed's when it is initialised, else (0, 1)."""
    if rank is None or world_size is None:
        import torch.distributed as dist
        if dist.is_available() and dist.is_initialized():
            rank = dist.get_rank() if rank is None else rank
            world_size = dist.get_world_size() if world_size is None else world_size
        else:
            env_world = os.environ.get("WORLD_SIZE", "1")
            if world_size is None and env_world.isdigit() and int(env_world) > 1:
                raise ValueError(f"WORLD_SIZE={env_world} but torch.distributed is not initialised: call "
                                 "init_process_group() before creating the ElasticSampler, or pass rank= and "
                                 "world_size=")
            rank = 0 if rank is None else rank
            world_size = 1 if world_size is None else world_size
    world_size = _int("world_size", world_size, 1)
    rank = _int("rank", rank, 0)
    if rank >= world_size:
        raise ValueError(f"rank must be < world_size, got rank={rank}, world_size={world_size}")
    return rank, world_size


class SamplerMismatchError(IncompatibleCheckpointError, ValueError):
    """A saved :class:`ElasticSampler` state was drawn for another dataset length, seed, shuffle setting or torch
    permutation than this sampler's: resuming it would lose and repeat samples. A ``ValueError`` and an
    ``IncompatibleCheckpointError``, so ``Store.resume`` raises it on every rank instead of trying older steps
    (which hold the same configuration) or starting fresh."""


class ElasticSampler(Sampler[int]):
    """A sampler for one data-parallel rank whose checkpoint state is job-wide (equal on every rank).

    Args:
        data: the dataset (anything with ``len()``) or its length, an int >= 0 (samples).
        rank, world_size: this rank and the number of data-parallel ranks; default: torch.distributed's when it
            is initialised, else 0 and 1 (``ValueError`` when ``WORLD_SIZE`` > 1 says a job is not initialised).
            Under FSDP+TP / pipeline meshes pass the *data-parallel* rank and size.
        batch_size: samples per rank per step (the ``DataLoader``'s ``batch_size``), >= 1.
        shuffle: a new permutation each epoch (``seed + epoch``) when True, ``0 .. len-1`` when False.
        seed: int in ``[0, 2**62)``, the permutation's base seed; equal on every rank.
        drop_last: what happens at the epoch's tail, when fewer than ``world_size * batch_size`` samples
            remain. False (default): they are split as evenly as possible (rank ``r`` gets ``R // world_size``
            samples, one more when ``r < R % world_size``); nothing is padded or repeated, so when ``R <
            world_size`` the last ranks get none and run one step fewer (under DDP wrap each epoch's loop in
            ``torch.distributed.algorithms.Join``). True: they are skipped in this epoch, and every rank runs
            the same number of steps of exactly ``batch_size``.

    Use it as ``DataLoader(dataset, batch_size=batch_size, sampler=sampler, drop_last=False)`` (the loader's
    own ``drop_last`` must stay False: the sampler decides the tail). The protocol, on every rank:

    * ``sampler.set_epoch(e)`` before each epoch (a no-op for the epoch a checkpoint was resumed in, so the
      resumed epoch continues at its cursor); ``for e in range(sampler.epoch, epochs)`` resumes correctly.
    * ``sampler.advance()`` once after each batch drawn from the loader has been trained on (each micro-batch
      under gradient accumulation), before a save that should count it.
    * ``sampler.finish_epoch()`` after the loop over the loader ends, when the job may save before the next
      ``set_epoch`` (a rank that got no sample in the tail did not advance past it).

    Iteration yields int indices into the dataset: this rank's share of the epoch from the cursor the iteration
    started at. ``len(sampler)`` is that count. The permutation is held as one int64 tensor (8 bytes per sample).
    """

    def __init__(self, data: Union[int, Sized], *, batch_size: int, rank: Optional[int] = None,
                 world_size: Optional[int] = None, shuffle: bool = True, seed: int = 0, drop_last: bool = False):
        n = data if isinstance(data, int) and not isinstance(data, bool) else None
        if n is None:
            if not hasattr(data, "__len__"):
                raise TypeError(f"data must be a dataset with len() or an int length, got {type(data).__name__}")
            n = len(data)
        self.len = _int("dataset length", n, 0)
        self.batch_size = _int("batch_size", batch_size, 1)
        self.rank, self.world_size = _topology(rank, world_size)
        if not isinstance(shuffle, bool):
            raise TypeError(f"shuffle must be a bool, got {type(shuffle).__name__}")
        if not isinstance(drop_last, bool):
            raise TypeError(f"drop_last must be a bool, got {type(drop_last).__name__}")
        self.seed = _below_2_62("seed", seed)
        self.shuffle, self.drop_last = shuffle, drop_last
        self.epoch = 0
        self.consumed = 0
        self._order: Optional[Tuple[int, torch.Tensor, str]] = None     # (epoch, permutation, digest)

    # -- the global order ---------------------------------------------------------------------------------
    def _perm(self, epoch: int) -> Tuple[torch.Tensor, str]:
        if self._order is None or self._order[0] != epoch:
            if self.shuffle:
                g = torch.Generator()
                g.manual_seed(self.seed + epoch)
                perm = torch.randperm(self.len, generator=g)
            else:
                perm = torch.arange(self.len, dtype=torch.int64)
            digest = hashlib.blake2b(perm.numpy().tobytes(), digest_size=8).hexdigest()
            self._order = (epoch, perm, digest)
        return self._order[1], self._order[2]

    def order(self, epoch: Optional[int] = None) -> torch.Tensor:
        """The job's global order of ``epoch`` (default: the current one): an int64 tensor of shape ``(len,)``
        holding each dataset index once. Do not modify it."""
        return self._perm(self.epoch if epoch is None else _below_2_62("epoch", epoch))[0]

    # -- arithmetic of one step ---------------------------------------------------------------------------
    @property
    def global_batch(self) -> int:
        """Samples the whole job takes per full step: ``world_size * batch_size``."""
        return self.world_size * self.batch_size

    def _step_span(self, pos: int) -> int:
        """Positions the step starting at ``pos`` takes job-wide (0: the epoch is over for this sampler)."""
        left = self.len - pos
        if left >= self.global_batch:
            return self.global_batch
        return 0 if self.drop_last else max(left, 0)

    def _share(self, pos: int, span: int, rank: Optional[int] = None) -> Tuple[int, int]:
        """Rank ``rank``'s (default: this one's) part of the step covering positions ``[pos, pos + span)`` of
        the global order, as ``(first position, count)``: the ``rank``-th block of ``batch_size`` for a full
        step, an as-even-as-possible split for a shorter (tail) step."""
        r = self.rank if rank is None else rank
        if span == self.global_batch:
            return pos + r * self.batch_size, self.batch_size
        q, extra = divmod(span, self.world_size)
        return pos + r * q + min(r, extra), q + (1 if r < extra else 0)

    @property
    def steps_left(self) -> int:
        """Steps the job has left in the current epoch from the cursor (equal on every rank)."""
        full, tail = divmod(self.len - self.consumed, self.global_batch)
        return full + (1 if tail and not self.drop_last else 0)

    def __len__(self) -> int:
        n, pos = 0, self.consumed
        while True:
            span = self._step_span(pos)
            if not span:
                return n
            if span == self.global_batch:           # the full steps at once
                k = (self.len - pos) // self.global_batch
                n += k * self.batch_size
                pos += k * self.global_batch
            else:
                n += self._share(pos, span)[1]
                pos += span

    def __iter__(self) -> Iterator[int]:
        perm, _ = self._perm(self.epoch)
        pos = self.consumed
        while True:
            span = self._step_span(pos)
            if not span:
                return
            first, count = self._share(pos, span)
            if count:
                yield from perm[first:first + count].tolist()
            pos += span

    # -- the cursor ---------------------------------------------------------------------------------------
    def advance(self, steps: int = 1) -> int:
        """Count ``steps`` more steps (each: one batch per rank, ``world_size * batch_size`` samples job-wide,
        fewer for the tail) as trained on by the whole job. Call it on every rank after each batch it drew
        from the loader was trained on. Returns the cursor (samples of the epoch consumed job-wide).
        Raises ``ValueError`` when the epoch has fewer steps left (a double call, or a missing ``set_epoch``)."""
        steps = _int("steps", steps, 0)
        pos = self.consumed
        for i in range(steps):
            span = self._step_span(pos)
            if not span:
                raise ValueError(f"advance({steps}): epoch {self.epoch} has only {i} step(s) left at cursor "
                                 f"{self.consumed} of {self.len} (world_size={self.world_size}, batch_size="
                                 f"{self.batch_size}, drop_last={self.drop_last}); call set_epoch() for the next")
            pos += span
        self.consumed = pos
        return pos

    def finish_epoch(self) -> None:
        """Mark the rest of the current epoch consumed (the cursor moves past its last step). Call it on every
        rank once its loop over the loader has ended, when the job may save before the next ``set_epoch``:
        a rank that had no sample in the tail step did not ``advance`` past it."""
        self.consumed = self.len - (self.len - self.consumed) % self.global_batch if self.drop_last else self.len

    def set_epoch(self, epoch: int) -> None:
        """Start ``epoch`` (an int >= 0) at cursor 0; a no-op when ``epoch`` is the current one (so a resumed
        run continues its epoch where the checkpoint left it)."""
        epoch = _below_2_62("epoch", epoch)
        if epoch != self.epoch:
            self.epoch, self.consumed = epoch, 0

    # -- Stateful -----------------------------------------------------------------------------------------
    def state_dict(self) -> Dict[str, Any]:
        """The job-wide state, equal on every rank: ``{"version": 1, "epoch": int, "consumed": int (samples of
        the epoch's global order trained on by all ranks together), "len": int (dataset length), "seed": int,
        "shuffle": bool, "order": str (a 64-bit digest of the epoch's permutation, hex), "world_size": int,
        "batch_size": int}`` (the last two record who saved it; any world size and batch size may load it)."""
        _, digest = self._perm(self.epoch)
        return {"version": STATE_VERSION, "epoch": self.epoch, "consumed": self.consumed, "len": self.len,
                "seed": self.seed, "shuffle": self.shuffle, "order": digest, "world_size": self.world_size,
                "batch_size": self.batch_size}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue from a saved :meth:`state_dict`, whatever world size and batch size saved it. Checked
        before anything changes: ``TypeError`` for a non-mapping or a wrongly typed field, ``ValueError``
        naming the field for a missing / unknown field or a cursor out of ``[0, len]`` (``Store.resume`` then
        tries an older step), :class:`SamplerMismatchError` (a ``ValueError``) naming the field for a dataset
        length, seed or shuffle setting other than this sampler's, or a permutation digest this torch build does
        not reproduce (each would change the order: samples lost or repeated; ``Store.resume`` raises it)."""
        try:
            epoch, consumed = self._checked(state)
        except (TypeError, ValueError) as e:
            raise type(e)(f"ElasticSampler state: {e}") from None
        self.epoch, self.consumed = epoch, consumed

    def _checked(self, state: Any) -> Tuple[int, int]:
        """``(epoch, consumed)`` of a saved state, after every check of :meth:`load_state_dict`."""
        if not isinstance(state, Mapping):
            raise TypeError(f"must be a mapping, got {type(state).__name__}")
        missing = [k for k in _STATE_KEYS if k not in state]
        unknown = sorted(str(k) for k in state if k not in _STATE_KEYS)
        if missing or unknown:
            raise ValueError(f"missing fields {missing}, unknown fields {unknown}")
        if _int("version", state["version"], 1) != STATE_VERSION:
            raise ValueError(f"version {state['version']} is not supported (this library "
                             f"reads version {STATE_VERSION})")
        epoch = _below_2_62("epoch", state["epoch"])
        consumed = _int("consumed", state["consumed"])
        n = _int("len", state["len"])
        seed = _below_2_62("seed", state["seed"])
        _int("world_size", state["world_size"], 1)
        _int("batch_size", state["batch_size"], 1)
        if not isinstance(state["shuffle"], bool):
            raise TypeError(f"shuffle must be a bool, got {type(state['shuffle']).__name__}")
        if not isinstance(state["order"], str):
            raise TypeError(f"order must be a str, got {type(state['order']).__name__}")
        if n != self.len:
            raise SamplerMismatchError(f"len: the checkpoint's dataset has {n} samples, this sampler's "
                                       f"{self.len}")
        if consumed > n:
            raise ValueError(f"consumed: cursor {consumed} is past the dataset's {n} samples")
        if seed != self.seed:
            raise SamplerMismatchError(f"seed: the checkpoint's order was drawn with seed {seed}, this "
                                       f"sampler's is {self.seed}")
        if state["shuffle"] != self.shuffle:
            raise SamplerMismatchError(f"shuffle: the checkpoint was saved with shuffle={state['shuffle']}, "
                                       f"this sampler has shuffle={self.shuffle}")
        _, digest = self._perm(epoch)
        if digest != state["order"]:
            raise SamplerMismatchError(f"order: the permutation of epoch {epoch} (seed {seed}, {n} samples) "
                                       f"differs from the saved one (digest {digest} != {state['order']}): this "
                                       "torch build draws another order, so resuming would lose and repeat samples")
        if (state["world_size"], state["batch_size"]) != (self.world_size, self.batch_size):
            log.info("ElasticSampler: resuming epoch %d at sample %d of %d, saved by world_size=%d batch_size=%d, "
                     "now world_size=%d batch_size=%d", epoch, consumed, n, state["world_size"],
                     state["batch_size"], self.world_size, self.batch_size)
        return epoch, consumed
