"""Turn the arrays of a flattened state into byte views the write path can hash and write.

``direct_views`` serves a blocking save: a contiguous CPU tensor is used in place (no copy; the caller is
blocked, so nothing changes it), anything else (non-contiguous views, CUDA tensors, conjugate views) is
materialised once into a temporary contiguous CPU copy.
"""
from __future__ import annotations

from typing import List

import numpy as np
import torch

from .state import Node


def tensor_cpu_contiguous(t: torch.Tensor) -> torch.Tensor:
    t = t.detach()
    if t.is_conj():
        t = t.resolve_conj()
    if t.is_neg():
        t = t.resolve_neg()
    if t.device.type != "cpu":
        t = t.to("cpu")
    return t.contiguous()


def byte_view(value) -> memoryview:
    """A flat, read-only byte view of a contiguous CPU tensor or numpy array (no copy)."""
    if isinstance(value, torch.Tensor):
        if value.numel() == 0:
            return memoryview(b"")
        return memoryview(value.reshape(-1).view(torch.uint8).numpy()).cast("B")
    arr = np.ascontiguousarray(value)
    if arr.size == 0:
        return memoryview(b"")
    return memoryview(arr.reshape(-1).view(np.uint8)).cast("B")


def direct_views(nodes: List[Node]) -> List[memoryview]:
    """Byte views of every array node, in order (tensors are made contiguous on CPU where needed)."""
    views = []
    for n in nodes:
        if n.kind == "tensor":
            views.append(byte_view(tensor_cpu_contiguous(n.value)))
        else:
            views.append(byte_view(n.value))
    return views
