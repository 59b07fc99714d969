"""Change detection: which tensors of a save can be proven unchanged since the last committed save.

By default nothing is: every tensor is viewed (or staged) and hashed at every save, and content addressing
keeps unchanged bytes from being written twice. That is correct whatever changed a tensor's memory. Hashing
costs ~0.1-0.2 s per GB here (BLAKE3, several threads); see benchmarks/README.md "Change detection".

``Store(track_versions=True)`` opts in to :class:`VersionCache`: a tensor whose storage, offset, shape, stride,
dtype, autograd version counter and optimizer-step count (below) equal those recorded at the last committed
save reuses that save's chunk references and is neither copied nor hashed. It pays for frozen layers in
fine-tuning. **What it cannot see** (the reason it is opt-in; measured on torch 2.13, issue 17):

* writes through ``tensor.data`` (EMA, weight averaging, hand-written optimizers), a numpy view
  (``t.numpy()[...] = x``), ``untyped_storage().copy_()``, DLPack, ctypes or any extension kernel that does not
  bump the version counter;
* DTensor local shards (FSDP2 updates them through views that do not share counters): never trusted, always
  hashed, whatever the option says.

Fused optimizers (``AdamW/Adam/SGD/Adagrad(fused=True)``, the default of HF Trainer and torchtitan) also update
parameters and their state without bumping version counters. They are covered: while any store tracks versions,
a global optimizer step post hook (``torch.optim.optimizer.register_optimizer_step_post_hook``) counts, per
storage, the steps that may have written it (every parameter of the optimizer with a gradient, and every tensor
in its state), and the count is part of the cache key. An optimizer that writes tensors other than those, or a
step that runs outside ``Optimizer.step`` (a CUDA graph replay), is not seen either.
"""
from __future__ import annotations

import threading
import weakref
from typing import Any, Dict, List, Optional, Tuple

import torch

from ..format.manifest import ChunkRef
from ..state.flatten import KeyPath

# -- optimizer steps ------------------------------------------------------------------------------------------
_steps_lock = threading.Lock()
_steps: "weakref.WeakKeyDictionary[Any, int]" = weakref.WeakKeyDictionary()   # storage -> optimizer steps
_hook = None                                  # the RemovableHandle of the global post hook, once registered


def _storage(t: torch.Tensor):
    try:
        return t.untyped_storage()
    except (RuntimeError, TypeError, NotImplementedError):   # inference tensors, exotic subclasses
        return None


def _after_optimizer_step(optimizer, args, kwargs) -> None:
    """Count one step against every storage ``optimizer.step()`` may have written without a version bump."""
    touched = []
    for group in optimizer.param_groups:
        for p in group["params"]:
            if p.grad is None:                 # every torch optimizer skips such parameters
                continue
            touched.append(p)
            for v in optimizer.state.get(p, {}).values():
                if isinstance(v, torch.Tensor):
                    touched.append(v)
    with _steps_lock:
        for t in touched:
            s = _storage(t)
            if s is not None:
                try:
                    _steps[s] = _steps.get(s, 0) + 1
                except TypeError:              # a storage that takes no weak reference: never trusted
                    pass


def watch_optimizer_steps() -> None:
    """Register the global optimizer step post hook (once per process; idempotent). :class:`VersionCache`
    calls it at its first lookup, before the first save records anything: a cache entry is only ever compared
    with keys taken while the hook was registered."""
    global _hook
    with _steps_lock:
        if _hook is None:
            from torch.optim.optimizer import register_optimizer_step_post_hook
            _hook = register_optimizer_step_post_hook(_after_optimizer_step)


def optimizer_steps(storage) -> int:
    """How many watched optimizer steps may have written ``storage`` (0 if none)."""
    with _steps_lock:
        try:
            return _steps.get(storage, 0)
        except TypeError:
            return -1


# -- the cache ------------------------------------------------------------------------------------------------
def _version_key(t: torch.Tensor):
    storage = _storage(t)
    if storage is None:
        return None
    try:
        version = t._version
        ref = weakref.ref(storage)
    except (RuntimeError, TypeError, NotImplementedError):
        return None
    return (ref, t.storage_offset(), tuple(t.shape), tuple(t.stride()), t.dtype, str(t.device), version,
            optimizer_steps(storage))


def _same(a, b) -> bool:
    if a is None or b is None:
        return False
    ref_a, *rest_a = a
    ref_b, *rest_b = b
    obj = ref_a()
    return obj is not None and obj is ref_b() and rest_a == rest_b and rest_b[-1] >= 0


class VersionCache:
    """key path -> (version key, chunk refs) of the last committed save. Thread-safe. Opt-in: see the module
    docstring for what it cannot see."""

    def __init__(self):
        self._entries: Dict[KeyPath, Tuple[Any, List[ChunkRef]]] = {}
        self._lock = threading.Lock()

    def lookup(self, spec, t: torch.Tensor, index) -> Optional[List[ChunkRef]]:
        """The chunk refs recorded for ``spec.path`` if ``t`` is unchanged by every measure above and
        ``index.has`` every ref (its blob or pack is still in the store), else ``None``. Sets
        ``spec.cache_key`` for :meth:`record`."""
        if _hook is None:
            watch_optimizer_steps()
        key = _version_key(t)
        spec.cache_key = key
        with self._lock:
            entry = self._entries.get(spec.path)
        if entry is None or not _same(entry[0], key):
            return None
        refs = entry[1]
        if any(not index.has(r) for r in refs):      # removed since (gc, quarantine)
            return None
        return refs

    def record(self, specs, refs: List[List[ChunkRef]]) -> None:
        with self._lock:
            self._entries = {s.path: (s.cache_key, r) for s, r in zip(specs, refs)
                             if s.kind == "tensor" and s.cache_key is not None}

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
