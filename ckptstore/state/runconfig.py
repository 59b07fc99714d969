"""The run's config (hyperparameters) recorded with every step, and the check made on resume."""
from __future__ import annotations

from typing import Any, Dict, Iterable, Mapping, Optional, Tuple

import msgpack


def normalize(config: Optional[Mapping[str, Any]], what: str = "config") -> Optional[Dict[str, Any]]:
    """Round-trip through msgpack so a value compares equal to what is read back (tuples become lists).

    Raises ``TypeError`` for values msgpack cannot hold (only str-keyed dicts, lists, and plain scalars).
    """
    if config is None:
        return None
    if not isinstance(config, Mapping):
        raise TypeError(f"{what} must be a mapping, got {type(config).__name__}")
    try:
        return msgpack.unpackb(msgpack.packb(dict(config), use_bin_type=True, default=_plain), raw=False)
    except (TypeError, ValueError, OverflowError) as e:
        raise TypeError(f"{what} must hold only str-keyed dicts, lists and plain values: {e}") from None


def _plain(obj):
    # numpy / torch scalars (e.g. a loss passed as a 0-d tensor) become Python numbers
    import numpy as np
    import torch
    if isinstance(obj, np.generic) or (isinstance(obj, torch.Tensor) and obj.dim() == 0):
        return obj.item()
    raise TypeError(f"unsupported value {obj!r} of type {type(obj).__name__}")


def _flat(d: Any, prefix: str = "") -> Dict[str, Any]:
    if not isinstance(d, dict):
        return {prefix: d}
    out: Dict[str, Any] = {}
    for k, v in d.items():
        key = f"{prefix}.{k}" if prefix else str(k)
        if isinstance(v, dict) and v:
            out.update(_flat(v, key))
        else:
            out[key] = v
    return out


_ABSENT = "<absent>"


def differences(saved: Optional[Mapping], current: Optional[Mapping],
                may_change: Iterable[str] = ()) -> Dict[str, Tuple[Any, Any]]:
    """Dotted key -> (saved value, current value) for every key that differs, except keys in ``may_change``
    (a name there also covers everything below it: ``"data"`` covers ``"data.path"``)."""
    if saved is None or current is None:
        return {}
    a, b = _flat(dict(saved)), _flat(dict(current))
    allowed = tuple(may_change)
    diffs = {}
    for k in sorted(set(a) | set(b)):
        if any(k == m or k.startswith(m + ".") for m in allowed):
            continue
        va, vb = a.get(k, _ABSENT), b.get(k, _ABSENT)
        if va != vb:
            diffs[k] = (va, vb)
    return diffs
