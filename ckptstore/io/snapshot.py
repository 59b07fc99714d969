"""Snapshot: from the arrays of a flattened state to stable byte views the write path can hash and write.

Three ways in, one way out (:class:`ArraySpec` with ``view`` or ``known`` set):

* **unchanged** (opt-in, :class:`~ckptstore.io.changes.VersionCache`): a tensor proven unchanged since the last
  committed save reuses that save's chunk references and is neither copied nor hashed (``spec.known``). The
  storage is held by weak reference, and PyTorch keeps one Python object per storage for its lifetime, so a
  freed-and-reallocated buffer never matches. See :mod:`ckptstore.io.changes` for what it cannot see.
* **blocking save** (:func:`direct_view`): a contiguous CPU tensor is used in place (the caller is blocked, so
  nothing changes it); anything else is materialised once into a temporary contiguous CPU copy (a CUDA tensor
  of >= 4 MiB through two reused pinned buffers of 64 MiB, :func:`tensor_cpu_contiguous`).
* **non-blocking save** (:class:`StagingPool`): every changed array is copied into page-aligned host memory
  allocated once and reused by later saves (pinned when the source is on CUDA, copied with ``non_blocking``
  on a side stream that the training stream then waits on, so the caller is not blocked by the transfer).
  The pool holds at most one copy of the state's arrays.
"""
from __future__ import annotations

import threading
import weakref
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Set, Tuple

import numpy as np
import torch

from ..format.manifest import ChunkRef
from ..state.flatten import TORCH_DTYPE_NAMES, KeyPath, Node

PAGE = 4096


@dataclass
class ArraySpec:
    """One tensor / array of a save, with the metadata captured at snapshot time."""
    path: KeyPath
    kind: str                               # tensor | ndarray | npscalar
    dtype: str
    shape: Tuple[int, ...]
    nbytes: int
    device: str = "cpu"
    requires_grad: bool = False
    view: Optional[memoryview] = None       # bytes to write (None when ``known``)
    known: Optional[List[ChunkRef]] = None  # chunk refs proven unchanged since the last save
    cache_key: Any = None                   # to record in the VersionCache after commit
    ready: Optional[Any] = None             # a CUDA event to wait on before reading ``view``


def spec_of(node: Node) -> ArraySpec:
    v = node.value
    if node.kind == "tensor":
        return ArraySpec(node.path, "tensor", TORCH_DTYPE_NAMES[v.dtype], tuple(v.shape),
                         v.numel() * v.element_size(), str(v.device), bool(v.requires_grad))
    return ArraySpec(node.path, node.kind, v.dtype.str, tuple(v.shape), int(v.nbytes))


# -- blocking saves -------------------------------------------------------------------------------------------
def tensor_cpu_contiguous(t: torch.Tensor) -> torch.Tensor:
    t = t.detach()
    if t.is_conj():
        t = t.resolve_conj()
    if t.is_neg():
        t = t.resolve_neg()
    if t.device.type == "cuda" and t.numel() * t.element_size() >= BOUNCE_MIN:
        return _cuda_to_host(t.contiguous())
    if t.device.type != "cpu":
        t = t.to("cpu")
    return t.contiguous()


# A blocking save copies a CUDA tensor to the host through two pinned buffers of BOUNCE_PIECE bytes (per device,
# made at the first such copy, kept by the process) into a new pageable tensor, instead of ``t.to("cpu")``: a
# pageable device-to-host copy runs at the host's pageable rate (measured on an H100 VM, benchmarks/README.md
# "gpu_check.py": 16 GiB in 14.8 s, 1.1 GB/s, against 0.33 s into pinned memory). Copies of one piece overlap
# the host copy of the other; every copy is waited for before the tensor is returned, so the bytes are those of
# the moment of the call, in the caller's stream order.
BOUNCE_PIECE = 64 << 20
BOUNCE_MIN = 4 << 20
_bounce: Dict[int, Tuple[List[torch.Tensor], Any]] = {}
_bounce_lock = threading.Lock()


