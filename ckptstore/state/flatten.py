"""Flatten a training state into key paths, and build it back.

A *state* is a mapping of top-level names to values. A value is either **Stateful** (has ``state_dict()`` and
``load_state_dict()``: ``nn.Module``, ``Optimizer``, LR schedulers, ``GradScaler``, samplers, user classes),
whose ``state_dict()`` is flattened under its name, or a tree of: ``torch.Tensor``, ``numpy.ndarray``, numpy
scalars, ``dict`` (str or int keys), ``list``, ``tuple``, ``int``, ``float``, ``bool``, ``str``, ``bytes``,
``None``, ``torch.dtype``.

``flatten`` yields :class:`Node` records in pre-order (a container before its children), each with its key
path (a tuple of str / int components). This is the only module that knows the Python types; the manifest
stores the nodes, the blob layer stores the tensors' bytes.
"""
from __future__ import annotations

import gc
import random
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Dict, Iterator, List, Mapping, Tuple

import numpy as np
import torch

from .sharding import is_dtensor, local_shard

KeyPath = Tuple[Any, ...]

# dtype names <-> torch dtypes: every dtype of this torch build that is not quantized.
_TORCH_DTYPE_NAMES = [
    "float64", "float32", "float16", "bfloat16", "complex128", "complex64", "complex32",
    "int64", "int32", "int16", "int8", "uint64", "uint32", "uint16", "uint8", "bool",
    "float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz", "float8_e8m0fnu",
    "float4_e2m1fn_x2",
]
TORCH_DTYPES: Dict[str, torch.dtype] = {n: getattr(torch, n) for n in _TORCH_DTYPE_NAMES if hasattr(torch, n)}
TORCH_DTYPE_NAMES: Dict[torch.dtype, str] = {v: k for k, v in TORCH_DTYPES.items()}


