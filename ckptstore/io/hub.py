"""Weights in the Hugging Face Hub's format as a ``load_path``: a weights-only start (fine-tuning).

``Store(load_path=...)`` accepts, besides a ckptstore store URL:

* a ``.safetensors`` file (``model.safetensors``), local or any fsspec URL;
* a model directory as ``save_pretrained`` writes it: ``model.safetensors``, or
  ``model.safetensors.index.json`` plus its shards (``model-00001-of-00002.safetensors``, ...).

Nothing is unpickled (``pytorch_model.bin`` is refused, by design). Every file is parsed by the ``safetensors``
library, which checks the header against the file (offsets in bounds, no overlap, no gap, sizes = shape x
dtype); on top of that a sharded directory's index must name shards in that directory only, and its weight map
must equal the union of the shards' headers: a key listed and absent, present and unlisted, or held by two
shards is refused. Any of these raises :class:`~ckptstore.util.errors.CorruptCheckpointError` naming the file.

The weights go to one top-level key of ``state`` (``load_components=("model",)`` by default, or the one key
named there) through its ``load_state_dict``. A key of the file the target lacks, a shape that differs, or a
parameter of the target the file lacks is an :class:`~ckptstore.util.errors.IncompatibleCheckpointError`, except a
parameter tied to one the file holds (``save_pretrained`` drops tied weights such as ``lm_head.weight``).
Values are converted to the target's dtype (a bf16 file into fp32 parameters), as ``load_state_dict`` does.
"""
from __future__ import annotations

import json
import os
import posixpath
import stat
from typing import Any, Dict, Mapping, MutableMapping, Optional, Sequence

import torch

from ..util.errors import CheckpointError, CorruptCheckpointError, IncompatibleCheckpointError

SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"
MAX_INDEX_BYTES = 64 << 20      # an index is a few MiB for the largest public models


def open_weights(url: str, storage_options=None, wrap=None):
    """``(storage, files, weight_map)`` when ``url`` names Hub-format weights (a ``.safetensors`` file, or a directory
    holding ``model.safetensors`` or ``model.safetensors.index.json``), else ``None`` (a ckptstore store).
    ``wrap(storage)`` may add retries. Raises CorruptCheckpointError for a damaged index."""
    from ..storage import open_storage

    url = str(url).rstrip("/")
    if url.endswith(".safetensors"):
        parent, name = url.rsplit("/", 1) if "/" in url else (".", url)
        storage = open_storage(parent, storage_options)
        return (wrap(storage) if wrap else storage), (name,), None
    storage = open_storage(url, storage_options)
    storage = wrap(storage) if wrap else storage
    if storage.exists(INDEX):
        weight_map = _read_index(storage)
        return storage, tuple(sorted(set(weight_map.values()))), weight_map
    if storage.exists(SINGLE):
        return storage, (SINGLE,), None
    return None


def _load_file(storage, name: str, st_load) -> Dict[str, torch.Tensor]:
    """A local regular file is memory-mapped by ``safetensors.torch.load_file`` (no second copy in memory);
    anything else is read whole and parsed from bytes."""
    local = storage.local_path(name)
    if local is not None:
        from safetensors.torch import load_file
        if not stat.S_ISREG(os.stat(local).st_mode):          # a FIFO would block the open
            raise CorruptCheckpointError(f"{storage.url}/{name}: not a regular file")
        return load_file(local)
    return st_load(storage.read_bytes(name))


def _read_index(storage) -> Dict[str, str]:
    """The weight map (tensor name -> shard file) of ``storage``'s index, checked."""
    where = f"{storage.url}/{INDEX}"
    raw = storage.read_bytes(INDEX, limit=MAX_INDEX_BYTES + 1)
    if len(raw) > MAX_INDEX_BYTES:
        raise CorruptCheckpointError(f"{where}: larger than {MAX_INDEX_BYTES} bytes")
    try:
        weight_map = json.loads(raw)["weight_map"]
        if not isinstance(weight_map, dict) or not weight_map:
            raise ValueError("weight_map must be a non-empty object")
    except (ValueError, KeyError, TypeError) as e:
        raise CorruptCheckpointError(f"{where}: not a safetensors index ({e})") from None
    for name in set(weight_map.values()):
        if (not isinstance(name, str) or not name.endswith(".safetensors") or "/" in name or "\\" in name
                or posixpath.basename(name) != name):
            raise CorruptCheckpointError(f"{where}: shard {name!r} is not a safetensors file of this directory")
    return weight_map