def _cuda_to_host(t: torch.Tensor) -> torch.Tensor:
    out = torch.empty(t.shape, dtype=t.dtype)
    src, dst = t.reshape(-1).view(torch.uint8), out.reshape(-1).view(torch.uint8)
    n = src.numel()
    with _bounce_lock, torch.cuda.device(t.device):
        if t.device.index not in _bounce:
            _bounce[t.device.index] = ([torch.empty(BOUNCE_PIECE, dtype=torch.uint8, pin_memory=True)
                                        for _ in range(2)], torch.cuda.Stream())
        bufs, side = _bounce[t.device.index]
        side.wait_stream(torch.cuda.current_stream())
        pending: List[Optional[Tuple[Any, int, int]]] = [None, None]

        def drain(k: int) -> None:
            if pending[k] is not None:
                event, off, size = pending[k]
                event.synchronize()
                dst[off: off + size].copy_(bufs[k][:size])
                pending[k] = None
        for i, off in enumerate(range(0, n, BOUNCE_PIECE)):
            k, size = i % 2, min(BOUNCE_PIECE, n - off)
            drain(k)
            with torch.cuda.stream(side):
                bufs[k][:size].copy_(src[off: off + size], non_blocking=True)
                event = torch.cuda.Event()
                event.record(side)
            pending[k] = (event, off, size)
        drain(0)
        drain(1)
    return out


# dtypes numpy has: their tensors' numpy views are taken directly (two torch calls fewer per tensor: 23 -> 17.5 ms
# for 4000 small tensors, measured); others (bfloat16, float8) are viewed as uint8 first
_NUMPY_DTYPES = frozenset({torch.float64, torch.float32, torch.float16, torch.complex128, torch.complex64,
                           torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool})


def byte_view(value) -> memoryview:
    """A flat byte view of a contiguous CPU tensor or numpy array (no copy)."""
    if isinstance(value, torch.Tensor):
        if value.numel() == 0:
            return memoryview(b"")
        if value.dtype in _NUMPY_DTYPES and value.is_contiguous():
            return memoryview(value.numpy()).cast("B")
        return memoryview(value.reshape(-1).view(torch.uint8).numpy()).cast("B")
    arr = np.ascontiguousarray(value)
    if arr.size == 0:
        return memoryview(b"")
    return memoryview(arr.reshape(-1).view(np.uint8)).cast("B")


def direct_view(node: Node) -> memoryview:
    return byte_view(tensor_cpu_contiguous(node.value) if node.kind == "tensor" else node.value)


