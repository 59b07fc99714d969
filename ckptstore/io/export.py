"""Export the weights of a committed step as one ``.safetensors`` or ``torch.save`` (``.pt``) file.

    from ckptstore.io.export import export_step
    report = export_step(store, "model.safetensors", step=None, key="model")

The tensors under ``key`` (a top-level key, or a nested one as ``model/encoder``; ``""``: the whole step)
are written with their names joined by ``"."`` (``layers.0.weight``), as full tensors: values saved from
DTensors are consolidated from every rank's shards (the same reader as ``Store.load``), so the file loads in
``transformers`` / inference servers whatever mesh wrote the step. Only the chunks of ``key`` are read.
Non-tensor leaves (plain values, numpy arrays) are skipped and listed in the report.

The file is written to a temporary name next to ``out``, read back and compared tensor by tensor (dtype,
shape, bytes), and only then renamed to ``out``: a failed or interrupted export leaves no file at ``out``.
"""
from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

import torch

from ..format.blobs import BlobStore
from ..storage.local import atomic_file
from ..util.errors import CheckpointError
from .reader import read_nodes
from .restore import StepLoader
from ..state.flatten import path_str

FORMATS = {".safetensors": "safetensors", ".pt": "torch", ".pth": "torch", ".bin": "torch"}


@dataclass
class ExportReport:
    step: int
    path: str
    format: str
    tensors: int = 0
    bytes: int = 0
    skipped: List[str] = field(default_factory=list)      # names of non-tensor leaves left out


def format_of(out: str) -> str:
    ext = os.path.splitext(str(out))[1].lower()
    if ext not in FORMATS:
        raise ValueError(f"cannot tell the format of {out!r}: use a .safetensors or .pt file name")
    return FORMATS[ext]


def flatten_tensors(tree: Any, prefix: str = "") -> "tuple[Dict[str, torch.Tensor], List[str]]":
    """``{dotted name: tensor}`` and the dotted names of the non-tensor leaves of a nested dict/list/tuple."""
    tensors: Dict[str, torch.Tensor] = {}
    skipped: List[str] = []

    def walk(v, name):
        if isinstance(v, torch.Tensor):
            tensors[name] = v
        elif isinstance(v, dict):
            for k, sub in v.items():
                walk(sub, f"{name}.{k}" if name else str(k))
        elif isinstance(v, (list, tuple)):
            for i, sub in enumerate(v):
                walk(sub, f"{name}.{i}" if name else str(i))
        else:
            skipped.append(name or "<root>")
    walk(tree, prefix)
    return tensors, skipped


def read_key(store, step: int, key: str = "model", *, rank: int = 0) -> Any:
    """The value at ``key`` of ``step`` (``""``: the whole step), sharded values as full tensors. Reads only
    the chunks under the top-level key, read-only (nothing is quarantined)."""
    path = tuple(p for p in key.split("/") if p) if key else ()
    commit = store.catalog.read_commit(step)
    blobs = BlobStore(store.storage, quarantine=False)
    with ThreadPoolExecutor(max_workers=4, thread_name_prefix="ckptstore-export") as pool:
        loader = StepLoader(store.catalog, blobs, commit, rank=rank, world_size=commit.world_size, executor=pool,
                            read_nodes=lambda b, m, **kw: read_nodes(b, m, executor=pool, **kw))
        keys = loader.saved_keys()
        if path and path[0] not in keys:
            raise CheckpointError(f"step {step} has no key {path[0]!r} (it has {', '.join(sorted(keys))})")
        value: Any = loader.load({path[0]} if path else keys, {}, map_location="cpu")
    for i, part in enumerate(path):
        if isinstance(value, (list, tuple)) and part.isdigit() and int(part) < len(value):
            value = value[int(part)]
        elif isinstance(value, dict) and part in value:
            value = value[part]
        else:
            raise CheckpointError(f"step {step} has no key {path_str(path[:i + 1])!r}")
    return value


def _write(tensors: Dict[str, torch.Tensor], path: str, fmt: str, metadata: Dict[str, str]) -> None:
    if fmt == "safetensors":
        from safetensors.torch import save_file
        save_file(tensors, path, metadata={"format": "pt", **metadata})
    else:
        torch.save(tensors, path)


def _read(path: str, fmt: str) -> Dict[str, torch.Tensor]:
    if fmt == "safetensors":
        from safetensors.torch import load_file
        return load_file(path)
    return torch.load(path, map_location="cpu", weights_only=True)


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if a.numel() == 0:
        return True
    return bool(torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)))


def export_step(store, out, *, step: Optional[int] = None, key: str = "model",
                fmt: Optional[str] = None) -> ExportReport:
    """Write the tensors under ``key`` of ``step`` (default: the newest committed step) to ``out`` (format
    from the extension unless ``fmt`` is ``"safetensors"`` / ``"torch"``), verified. Raises
    ``CheckpointError`` when the key holds no tensor or the file read back differs."""
    out = os.fspath(out)
    fmt = fmt or format_of(out)
    if fmt not in ("safetensors", "torch"):
        raise ValueError(f"format must be 'safetensors' or 'torch', got {fmt!r}")
    if step is None:                     # the root it reads (a memory tier's steps are not in store.catalog)
        committed = store.catalog.committed_steps()
        step = committed[-1] if committed else None
        if step is None:
            raise FileNotFoundError(f"no committed step in {store.root}")
    value = read_key(store, step, key)
    tensors, skipped = flatten_tensors(value)
    if not tensors:
        raise CheckpointError(f"step {step} holds no tensor under {key or 'the root'!r}")
    seen, clean = set(), {}
    for name, t in tensors.items():
        t = t.detach().to("cpu").contiguous()
        ptr = (t.untyped_storage().data_ptr(), t.storage_offset()) if t.numel() else None
        if ptr is not None and ptr in seen:           # safetensors refuses shared memory: give each its own
            t = t.clone()
        elif ptr is not None:
            seen.add(ptr)
        if t.untyped_storage().nbytes() != t.numel() * t.element_size():
            t = t.clone()                             # a view into a larger buffer: write only its bytes
        clean[name] = t
    with atomic_file(out) as tmp:
        _write(clean, tmp, fmt, {"ckptstore_step": str(step), "ckptstore_key": key})
        back = _read(tmp, fmt)
        if set(back) != set(clean):
            raise CheckpointError(f"export to {out}: the written file holds other tensors than were written")
        for name, t in clean.items():
            if not _same(t, back[name]):
                raise CheckpointError(f"export to {out}: tensor {name!r} reads back differently")
    return ExportReport(step=step, path=out, format=fmt, tensors=len(clean),
                        bytes=sum(t.numel() * t.element_size() for t in clean.values()), skipped=skipped)