@contextmanager
def gc_paused() -> Iterator[None]:
    """Hold off Python's cyclic garbage collector for a short, allocation-heavy phase (a snapshot, decoding a
    manifest, building thousands of tensors): each young-generation pass walks every tracked object, and a
    state of 4000 small tensors triggers dozens of them, which measured as half of a load's time
    (benchmarks/bench_packs.py). Re-entrant; restores the previous setting; collects nothing itself."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def is_stateful(obj: Any) -> bool:
    """True for objects following the Stateful protocol (callable ``state_dict`` and ``load_state_dict``)."""
    return (not isinstance(obj, (torch.Tensor, np.ndarray, Mapping, list, tuple))
            and callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None)))


def path_str(path: KeyPath) -> str:
    """Human-readable key path: ``('optimizer', 'state', 0, 'exp_avg')`` -> ``'optimizer/state/0/exp_avg'``."""
    return "/".join(str(p) for p in path)


@dataclass
class Node:
    """One record of a flattened state.

    ``kind`` is one of ``dict``, ``list``, ``tuple`` (containers: ``value`` is the length for list/tuple),
    ``value`` (a plain msgpack-able value; a DTensor is a ``tensor`` node holding its local shard, with ``shard``
set), ``bigint`` (an int beyond 64 bits, kept as a decimal string),
    ``dtype`` (a ``torch.dtype``, kept by name), ``tensor`` / ``ndarray`` / ``npscalar`` (``value`` is the
    array itself; its bytes go to blobs).
    """
    path: KeyPath
    kind: str
    value: Any = None
    shard: Any = None         # a DTensor's ShardInfo (``value`` is then its local tensor); see ckptstore.state.sharding


def _check_key(path: KeyPath, key: Any) -> None:
    if isinstance(key, bool) or not isinstance(key, (str, int)):
        raise TypeError(f"unsupported dict key {key!r} ({type(key).__name__}) at {path_str(path) or '<root>'}: "
                        "only str and int keys are supported")


def flatten(state: Mapping[str, Any]) -> Tuple[List[Node], List[str]]:
    """Flatten ``state`` into pre-order nodes. Returns ``(nodes, stateful_keys)``.

    Raises ``TypeError`` naming the key path of the first unsupported value, before anything is written.
    """
    if not isinstance(state, Mapping):
        raise TypeError(f"state must be a mapping of names to values, got {type(state).__name__}")
    nodes: List[Node] = [Node((), "dict")]
    stateful: List[str] = []
    for key, value in state.items():
        if not isinstance(key, str):
            raise TypeError(f"top-level state keys must be str, got {key!r}")
        if is_stateful(value):
            stateful.append(key)
            sd = value.state_dict()
            if not isinstance(sd, Mapping):
                raise TypeError(f"{key}.state_dict() returned {type(sd).__name__}, expected a mapping")
            value = sd
        _flatten_value((key,), value, nodes, set())
    return nodes, stateful


def _flatten_value(path: KeyPath, value: Any, out: List[Node], seen: set) -> None:
    if is_dtensor(value):
        try:
            local, info = local_shard(value)
        except TypeError as e:
            raise TypeError(f"{e} (at {path_str(path)})") from None
        _check_tensor(path, local)
        out.append(Node(path, "tensor", local, shard=info))
    elif isinstance(value, torch.Tensor):
        _check_tensor(path, value)
        out.append(Node(path, "tensor", value))
    elif isinstance(value, np.ndarray):
        if value.dtype.hasobject or value.dtype.kind not in "biufcmMSUV" or value.dtype.fields is not None:
            raise TypeError(f"unsupported numpy dtype {value.dtype} at {path_str(path)}")
        out.append(Node(path, "ndarray", value))
    elif isinstance(value, np.generic):
        if isinstance(value, np.object_) or value.dtype.hasobject:
            raise TypeError(f"unsupported numpy scalar {type(value).__name__} at {path_str(path)}")
        out.append(Node(path, "npscalar", np.asarray(value)))
    elif value is None or isinstance(value, (bool, float, str, bytes)):
        out.append(Node(path, "value", value))
    elif isinstance(value, int):
        out.append(Node(path, "value", value) if -(1 << 63) <= value < (1 << 64)
                   else Node(path, "bigint", str(value)))
    elif isinstance(value, torch.dtype):
        if value not in TORCH_DTYPE_NAMES:
            raise TypeError(f"unsupported torch dtype {value} at {path_str(path)}")
        out.append(Node(path, "dtype", TORCH_DTYPE_NAMES[value]))
    elif isinstance(value, (Mapping, list, tuple)):
        if id(value) in seen:
            raise TypeError(f"reference cycle at {path_str(path)}")
        seen.add(id(value))
        if isinstance(value, Mapping):
            out.append(Node(path, "dict"))
            for k, v in value.items():
                _check_key(path, k)
                _flatten_value(path + (k,), v, out, seen)
        else:
            out.append(Node(path, "list" if isinstance(value, list) else "tuple", len(value)))
            for i, v in enumerate(value):
                _flatten_value(path + (i,), v, out, seen)
        seen.discard(id(value))
    else:
        raise TypeError(f"unsupported value of type {type(value).__module__}.{type(value).__qualname__} at "
                        f"{path_str(path)}: supported are tensors, numpy arrays, dict/list/tuple, int, float, "
                        "bool, str, bytes, None, and Stateful objects at the top level")


def _check_tensor(path: KeyPath, t: torch.Tensor) -> None:
    if t.layout != torch.strided:
        raise TypeError(f"unsupported tensor layout {t.layout} at {path_str(path)}: only dense tensors")
    if t.dtype not in TORCH_DTYPE_NAMES:
        raise TypeError(f"unsupported tensor dtype {t.dtype} at {path_str(path)}")
    if t.device.type == "meta" or t.is_nested or getattr(t, "is_quantized", False):
        raise TypeError(f"unsupported tensor at {path_str(path)} (meta, nested or quantized)")
    if type(t) not in (torch.Tensor, torch.nn.Parameter):
        # subclasses other than DTensor (handled above) may carry meaning their bytes do not: refuse rather
        # than save them silently as plain tensors.
        raise TypeError(f"unsupported tensor subclass {type(t).__name__} at {path_str(path)}")


def unflatten(nodes: List[Node]) -> Dict[str, Any]:
    """Inverse of :func:`flatten` (nodes whose ``value`` holds the loaded objects). Returns the root dict."""
    if not nodes or nodes[0].path != () or nodes[0].kind != "dict":
        raise ValueError("flattened state must start with the root dict")
    root: Dict[str, Any] = {}
    containers: Dict[KeyPath, Any] = {(): root}
    tuples: List[KeyPath] = []
    for node in nodes[1:]:
        parent_path, key = node.path[:-1], node.path[-1]
        parent = containers.get(parent_path)
        if parent is None:
            raise ValueError(f"node {path_str(node.path)} has no parent container")
        if node.kind == "dict":
            value: Any = {}
        elif node.kind in ("list", "tuple"):
            value = [None] * int(node.value)
            if node.kind == "tuple":
                tuples.append(node.path)
        else:
            value = node.value
        if node.kind in ("dict", "list", "tuple"):
            containers[node.path] = value
        if isinstance(parent, dict):
            parent[key] = value
        else:
            if not isinstance(key, int) or not 0 <= key < len(parent):
                raise ValueError(f"index {key!r} out of range at {path_str(node.path)}")
            parent[key] = value
    # tuples are built as lists, then frozen deepest-first so nested tuples are frozen before their parents
    for tpath in sorted(tuples, key=len, reverse=True):
        parent = containers[tpath[:-1]]
        frozen = tuple(containers[tpath])
        parent[tpath[-1]] = frozen
        containers[tpath] = frozen
    return root


class RNGState:
    """Stateful over every global random generator a training step draws from.

    ``state_dict()`` captures Python ``random``, NumPy's global ``RandomState``, torch's CPU generator and,
    when CUDA is available, the **current** CUDA device's generator only (so a checkpoint written on an
    8-GPU node loads on a 1-GPU one; each rank saves its own device's state in its own manifest).
    ``load_state_dict()`` restores them; a saved CUDA state is skipped with a warning when CUDA is absent.
    """

    def state_dict(self) -> Dict[str, Any]:
        sd: Dict[str, Any] = {
            "python": random.getstate(),
            "numpy": np.random.get_state(legacy=False),
            "torch": torch.get_rng_state(),
        }
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            sd["cuda"] = torch.cuda.get_rng_state()
        return sd

    def load_state_dict(self, sd: Mapping[str, Any]) -> None:
        version, internal, gauss = sd["python"]
        random.setstate((version, tuple(internal), gauss))
        np.random.set_state(sd["numpy"])
        torch.set_rng_state(sd["torch"].cpu())
        if "cuda" in sd:
            if torch.cuda.is_available():
                torch.cuda.set_rng_state(sd["cuda"].cpu())
            else:
                import logging
                logging.getLogger("ckptstore").warning("checkpoint holds a CUDA RNG state but CUDA is not "
                                                       "available here: it is not restored")