# -- non-blocking saves ---------------------------------------------------------------------------------------
def _aligned_empty(nbytes: int, pin: bool) -> torch.Tensor:
    """A uint8 tensor of ``nbytes`` (rounded up to a page) whose first byte is page-aligned; ``pin``: page-locked
    for asynchronous device-to-host copies (:func:`_registered_empty`, else torch's ``pin_memory=True``)."""
    size = -(-max(nbytes, 1) // PAGE) * PAGE
    if pin:
        registered = _registered_empty(size)
        if registered is not None:
            return registered
        return torch.empty(size, dtype=torch.uint8, pin_memory=True)       # cudaHostAlloc: page-aligned
    raw = torch.empty(size + PAGE, dtype=torch.uint8)
    off = (-raw.data_ptr()) % PAGE
    return raw[off: off + size]


def _registered_empty(size: int) -> Optional[torch.Tensor]:
    """``size`` bytes (a multiple of the page) of ordinary host memory page-locked with ``cudaHostRegister``, or
    ``None`` when CUDA refuses. The first non-blocking save of a CUDA state allocates its whole staging pool:
    ``cudaHostAlloc`` (torch's ``pin_memory=True``) took 0.45-0.55 s per GiB on an H100 VM, touching and
    registering ordinary memory 0.17 s (benchmarks/README.md, "gpu_check.py"), and torch's pinned allocator
    rounds each block up to a power of two (up to twice the host memory). The memory is a NumPy array's; it is
    unregistered when that array is freed (a weakref callback runs before NumPy frees the bytes), which happens
    once no tensor or view of it is left."""
    try:
        cudart = torch.cuda.cudart()
        arr = np.empty(size + PAGE, dtype=np.uint8)
        off = (-arr.ctypes.data) % PAGE
        view = arr[off: off + size]
        out = torch.from_numpy(view)
        out.fill_(0)                                   # fault the pages in (torch's threads) before pinning
        ptr = view.ctypes.data
        if int(cudart.cudaHostRegister(ptr, size, 0)) != 0:
            return None
    except Exception:                                  # an older torch without cudart bindings: the allocator's
        return None
    weakref.finalize(arr, cudart.cudaHostUnregister, ptr).atexit = False    # at exit the process unpins all
    return out


class StagingPool:
    """Host buffers for non-blocking saves, one per key path, allocated once and reused while sizes match.

    ``bytes_held`` is at most the arrays' total size (rounded up to pages): one extra copy of the state.
    """

    def __init__(self):
        self._buffers: Dict[KeyPath, torch.Tensor] = {}
        self._pinned: Set[KeyPath] = set()        # paths whose buffer is page-locked
        self._stream = None

    @property
    def bytes_held(self) -> int:
        return sum(b.numel() for b in self._buffers.values())

    def _buffer(self, path: KeyPath, nbytes: int, pin: bool) -> torch.Tensor:
        buf = self._buffers.get(path)
        if (buf is None or buf.numel() < nbytes or buf.numel() > 2 * nbytes + PAGE
                or (pin and path not in self._pinned)):
            self._buffers.pop(path, None)          # free before allocating: never hold two copies
            self._pinned.discard(path)
            buf = self._buffers[path] = _aligned_empty(nbytes, pin)
            if pin:
                self._pinned.add(path)
        return buf

    def stage(self, pairs: List[Tuple[ArraySpec, Node]], live_paths) -> None:
        """Copy each array into its staging buffer and set ``spec.view`` (and ``spec.ready`` for CUDA).

        Buffers of ``live_paths`` not staged this time (unchanged tensors) are kept for the next save; those of
        paths no longer in the state are freed."""
        live = set(live_paths)
        for path in [p for p in self._buffers if p not in live]:
            del self._buffers[path]
            self._pinned.discard(path)
        cuda_pairs = []
        for spec, node in pairs:
            if spec.nbytes == 0:
                spec.view = memoryview(b"")
                continue
            v = node.value
            on_cuda = isinstance(v, torch.Tensor) and v.device.type == "cuda"
            buf = self._buffer(spec.path, spec.nbytes, pin=on_cuda)[: spec.nbytes]
            if on_cuda:
                cuda_pairs.append((spec, v, buf))
                continue
            if isinstance(v, torch.Tensor):
                src = v.detach()
                if src.device.type != "cpu":
                    src = src.to("cpu")
                buf.view(src.dtype).view(src.shape).copy_(src)
            else:
                np.copyto(buf.numpy().view(v.dtype).reshape(v.shape), v, casting="no")
            spec.view = memoryview(buf.numpy()).cast("B")
        if cuda_pairs:
            self._stage_cuda(cuda_pairs)

    def _stage_cuda(self, triples) -> None:
        # Copies run on a side stream that first waits for the work already queued on the current stream (so
        # the values are those of this moment); the current stream then waits for the copies, so training
        # kernels queued after save() returns cannot overwrite a tensor before it is copied. The host is not
        # blocked; the writer thread waits on the event before it reads the buffers.
        current = torch.cuda.current_stream()
        if self._stream is None:
            self._stream = torch.cuda.Stream()
        side = self._stream
        side.wait_stream(current)
        with torch.cuda.stream(side):
            for spec, t, buf in triples:
                src = t.detach()
                buf.view(src.dtype).view(src.shape).copy_(src, non_blocking=True)
                src.record_stream(side)
            event = torch.cuda.Event()
            event.record(side)
        current.wait_stream(side)
        for spec, _, buf in triples:
            spec.view = memoryview(buf.numpy()).cast("B")
            spec.ready = event

    def clear(self) -> None:
        self._buffers.clear()
        self._pinned.clear()
