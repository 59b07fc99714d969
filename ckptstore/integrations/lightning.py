"""PyTorch Lightning (2.6) on ckptstore: ``CkptstoreCheckpointIO`` (single process, DDP) and
``CkptstoreModelParallelStrategy`` (FSDP2 / tensor parallel, where Lightning bypasses the CheckpointIO).

Lightning decides *when* to save, *which* checkpoints to keep (``ModelCheckpoint``'s top-k / last) and *which* one to
resume from (``ckpt_path``); ckptstore stores the states. Lightning speaks in file paths, so every committed step also
gets a small JSON **stub file** at the path Lightning asked for::

    {"format": "ckptstore-stub/1", "root": "/abs/store/root", "step": 12}

written atomically after the commit. ``ModelCheckpoint``'s ``file_exists``, version counters, ``last*.ckpt`` discovery
and ``trainer.fit(ckpt_path="last")`` keep working on the stubs; loading a stub loads step 12 from the store (local,
else the remote), and removing the last stub that names a step deletes the step, locally and remotely.
``resume_path()`` returns a stub for the newest valid step over the local root and the remote (it rewrites the stub
when the local disk was wiped), or ``None``: ``trainer.fit(model, ckpt_path=io.resume_path())``.

Lightning saves no RNG state; the adapter saves ``ckptstore.RNGState()`` (Python, NumPy, torch CPU and the current
CUDA device) with every step and restores it on resume (see ``CkptstoreCheckpointIO.callback`` for when).

A checkpoint taken on an epoch's last batch (or at its end) with a resumable loader's state (torchdata's
``StatefulDataLoader``) does not resume exactly under Lightning 2.6 (an epoch is skipped, or the loader starts
over), whichever CheckpointIO saved it: the adapter logs a warning at the first such save and at every load of one
(docs/integrations/lightning.md).

Only ckptstore's public API is used. Importing this module imports Lightning (``lightning``, else
``pytorch_lightning``); it raises ``ImportError`` naming the missing methods when the installed Lightning lacks a
method this module overrides or calls (written against Lightning 2.6).
"""
from __future__ import annotations

import argparse
import contextlib
import enum
import json
import logging
import os
import pathlib
import threading
from typing import Any, Callable, Dict, Iterable, List, Mapping, Optional, Tuple

import torch

from ckptstore import CheckpointError, RNGState, Store, atomic_file

log = logging.getLogger("ckptstore.lightning")

try:
    import lightning.pytorch as pl
    from lightning.pytorch.callbacks import Callback
    from lightning.pytorch.plugins.io import CheckpointIO, TorchCheckpointIO
    from lightning.pytorch.strategies import ModelParallelStrategy
except ImportError:                                     # the standalone package
    import pytorch_lightning as pl                      # type: ignore[no-redef]
    from pytorch_lightning.callbacks import Callback    # type: ignore[no-redef]
    from pytorch_lightning.plugins.io import CheckpointIO, TorchCheckpointIO   # type: ignore[no-redef]
    from pytorch_lightning.strategies import ModelParallelStrategy            # type: ignore[no-redef]

SUPPORTED_VERSIONS = "lightning >= 2.6, < 3"
STUB_FORMAT = "ckptstore-stub/1"
_STUB_MAX_BYTES = 64 << 10

# What this module overrides or relies on, per Lightning class (checked at import).
_REQUIRED = {
    CheckpointIO: ("save_checkpoint", "load_checkpoint", "remove_checkpoint", "teardown"),
    TorchCheckpointIO: ("load_checkpoint", "remove_checkpoint"),
    ModelParallelStrategy: ("save_checkpoint", "load_checkpoint", "remove_checkpoint", "teardown", "on_train_start",
                            "restore_checkpoint_after_setup", "lightning_restore_optimizer",
                            "load_model_state_dict", "load_optimizer_state_dict", "broadcast", "barrier"),
    Callback: ("setup", "on_train_start"),
}


def _check_lightning(required: Mapping[type, Iterable[str]] = None) -> None:
    """Raise ``ImportError`` naming every ``Class.method`` this module needs that the installed Lightning lacks."""
    missing = [f"{cls.__name__}.{name}" for cls, names in (required or _REQUIRED).items() for name in names
               if not hasattr(cls, name)]
    if missing:
        raise ImportError(f"ckptstore.integrations.lightning needs {', '.join(missing)}, which Lightning "
                          f"{getattr(pl, '__version__', '?')} lacks (supported: {SUPPORTED_VERSIONS})")


_check_lightning()


# -- stubs ---------------------------------------------------------------------------------------------------------
def _norm_root(root) -> str:
    """The store root as recorded in stubs: an absolute path for local roots, the URL otherwise."""
    root = os.fspath(root)
    if "://" in root and not root.startswith("file://"):
        return root.rstrip("/")
    if root.startswith("file://"):
        root = root[len("file://"):]
    return os.path.realpath(os.path.abspath(os.path.expanduser(root)))