def read_weights(storage, files: Sequence[str], weight_map: Optional[Mapping[str, str]] = None
                 ) -> Dict[str, torch.Tensor]:
    """Every tensor of the safetensors ``files`` (store-relative; ``weight_map``: the index's, when the files
    are its shards), checked as the module docstring says. Raises CorruptCheckpointError naming the file."""
    from safetensors.torch import load as st_load

    out: Dict[str, torch.Tensor] = {}
    where: Dict[str, str] = {}
    for name in files:
        try:
            tensors = _load_file(storage, name, st_load)
        except FileNotFoundError:
            raise CorruptCheckpointError(f"{storage.url}/{name}: missing") from None
        except CorruptCheckpointError:
            raise
        except Exception as e:          # safetensors_rust.SafetensorError and friends: the file is not valid
            raise CorruptCheckpointError(f"{storage.url}/{name}: not a valid safetensors file "
                                         f"({type(e).__name__}: {e})") from None
        for key, t in tensors.items():
            if key in out:
                raise CorruptCheckpointError(f"{storage.url}/{name}: tensor {key!r} is also in {where[key]}")
            if weight_map is not None and weight_map.get(key) != name:
                raise CorruptCheckpointError(f"{storage.url}/{name}: tensor {key!r} is not mapped to this shard "
                                             f"by {INDEX} ({weight_map.get(key)!r})")
            out[key], where[key] = t, name
    if weight_map is not None:
        absent = sorted(set(weight_map) - set(out))
        if absent:
            raise CorruptCheckpointError(f"{storage.url}/{INDEX}: names tensors no shard holds: "
                                         f"{', '.join(absent[:10])}{' ...' if len(absent) > 10 else ''}")
    return out


def apply_weights(state: MutableMapping[str, Any], weights: Mapping[str, torch.Tensor], key: str,
                  where: str) -> None:
    """Load ``weights`` into ``state[key]`` (an ``nn.Module`` or another Stateful). Raises
    IncompatibleCheckpointError as the module docstring says; nothing of ``state`` changes then."""
    if key not in state:
        raise IncompatibleCheckpointError(f"load_path {where}: weights go to state[{key!r}], which does not exist")
    target = state[key]
    if not hasattr(target, "state_dict") or not hasattr(target, "load_state_dict"):
        raise IncompatibleCheckpointError(f"load_path {where}: state[{key!r}] has no load_state_dict")
    live = target.state_dict()
    unexpected = set(weights) - set(live)
    missing = set(live) - set(weights)
    # save_pretrained drops tied weights: a missing entry sharing memory with a loaded one is filled by it
    loaded_ptrs = {_ptr(live[k]) for k in weights if k in live}
    missing = {k for k in missing if not (isinstance(live[k], torch.Tensor) and _ptr(live[k]) in loaded_ptrs)}
    bad_shape = sorted(f"{k}: file {tuple(weights[k].shape)}, state {tuple(live[k].shape)}"
                       for k in set(weights) & set(live)
                       if isinstance(live[k], torch.Tensor) and tuple(live[k].shape) != tuple(weights[k].shape))
    if unexpected or missing or bad_shape:
        raise IncompatibleCheckpointError(
            f"load_path {where}: weights do not fit state[{key!r}]"
            + (f"; shapes differ: {'; '.join(bad_shape[:10])}" if bad_shape else ""),
            missing=missing, unexpected=unexpected)
    kwargs = {"strict": False} if isinstance(target, torch.nn.Module) else {}
    try:
        target.load_state_dict(dict(weights), **kwargs)
    except Exception as e:
        raise IncompatibleCheckpointError(f"load_path {where}: state[{key!r}].load_state_dict refused the "
                                          f"weights ({type(e).__name__}: {e})") from None


def _ptr(t: torch.Tensor):
    try:
        return (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape))
    except (RuntimeError, NotImplementedError):
        return None


def target_key(state: Mapping[str, Any], components: Optional[Sequence[str]], where: str) -> str:
    """The top-level key weights go to: the one ``load_components`` names, else ``"model"``."""
    if components is not None:
        if len(components) != 1:
            raise CheckpointError(f"load_path {where} holds model weights only: load_components must name one "
                                  f"key, got {list(components)}")
        return components[0]
    return "model"