def read_stub(path) -> Optional[Dict[str, Any]]:
    """The stub at ``path`` (``{"format", "root", "step"}``), or ``None`` when ``path`` is absent or is not a stub
    (e.g. a checkpoint written by Lightning's own ``TorchCheckpointIO``). Raises ``ValueError`` for a file that
    claims the stub format but is malformed."""
    path = os.fspath(path)
    try:
        with open(path, "rb") as f:
            head = f.read(_STUB_MAX_BYTES + 1)
    except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
        return None
    if len(head) > _STUB_MAX_BYTES or not head.lstrip().startswith(b"{"):
        return None
    try:
        stub = json.loads(head.decode("utf-8"))
    except (UnicodeDecodeError, ValueError):
        return None
    if not isinstance(stub, dict) or stub.get("format") != STUB_FORMAT:
        return None
    step = stub.get("step")
    if isinstance(step, bool) or not isinstance(step, int) or step < 0 or not isinstance(stub.get("root"), str):
        raise ValueError(f"malformed ckptstore stub {path}: {stub!r:.200}")
    return stub


_STUB_TMP_PREFIX, _STUB_TMP_SUFFIX = ".ckptstore-stub-", ".tmp"


@contextlib.contextmanager
def _stub_dir_lock(d: str):
    """Hold a shared ``flock`` on the directory ``d`` while a stub is written in it; just before, when no other
    writer holds it (an exclusive lock is granted at once), remove the temporary files writers killed mid-write
    left there.

    Every stub writer (every process and thread: ``flock`` locks belong to an open file description) holds the
    shared lock from creating its temporary file until the rename, so a temporary file present while the
    exclusive lock is held has no live writer: the kernel released its writer's lock when the writer died. Where
    directories cannot be locked (no ``fcntl``; a filesystem refusing ``flock`` on a directory, e.g. some NFS
    mounts), stubs are written the same way and nothing is removed."""
    try:
        import fcntl
        dfd: Optional[int] = os.open(d, os.O_RDONLY)
    except (ImportError, OSError):
        dfd = None
    if dfd is None:
        yield
        return
    try:
        try:
            fcntl.flock(dfd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:                      # another writer is writing now: sweep next time
            fcntl.flock(dfd, fcntl.LOCK_SH)
        except OSError as e:
            log.debug("no flock on %s (%s): leftover stub temporary files are not removed", d, e)
        else:
            _sweep_stub_tmp(d)
            fcntl.flock(dfd, fcntl.LOCK_SH)          # (not atomic: no temporary file of ours exists yet)
        yield
    finally:
        os.close(dfd)                                # releases the lock


def _sweep_stub_tmp(d: str) -> None:
    """Remove the stub temporary files in ``d`` (call only with ``d`` locked exclusively: no live writer)."""
    try:
        names = [e.name for e in os.scandir(d) if e.name.startswith(_STUB_TMP_PREFIX)
                 and e.name.endswith(_STUB_TMP_SUFFIX) and e.is_file(follow_symlinks=False)]
    except OSError:
        return
    for n in names:
        try:
            os.unlink(os.path.join(d, n))
            log.info("removed %s, left by a stub writer that was killed mid-write", os.path.join(d, n))
        except FileNotFoundError:
            pass


def write_stub(path, root: str, step: int) -> None:
    """Write the stub for ``step`` of the store at ``root`` to ``path`` atomically (temporary file
    ``.ckptstore-stub-*.tmp`` in the same directory, fsync, rename). Temporary files that writers killed mid-write
    left in that directory are removed first, unless another writer is writing there (see ``_stub_dir_lock``);
    a live writer's temporary file is never removed."""
    path = os.fspath(path)
    d = os.path.dirname(os.path.abspath(path))
    os.makedirs(d, exist_ok=True)
    data = json.dumps({"format": STUB_FORMAT, "root": root, "step": int(step)}).encode()
    with _stub_dir_lock(d), atomic_file(path, prefix=_STUB_TMP_PREFIX, suffix=_STUB_TMP_SUFFIX) as tmp:
        with open(tmp, "wb") as f:
            f.write(data)


# -- the dict Lightning hands over ---------------------------------------------------------------------------------
_HPARAM_KEYS = ("hyper_parameters", "datamodule_hyper_parameters")
_HPARAM_TYPE_KEYS = ("hparams_type", "datamodule_hparams_type")


def _plain(value: Any, where: str) -> Any:
    """``value`` with argparse ``Namespace``, ``Path``, ``Enum`` and OmegaConf containers made plain; ``TypeError``
    naming ``where`` for anything ckptstore cannot store."""
    if value is None or isinstance(value, (bool, int, float, str, bytes, torch.Tensor)):
        return value
    if isinstance(value, argparse.Namespace):
        value = vars(value)
    if isinstance(value, enum.Enum):
        return _plain(value.value, where) if isinstance(value.value, (bool, int, float, str)) else value.name
    if isinstance(value, pathlib.PurePath):
        return str(value)
    if type(value).__module__.startswith("omegaconf"):
        from omegaconf import OmegaConf
        value = OmegaConf.to_container(value, resolve=True)
    if isinstance(value, Mapping):
        out = {}
        for k, v in value.items():
            if not isinstance(k, (str, int)):
                raise TypeError(f"{where}: key {k!r} of type {type(k).__name__} cannot be stored by ckptstore "
                                "(use str or int keys)")
            out[k] = _plain(v, f"{where}[{k!r}]")
        return out
    if isinstance(value, (list, tuple)):
        return type(value)(_plain(v, f"{where}[{i}]") for i, v in enumerate(value)) if isinstance(value, tuple) \
            else [_plain(v, f"{where}[{i}]") for i, v in enumerate(value)]
    try:
        import numpy as np
        if isinstance(value, (np.ndarray, np.generic)):
            return value
    except ImportError:                                   # pragma: no cover
        pass
    raise TypeError(f"{where}: a {type(value).__module__}.{type(value).__qualname__} cannot be stored by ckptstore "
                    "(hyperparameters must be plain values: numbers, strings, lists, dicts, Namespace, Path, Enum)")


def sanitize_checkpoint(checkpoint: Mapping[str, Any]) -> Dict[str, Any]:
    """A shallow copy of Lightning's checkpoint dict whose hyperparameters are plain values (``Namespace`` -> dict,
    ``Path`` -> str, ``Enum`` -> its value, OmegaConf -> containers; the class Lightning records next to OmegaConf
    hyperparameters is dropped). Raises ``TypeError`` naming the key of any other object."""
    out = dict(checkpoint)
    for k in _HPARAM_KEYS:
        if k in out:
            out[k] = _plain(out[k], k)
    for k in _HPARAM_TYPE_KEYS:
        if isinstance(out.get(k), type):
            del out[k]
    return out


def _metrics_of(checkpoint: Mapping[str, Any]) -> Dict[str, float]:
    """``{monitor: current_score}`` of every ``ModelCheckpoint`` entry in ``checkpoint["callbacks"]``."""
    out: Dict[str, float] = {}
    for key, st in (checkpoint.get("callbacks") or {}).items():
        if not (isinstance(key, str) and key.startswith("ModelCheckpoint") and isinstance(st, Mapping)):
            continue
        monitor, score = st.get("monitor"), st.get("current_score")
        if isinstance(monitor, str) and score is not None:
            try:
                out[monitor] = float(score.item() if isinstance(score, torch.Tensor) else score)
            except (TypeError, ValueError, RuntimeError):
                pass
    return out


def _loader_states_saved(checkpoint: Mapping[str, Any]) -> bool:
    """Whether Lightning saved data-loader states (a resumable loader such as torchdata's StatefulDataLoader)."""
    try:
        return bool(checkpoint["loops"]["fit_loop"]["state_dict"].get("combined_loader"))
    except (KeyError, TypeError, AttributeError):
        return False


def _epoch_end_hazard(checkpoint: Mapping[str, Any]) -> Optional[str]:
    """Why resuming ``checkpoint`` is not exact, when it was taken on an epoch's last batch (or at the epoch's end)
    with a resumable data loader's state saved; ``None`` otherwise (mid-epoch, or a plain loader).

    Seen with Lightning 2.6.6 + torchdata 0.11 ``StatefulDataLoader``, with Lightning's own ``TorchCheckpointIO``
    as with this adapter (docs/integrations/lightning.md, "Random state and data position"): Lightning counts the
    finished epoch on restore while the loader's saved state still has the rest of that epoch (nothing) to give, so
    the next epoch is trained under the following epoch's number and a ``max_epochs`` run ends one epoch early; from
    a save at the epoch's end (``on_train_epoch_end``) the next epoch takes a fresh loader's order instead of the
    uninterrupted run's."""
    if not _loader_states_saved(checkpoint):
        return None
    try:
        progress = checkpoint["loops"]["fit_loop"]["epoch_loop.batch_progress"]
        last, current = progress["is_last_batch"], progress["current"]
        at_batch_end = current["completed"] < current["ready"]
    except (KeyError, TypeError):
        return None
    if last is not True:
        return None
    epoch, step = checkpoint.get("epoch"), checkpoint.get("global_step")
    if at_batch_end:
        return (f"step {step} was saved on the last batch of epoch {epoch} with a resumable data loader's state: "
                f"Lightning 2.6 resumes it one epoch too far (the next epoch's batches are trained as epoch "
                f"{epoch + 2 if isinstance(epoch, int) else 'N+2'} and a max_epochs run ends one epoch early)")
    return (f"step {step} was saved at the end of epoch {epoch} with a resumable data loader's state: Lightning 2.6 "
            f"resumes it with the loader starting over (a shuffling loader gives the next epoch a fresh loader's "
            f"first order, not the uninterrupted run's)")


_HAZARD_ADVICE = ("resume from a checkpoint saved mid-epoch, save on steps that are not an epoch's last batch, or "
                  "use a plain DataLoader for epoch-boundary checkpoints (docs/integrations/lightning.md, 'Random "
                  "state and data position')")


def _warn_hazard(owner: Any, checkpoint: Mapping[str, Any], saving: bool) -> None:
    """Log :func:`_epoch_end_hazard` as a warning: at every load of such a checkpoint, at the first such save of
    ``owner`` (later ones at INFO)."""
    why = _epoch_end_hazard(checkpoint)
    if why is None:
        return
    if not saving:
        log.warning("resuming: %s; to resume exactly, %s", why, _HAZARD_ADVICE)
        return
    first = not getattr(owner, "_ckpt_hazard_warned", False)
    owner._ckpt_hazard_warned = True
    log.log(logging.WARNING if first else logging.INFO, "%s; to resume exactly, %s", why, _HAZARD_ADVICE)


class _RNGRestore:
    """Applies a saved RNG state at the right moment of a resumed ``fit``.

    Lightning creates the training data iterator after the checkpoint is loaded, and a ``DataLoader``'s ``iter()``
    draws from torch's global generator. With a plain loader the resumed run starts a new epoch exactly like the
    uninterrupted one did, so the state is applied at load time, before that draw. With a resumable loader (its state
    saved by Lightning) the uninterrupted run drew nothing between the save and the next batch, so the state is
    applied at ``on_train_start``, after the iterator exists; without a hook there, at the first forward pass."""

    def __init__(self) -> None:
        self.pending: Optional[Mapping[str, Any]] = None
        self._hook = None
        self.lock = threading.Lock()

    def arrive(self, rng: Mapping[str, Any], defer: bool, have_train_start: bool) -> None:
        self.cancel()
        if not defer:
            RNGState().load_state_dict(rng)
            return
        self.pending = rng
        if not have_train_start:
            from torch.nn.modules.module import register_module_forward_pre_hook
            self._hook = register_module_forward_pre_hook(lambda module, args: self.apply())

    def apply(self) -> None:
        with self.lock:
            rng, self.pending = self.pending, None
            if self._hook is not None:
                self._hook.remove()
                self._hook = None
        if rng is not None:
            RNGState().load_state_dict(rng)

    def cancel(self) -> None:
        with self.lock:
            self.pending = None
            if self._hook is not None:
                self._hook.remove()
                self._hook = None


class _RNGCallback(Callback):
    """``CkptstoreCheckpointIO.callback``: applies the restored RNG state at ``on_train_start`` (see there)."""

    def __init__(self, rng: _RNGRestore):
        self._rng = rng
        self.attached = False

    def setup(self, trainer, pl_module, stage) -> None:
        self.attached = True

    def on_train_start(self, trainer, pl_module) -> None:
        self._rng.apply()


def _flush_pending(pending: List[Tuple[Any, str, int]], wait: bool,
                   install: Callable[[str, int], None]) -> List[Tuple[Any, str, int]]:
    """``(handle, path, step)`` of non-blocking saves: ``install(path, step)`` for each that has committed, in
    order (all of them, waiting, when ``wait``); a background save's error is raised by its handle. Returns those
    still in flight."""
    still = []
    for handle, path, step in pending:
        if not wait and not handle.done():
            still.append((handle, path, step))
            continue
        res = handle.result()                 # raises the background save's error
        if res is None or getattr(res, "committed", True):
            install(path, step)
    return still


# -- single process and DDP -----------------------------------------------------------------------------------------
class CkptstoreCheckpointIO(CheckpointIO):
    """A Lightning ``CheckpointIO`` that stores checkpoints in a ckptstore ``Store`` (single device and DDP, where
    Lightning saves on global rank 0 and loads on every rank).

    Args:
        root: the local store root (a path or ``file://`` URL); created if missing.
        remote: an fsspec URL (``s3://bucket/run1``, ``gs://...``) every committed step is uploaded to in the
            background; resume and loads fall back to it when the local root lacks a step.
        storage_options: fsspec options for ``remote`` (endpoint, credentials; never written anywhere).
        keep: a ``ckptstore.Retention`` applied by the store after each commit, on top of ``ModelCheckpoint``'s own
            rotation (use it with ``save_top_k=-1`` to let ckptstore decide).
        blocking: ``True`` (default): ``save_checkpoint`` returns once the step is committed on local disk and its
            stub is written. ``False``: it returns after copying the changed tensors into reused staging memory; the
            commit runs in the background and the stub is written once it is done (at the next save, load, remove,
            ``teardown`` or ``resume_path``). Lightning saves one step twice when ``save_last`` is set (top-k path,
            then ``last.ckpt``); the second save waits for the first, so ``False`` gains little there.
        **store_kw: any other ``ckptstore.Store`` argument (``writing=Writing(...)``, ``on_rewind``, ``config``, ...; a ``Remote(url, keep_local=...)`` may be given as ``remote``).
            ``memory=ckptstore.Memory("/dev/shm/run1", every=..., disk_every=...)``: the memory tier in front of
            ``root`` (one node: rank 0 saves alone, and every rank loads from this node's memory root). A save of a
            step due for no tier writes nothing and no stub; ``resume_path()`` names the newest memory step when
            it is newer than every disk step, and loading a stub reads its step from the memory root (an ordinary
            store root, FORMAT.md "The memory tier") while it holds it, else from ``root`` / the remote.

    Every step is one commit named by every path Lightning saved it under (``Store.save(names=)``); step =
    ``checkpoint["global_step"]``; metrics = ``{monitor: current_score}`` of each ``ModelCheckpoint``. The saved state
    is ``{"lightning": <Lightning's dict, hyperparameters made plain>, "rng": RNGState()}``.

    ``callback``: add it to the Trainer's callbacks (``callbacks=[io.callback, ...]``) so a resumed run gets the saved
    RNG state exactly where the uninterrupted run had it (needed with resumable data loaders; see ``_RNGRestore``).

    Raises (from ``save_checkpoint``): ``TypeError`` naming the key of a value ckptstore cannot store or when
    ``storage_options`` is passed to ``Trainer.save_checkpoint``; ``ckptstore.util.errors.IncompatibleCheckpointError``
    when the step is older than the newest committed one (a run resumed from an older checkpoint: pass
    ``on_rewind="truncate"`` to drop the later steps); ``OSError`` from the disk.
    """

    def __init__(self, root, *, remote: Optional[str] = None, storage_options: Optional[Mapping[str, Any]] = None,
                 keep=None, blocking: bool = True, **store_kw):
        super().__init__()
        for k in ("rank", "world_size", "read_only"):
            if k in store_kw:
                raise TypeError(f"CkptstoreCheckpointIO sets {k} itself (rank 0 saves alone)")
        self.root = os.fspath(root)
        self.remote = remote
        self.storage_options = dict(storage_options or {})
        self.keep = keep
        self.blocking = bool(blocking)
        self.store_kw = store_kw
        self._root_id = _norm_root(self.root)
        self._store: Optional[Store] = None
        self._pending: List[Tuple[Any, str, int]] = []     # (handle, path, step) of non-blocking saves
        self._rng = _RNGRestore()
        self.callback = _RNGCallback(self._rng)
        self.memory = store_kw.get("memory")

    # stores
    @property
    def store(self) -> Store:
        """The writing store (global rank 0 only), opened at first use as one rank of one."""
        if self._store is None:
            self._store = Store(self.root, rank=0, world_size=1, remote=self.remote,
                                storage_options=self.storage_options, keep=self.keep, **self.store_kw)
        return self._store

    def _reader(self) -> Store:
        kw = {k: v for k, v in self.store_kw.items() if k in ("collective_timeout", "writing", "load_path")}
        return Store(self.root, rank=0, world_size=1, remote=self.remote, storage_options=self.storage_options,
                     read_only=True, **kw)

    def _memory_reader(self) -> Optional[Store]:
        """A read-only view of the memory tier's root (an ordinary store root), or ``None`` without ``memory=`` or
        before its first save."""
        if self.memory is None or not os.path.isdir(os.path.join(os.fspath(self.memory.root), "steps")):
            return None
        return Store(self.memory.root, rank=0, world_size=1, read_only=True, create=False)

    def _readers(self, step: Optional[int] = None, name: Optional[str] = None) -> List[Store]:
        """Where to read ``step`` (or the step named ``name``) from, in order: the memory root when it holds it,
        then ``root`` (and the remote)."""
        out = []
        mem = self._memory_reader()
        if mem is not None:
            if (step is not None and step in mem.steps()) or (name is not None and mem.find(name) is not None):
                out.append(mem)
            else:
                mem.close()
        return out + [self._reader()]

    def _flush_stubs(self, wait: bool = True) -> None:
        """Write the stubs of non-blocking saves that have committed (all of them, waiting, when ``wait``)."""
        self._pending = _flush_pending(self._pending, wait, self._install_stub)

    def _install_stub(self, name: str, step: int) -> None:
        """Write the stub; a step whose last stub it replaced (``last.ckpt`` moving on) is released."""
        try:
            prev = self._step_of(name)
        except ValueError:
            prev = None
        write_stub(name, self._root_id, step)
        if prev is not None and prev != step:
            self._release(prev, name)

    def _release(self, step: int, name: str) -> None:
        """Delete ``step`` (locally and on the remote) unless a stub other than ``name`` names it or it is the
        newest committed step."""
        for other in self._names_of(step):
            if other != name and self._refers(other, step):
                log.debug("step %d stays: %s still names it", step, other)
                return
        store = self.store
        if step == store.latest_step():
            log.debug("step %d is the newest committed step: kept", step)
            return
        try:
            store.delete_step(step, remote=True)
        except CheckpointError as e:               # the newest on the remote, or being saved
            log.info("step %d not deleted: %s", step, e)

    # CheckpointIO
    def save_checkpoint(self, checkpoint: Dict[str, Any], path, storage_options: Optional[Any] = None) -> None:
        """Commit ``checkpoint`` as step ``checkpoint["global_step"]`` named ``path``, then write the stub at
        ``path`` (after the commit: a stub never names an uncommitted step)."""
        if storage_options is not None:
            raise TypeError("CkptstoreCheckpointIO takes no storage_options in save_checkpoint (set storage "
                            "options for the remote in its constructor)")
        step = checkpoint.get("global_step")
        if isinstance(step, bool) or not isinstance(step, int):
            raise TypeError(f"checkpoint['global_step'] must be an int, got {type(step).__name__} (saving {path})")
        state = {"lightning": sanitize_checkpoint(checkpoint), "rng": RNGState()}
        name = os.fspath(path)
        _warn_hazard(self, checkpoint, saving=True)
        store = self.store
        self._flush_stubs(wait=True)             # save() waits for the previous save anyway
        out = store.save(state, step, metrics=_metrics_of(checkpoint), names=[name], blocking=self.blocking)
        if out is None:                          # memory=: a step due for no tier is not saved, and gets no stub
            log.debug("step %d is due for no tier of the store: not saved, no stub at %s", step, name)
        elif self.blocking:
            self._install_stub(name, step)
        else:
            self._pending.append((out, name, step))

    def _step_of(self, path) -> Optional[int]:
        """The step the stub at ``path`` names, or ``None`` when there is no stub; ``ValueError`` for a stub of another
        store."""
        stub = read_stub(path)
        if stub is not None:
            if _norm_root(stub["root"]) != self._root_id:
                raise ValueError(f"{os.fspath(path)} is a stub of another store ({stub['root']}), this "
                                 f"CkptstoreCheckpointIO writes to {self._root_id}")
            return stub["step"]
        return None

    def load_checkpoint(self, path, map_location: Optional[Any] = None,
                        weights_only: Optional[bool] = None) -> Dict[str, Any]:
        """Load the step the stub at ``path`` names (from the local root, else the remote) and return Lightning's
        dict; the RNG state is restored (see ``callback``). A path that is a regular Lightning checkpoint (no stub)
        is loaded by Lightning's ``TorchCheckpointIO`` with ``weights_only=True`` (migration; never unpickles code).
        A path with no file is looked up among the step names. Raises ``FileNotFoundError`` when neither gives a
        committed step, ``ckptstore.CorruptCheckpointError`` when the step is damaged."""
        self._flush_stubs(wait=True)
        step = self._step_of(path)
        if step is None and os.path.exists(os.fspath(path)):
            log.info("%s is not a ckptstore stub: loading it with Lightning's TorchCheckpointIO", path)
            checkpoint = TorchCheckpointIO().load_checkpoint(path, map_location=map_location, weights_only=True)
            _warn_hazard(self, checkpoint, saving=False)
            return checkpoint
        readers = self._readers(step, None if step is not None else os.fspath(path))
        try:
            reader = readers[0]
            if step is None:
                step = reader.find(os.fspath(path))
                if step is None:
                    raise FileNotFoundError(f"no checkpoint at {os.fspath(path)}: no stub, and no committed step "
                                            f"of {self.root} is named so")
            loaded = reader.load(step, map_location=map_location if map_location is not None else "cpu")
        finally:
            for r in readers:
                r.close()
        checkpoint = loaded["lightning"]
        _warn_hazard(self, checkpoint, saving=False)
        if "rng" in loaded:
            self._rng.arrive(loaded["rng"], defer=_loader_states_saved(checkpoint),
                             have_train_start=self.callback.attached)
        return checkpoint

    def _names_of(self, step: int) -> Tuple[str, ...]:
        """The names in ``step``'s commit marker (local, else the remote's), or ``()``."""
        try:
            return tuple(self.store.commit_info(step).names)
        except (CheckpointError, OSError):
            return self._names_of_remote(step)

    def _remote_view(self) -> Optional[Store]:
        if self.remote is None:
            return None
        return Store(self.remote, rank=0, world_size=1, storage_options=self.storage_options, read_only=True,
                     create=False)

    def remove_checkpoint(self, path) -> None:
        """Remove the stub at ``path``; delete its step (locally and on the remote) when no other stub names it, unless
        it is the newest committed step. A regular file (no stub) is removed as Lightning would."""
        self._flush_stubs(wait=True)
        name = os.fspath(path)
        step = self._step_of(name)
        if step is None:
            if os.path.exists(name):
                TorchCheckpointIO().remove_checkpoint(name)
                return
            step = self.store.find(name)
            if step is None:
                return
        else:
            os.unlink(name)
        self._release(step, name)

    def _refers(self, name: str, step: int) -> bool:
        try:
            stub = read_stub(name)
        except ValueError:
            return False
        return stub is not None and stub["step"] == step and _norm_root(stub["root"]) == self._root_id

    def teardown(self) -> None:
        """Wait for the save in flight and the uploads, write pending stubs, close the store (reopened on next use)."""
        self._rng.cancel()
        try:
            self._flush_stubs(wait=True)
        finally:
            store, self._store = self._store, None
            if store is not None:
                store.close()

    def resume_path(self) -> Optional[str]:
        """A stub path for the newest valid committed step over the local root and the remote, or ``None`` (fresh
        start). Stubs missing for that step's names (a wiped local disk, a kill between commit and stub) are written
        first. Prefers a ``last*`` name. For ``trainer.fit(model, ckpt_path=io.resume_path())``."""
        if self._store is not None:
            self._flush_stubs(wait=True)
        with self._reader() as reader:
            # with memory=, the writing store's resolve() looks at the memory root first
            found = (self.store if self.memory is not None else reader).resolve()
            if found is None or found[1] == "load_path" or found[0] is None:
                return None
            step, tier = found
            names: Tuple[str, ...] = ()
            mem = self._memory_reader() if tier == "memory" else None
            try:
                names = tuple((mem or reader).commit_info(step).names) if tier in ("local", "memory") else ()
            except CheckpointError:
                names = ()
            finally:
                if mem is not None:
                    mem.close()
        if not names:
            names = self._names_of_remote(step) if tier == "remote" else names
        if not names:
            names = (os.path.join(self.root, f"ckptstore-step={step}.ckpt"),)
        for n in names:
            if not self._refers(n, step):
                stub = None
                try:
                    stub = read_stub(n)
                except ValueError:
                    pass
                if stub is None and os.path.exists(n):
                    continue                         # a regular file in the way: leave it alone
                write_stub(n, self._root_id, step)
        ordered = sorted(names, key=lambda n: (not os.path.basename(n).startswith("last"), n))
        for n in ordered:
            if self._refers(n, step):
                return n
        return None

    def _names_of_remote(self, step: int) -> Tuple[str, ...]:
        view = self._remote_view()
        if view is None:
            return ()
        with view:
            try:
                return tuple(view.commit_info(step).names)
            except (CheckpointError, OSError):
                return ()


# -- FSDP2 / tensor parallel ----------------------------------------------------------------------------------------
class _AppState:
    """The DCP tutorial's pattern: the model and its optimizers through ``get_state_dict`` / ``set_state_dict``, so
    DTensor parameters and optimizer states are saved as this rank's shards and restored in place (resharded)."""

    def __init__(self, model: torch.nn.Module, optimizers: List[torch.optim.Optimizer]):
        self.model, self.optimizers = model, optimizers

    def state_dict(self) -> Dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict
        out: Dict[str, Any] = {"model": get_model_state_dict(self.model)}
        for i, opt in enumerate(self.optimizers):
            out[f"optimizer_{i}"] = get_optimizer_state_dict(self.model, opt)
        return out

    def load_state_dict(self, sd: Mapping[str, Any]) -> None:
        from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_optimizer_state_dict
        set_model_state_dict(self.model, sd["model"])
        for i, opt in enumerate(self.optimizers):
            set_optimizer_state_dict(self.model, opt, sd[f"optimizer_{i}"])


class _RNGTarget:
    """A Stateful for ``Store.restore``: receives this rank's saved RNG state without applying it (``_RNGRestore``
    applies it at the right moment)."""

    def __init__(self) -> None:
        self.loaded: Optional[Mapping[str, Any]] = None

    def state_dict(self) -> Dict[str, Any]:
        return RNGState().state_dict()

    def load_state_dict(self, sd: Mapping[str, Any]) -> None:
        self.loaded = sd


class CkptstoreModelParallelStrategy(ModelParallelStrategy):
    """Lightning's ``ModelParallelStrategy`` (FSDP2 ``fully_shard`` / tensor parallel in ``configure_model``) with
    checkpoints in a ckptstore ``Store``: a collective save on every rank, each rank storing its own shards.

    Args:
        root: the store root; the same path on every rank (a shared disk), or node-local disks.
        remote, storage_options, keep, blocking: as for :class:`CkptstoreCheckpointIO`.
        store_options: other ``ckptstore.Store`` arguments (``collective_timeout``, ``writing``, ...).
        **strategy_kw: ``ModelParallelStrategy``'s (``data_parallel_size``, ``tensor_parallel_size``, ``timeout``,
            ``process_group_backend``, ``save_distributed_checkpoint`` which is ignored: shards are always saved).

    Saved per step: ``{"app": model + optimizers (get_state_dict: DTensors as shards), "rng": RNGState() of each
    rank, "lightning": the rest of Lightning's dict, saved once by rank 0}``; the stub is written by rank 0. Loading
    (``restore_checkpoint_after_setup``) fills the sharded model and optimizer in place from any saved world size and
    mesh and returns the rest of the dict, as Lightning's own ``load_checkpoint`` does. The saved per-rank RNG state is
    restored at ``on_train_start`` when the world size is unchanged (with another world size it cannot map; logged).
    """

    def __init__(self, root, *, remote: Optional[str] = None, storage_options: Optional[Mapping[str, Any]] = None,
                 keep=None, blocking: bool = True, store_options: Optional[Mapping[str, Any]] = None,
                 **strategy_kw):
        strategy_kw.pop("save_distributed_checkpoint", None)
        super().__init__(**strategy_kw)
        self.ckpt_root = os.fspath(root)
        self.remote = remote
        self.storage_options = dict(storage_options or {})
        self.keep = keep
        self.blocking = bool(blocking)
        self.store_options = dict(store_options or {})
        self._root_id = _norm_root(self.ckpt_root)
        self._store: Optional[Store] = None
        self._pending: List[Tuple[Any, str, int]] = []
        self._rng = _RNGRestore()

    @property
    def store(self) -> Store:
        """The store, opened collectively at first use (every rank)."""
        if self._store is None:
            self._store = Store(self.ckpt_root, remote=self.remote, storage_options=self.storage_options,
                                keep=self.keep, **self.store_options)
        return self._store

    def _flush_stubs(self, wait: bool = True) -> None:
        """As :meth:`CkptstoreCheckpointIO._flush_stubs`; every rank waits for its save, rank 0 writes stubs."""
        install = self._install_stub if self.global_rank == 0 else (lambda path, step: None)
        self._pending = _flush_pending(self._pending, wait, install)

    def _install_stub(self, name: str, step: int) -> None:
        try:
            prev = read_stub(name)
        except ValueError:
            prev = None
        write_stub(name, self._root_id, step)
        if prev is not None and prev["step"] != step and _norm_root(prev["root"]) == self._root_id:
            self._release(prev["step"], name)

    def _release(self, step: int, name: str) -> None:
        store = self.store
        try:
            names = store.commit_info(step).names
        except (CheckpointError, OSError):
            names = ()
        for other in names:
            if other != name:
                try:
                    o = read_stub(other)
                except ValueError:
                    o = None
                if o is not None and o["step"] == step:
                    return
        if step == store.latest_step():
            return
        try:
            store.delete_step(step, remote=True)
        except CheckpointError as e:
            log.info("step %d not deleted: %s", step, e)

    def save_checkpoint(self, checkpoint: Dict[str, Any], filepath, storage_options: Optional[Any] = None) -> None:
        """Collective: every rank saves its shards of the model and optimizers, its RNG state, and rank 0 the rest
        of ``checkpoint``, as step ``checkpoint["global_step"]`` named ``filepath``; rank 0 then writes the stub."""
        if storage_options is not None:
            raise TypeError(f"{type(self).__name__}.save_checkpoint takes no storage_options")
        name = os.fspath(self.broadcast(os.fspath(filepath)))
        step = checkpoint.get("global_step")
        if isinstance(step, bool) or not isinstance(step, int):
            raise TypeError(f"checkpoint['global_step'] must be an int, got {type(step).__name__} (saving {name})")
        rest = {k: v for k, v in checkpoint.items() if k not in ("state_dict", "optimizer_states")}
        if self.global_rank == 0:
            _warn_hazard(self, rest, saving=True)
        state = {"app": _AppState(self.model, [getattr(o, "_optimizer", o) for o in self.optimizers]),
                 "rng": RNGState(), "lightning": sanitize_checkpoint(rest)}
        store = self.store
        self._flush_stubs(wait=True)
        kw = dict(metrics=_metrics_of(checkpoint), names=[name], replicated=["lightning"])
        out = store.save(state, step, blocking=self.blocking, **kw)
        if out is None:                          # memory=: a step due for no tier is not saved, and gets no stub
            log.debug("step %d is due for no tier of the store: not saved, no stub at %s", step, name)
        elif self.blocking:
            if self.global_rank == 0:
                self._install_stub(name, step)
        else:
            self._pending.append((out, name, step))

    def load_checkpoint(self, checkpoint_path, weights_only: Optional[bool] = None) -> Dict[str, Any]:
        """Collective: restore the step the stub at ``checkpoint_path`` names into the sharded model and optimizers
        in place (resharding from any saved world size) and return the rest of Lightning's dict. A path that is a
        checkpoint of Lightning's own format goes to ``ModelParallelStrategy.load_checkpoint`` (with
        ``weights_only=True``)."""
        self._flush_stubs(wait=True)
        name = os.fspath(self.broadcast(os.fspath(checkpoint_path)))
        found = None
        if self.global_rank == 0:
            stub = read_stub(name)
            if stub is not None and _norm_root(stub["root"]) != self._root_id:
                raise ValueError(f"{name} is a stub of another store ({stub['root']}), this strategy writes to "
                                 f"{self._root_id}")
            found = ["stub", stub["step"]] if stub is not None else (["native", None] if os.path.exists(name)
                                                                       else ["name", None])
        kind, step = self.broadcast(found)
        if kind == "native":
            return super().load_checkpoint(checkpoint_path, weights_only=True)
        store = self.store
        if kind == "name":
            step = store.find(name) if self.global_rank == 0 else None
            step = self.broadcast(step)
            if step is None:
                raise FileNotFoundError(f"no checkpoint at {name}: no stub, and no committed step of "
                                        f"{self.ckpt_root} is named so")
        rng = _RNGTarget()
        state = {"app": _AppState(self.model, [getattr(o, "_optimizer", o) for o in self.optimizers]), "rng": rng,
                 "lightning": {}}
        store.restore(state, step, rank_local="fresh")
        if self.global_rank == 0:
            _warn_hazard(self, state["lightning"], saving=False)
        if rng.loaded is not None:
            self._rng.arrive(rng.loaded, defer=True, have_train_start=True)
        else:
            log.warning("step %d was saved by another world size: the per-rank RNG states are not restored", step)
        return state["lightning"]

    def on_train_start(self) -> None:
        super().on_train_start()
        self._rng.apply()

    def remove_checkpoint(self, filepath) -> None:
        """Rank 0 removes the stub; the step is deleted (locally and remotely, on rank 0's store) when no other stub
        names it and it is not the newest committed step."""
        if self.global_rank != 0:
            return
        self._flush_stubs(wait=True)
        name = os.fspath(filepath)
        stub = read_stub(name)
        if stub is None:
            if os.path.exists(name):
                return super().remove_checkpoint(filepath)
            return
        os.unlink(name)
        self._release(stub["step"], name)

    def teardown(self) -> None:
        """Flush: wait for the save in flight and the uploads, write pending stubs, close the store; then
        ``ModelParallelStrategy.teardown`` (which does not call the CheckpointIO's teardown)."""
        self._rng.cancel()
        try:
            self._flush_stubs(wait=True)
        finally:
            store, self._store = self._store, None
            try:
                if store is not None:
                    store.close()
            finally:
                super().teardown()

    def resume_path(self) -> Optional[str]:
        """As :meth:`CkptstoreCheckpointIO.resume_path` (call it on every rank before ``fit``; the answer is read
        without a process group, one read-only store per rank)."""
        io = CkptstoreCheckpointIO(self.ckpt_root, remote=self.remote, storage_options=self.storage_options)
        return io.resume_path()
