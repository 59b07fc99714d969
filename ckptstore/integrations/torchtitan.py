"""ckptstore under torchtitan: :class:`CkptstoreCheckpointManager`, a drop-in for torchtitan's DCP
``CheckpointManager`` (torchtitan 0.3.x).

torchtitan picks its checkpoint manager by the *type* of ``Trainer.Config.checkpoint`` (there is no string
registry): ``Configurable`` wires ``CkptstoreCheckpointManager.Config.build(...)`` to this class, so a config
function that sets ``cfg.checkpoint = CkptstoreCheckpointManager.Config(enable=True, ...)`` is all it takes::

    # my_configs.py;  torchrun ... -m torchtitan.train --module my_configs --config llama3_ckptstore
    from torchtitan.models.llama3.config_registry import llama3_debugmodel
    from ckptstore.integrations.torchtitan import CkptstoreCheckpointManager

    def llama3_ckptstore():
        cfg = llama3_debugmodel()
        cfg.checkpoint = CkptstoreCheckpointManager.Config(
            enable=True, folder="checkpoint", interval=100, keep_latest_k=3,
            remote="s3://bucket/run1", last_save_model_only=False)
        return cfg

With the memory tier (``ckptstore.Memory``): ``memory_root="/dev/shm/run1"`` (node-local tmpfs) saves every
``interval`` steps to memory and promotes every ``memory_disk_every``-th step to ``folder`` (and from there to
``remote``); resume takes the newest step the nodes' memory roots hold, else the disk / remote one::

        cfg.checkpoint = CkptstoreCheckpointManager.Config(
            enable=True, folder="checkpoint", interval=1, memory_root="/dev/shm/run1", memory_disk_every=50)

What is saved per step (one ckptstore commit, every rank collectively): ``model`` (torchtitan's
``ModelWrapper``: the flat model state dict, FSDP2/TP parameters as DTensor shards), ``optimizer`` (the
``OptimizersContainer``'s flat state dict), ``lr_scheduler``, ``dataloader`` (per dp rank: rank-local) and
whatever the trainer passes in ``states`` (``train_state``: step and tokens seen).

The base class (``BaseCheckpointManager``) owns the public ``load / save / maybe_wait_for_staging /
maybe_wait_for_saving / close`` and dispatches to the ``_``-hooks overridden here; this module checks at import
that the installed torchtitan has them (else ``ImportError`` naming what is missing).
"""
from __future__ import annotations

import dataclasses
import json
import logging
import os
from dataclasses import dataclass
from typing import Any, Dict, List, Optional

import torch

from ckptstore import CheckpointError, Memory, Retention, Store

SUPPORTED_VERSIONS = "torchtitan >=0.3,<0.4"

try:
    from torchtitan.components.checkpointer import base as _tt_base
except ImportError as e:  # pragma: no cover - depends on the environment
    raise ImportError(f"ckptstore.integrations.torchtitan needs {SUPPORTED_VERSIONS} "
                      f"(pip install 'ckptstore[torchtitan]'): {e}") from e

#: hooks of ``BaseCheckpointManager`` this class implements, and the public methods that dispatch to them
HOOKS = ("_load", "_save", "_maybe_wait_for_staging", "_wait_for_saving", "_close")
PUBLIC = ("load", "save", "maybe_wait_for_staging", "maybe_wait_for_saving", "close")
#: ``BaseCheckpointManager.Config`` fields this class reads
CONFIG_FIELDS = ("enable", "folder", "interval", "keep_latest_k", "load_step", "load_only", "initial_load_path",
                 "initial_load_model_only", "initial_load_in_hf", "last_save_model_only", "last_save_in_hf",
                 "export_dtype", "exclude_from_loading", "enable_first_step_checkpoint", "create_seed_checkpoint")
#: names of the state entries, as torchtitan's own manager uses them
STATE_NAMES = ("MODEL", "OPTIMIZER", "LR_SCHEDULER", "DATALOADER", "TRAIN_STATE")
#: the name a model-only step (the last step under ``last_save_model_only``, a seed checkpoint) carries
MODEL_ONLY = "model-only"


def check_torchtitan(base_module=_tt_base) -> None:
    """Raise ``ImportError`` naming what this adapter needs and ``base_module`` (torchtitan's
    ``components/checkpointer/base.py``) lacks: the class, its hooks and public methods, its Config fields,
    ``ModelWrapper`` and the state-name constants."""
    missing: List[str] = []
    base = getattr(base_module, "BaseCheckpointManager", None)
    if base is None:
        missing.append("BaseCheckpointManager")
    else:
        missing += [f"BaseCheckpointManager.{n}" for n in HOOKS + PUBLIC if not callable(getattr(base, n, None))]
        cfg = getattr(base, "Config", None)
        names = {f.name for f in dataclasses.fields(cfg)} if cfg is not None and dataclasses.is_dataclass(cfg) \
            else set()
        missing += [f"BaseCheckpointManager.Config.{n}" for n in CONFIG_FIELDS if n not in names]
    missing += [n for n in ("ModelWrapper",) + STATE_NAMES if not hasattr(base_module, n)]
    if missing:
        raise ImportError(f"ckptstore.integrations.torchtitan supports {SUPPORTED_VERSIONS}; the installed "
                          f"torchtitan lacks {', '.join(missing)}")


check_torchtitan()

BaseCheckpointManager = _tt_base.BaseCheckpointManager
ModelWrapper = _tt_base.ModelWrapper
MODEL, OPTIMIZER, LR_SCHEDULER, DATALOADER = (_tt_base.MODEL, _tt_base.OPTIMIZER, _tt_base.LR_SCHEDULER,
                                              _tt_base.DATALOADER)

log = logging.getLogger("ckptstore.torchtitan")

_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}
RANK_LOCAL = ("error", "fresh")


class DataLoaderState:
    """torchtitan's dataloader as saved: its own ``state_dict()`` (``{"dp_rank_<r>": ..., "world_size": dp}``).
    With ``rank_local="fresh"``, a state saved under another dp degree (its ``world_size`` differs from this
    run's) leaves the loader as it is, starting its data over, instead of torchtitan's assertion; ckptstore
    has then kept this run's values for the per-rank keys and loaded the saved ``world_size``."""

    def __init__(self, dataloader, fresh: bool):
        self.dataloader, self.fresh = dataloader, fresh

    def state_dict(self) -> Dict[str, Any]:
        return self.dataloader.state_dict()

    def load_state_dict(self, sd: Dict[str, Any]) -> None:
        if self.fresh and isinstance(sd, dict) and "world_size" in sd:
            here = self.dataloader.state_dict().get("world_size")
            if sd["world_size"] != here:
                log.warning("dataloader state saved with dp world size %s, this run has %s: the data loader "
                            "starts over (rank_local='fresh')", sd["world_size"], here)
                return
        self.dataloader.load_state_dict(sd)


class CkptstoreCheckpointManager(BaseCheckpointManager):
    """torchtitan's checkpoint manager, backed by a :class:`ckptstore.Store`.

    How the base ``Config`` maps (fields not listed act as in torchtitan's DCP manager):

    - ``folder`` (joined to the trainer's ``dump_folder``): the store's local root (one root for every rank).
    - ``interval``, ``enable_first_step_checkpoint``, ``load_only``: when ``save`` writes, as torchtitan's.
    - ``keep_latest_k``: ``Retention(last=keep_latest_k)`` locally and on the remote (``0`` keeps all). ``1`` is
      allowed: ckptstore never deletes the newest committed step nor the step being saved.
    - ``load_step=-1``: :meth:`Store.resume` (newest valid step over the local root and the remote, falling back
      past damaged ones; then ``initial_load_path``); ``load_step=N``: :meth:`Store.restore` of exactly N.
    - ``initial_load_path``: ckptstore's ``load_path`` (a ckptstore store URL, ``<URL>/steps/<N>``, or
      Hub-format safetensors with torchtitan's key names), used only while the run has no step of its own;
      ``initial_load_model_only`` -> ``load_components=("model",)``.
    - ``last_save_model_only``: the last step holds only ``model`` in ``export_dtype``, named ``"model-only"``
      (as is a step 0 seed checkpoint). Loading such a step restores the model only; ``load(-1)`` refuses a
      model-only newest step > 0 (the run finished: training from step 0 again would rewind it).
    - ``exclude_from_loading``: those entries keep this run's values (their keys must exist).
    - ``memory_root`` (with ``memory_disk_every``, ``memory_keep``, ``memory_replicas``, ``memory_capacity``):
      ``Store(memory=Memory(memory_root, every=interval, disk_every=..., keep=..., replicas=..., capacity=...))``.
      ``interval`` is then the memory cadence; a step due for no tier (the last step or the first-step
      checkpoint off the ``interval`` grid) is not saved (logged; ``save`` returns ``False``). ``load_step=-1``
      resumes the newest memory step held whole by the nodes (rebuilt from peers after a node loss) when it is
      newer than every disk step.
    - non-blocking saves (``nonblocking=True``): ``save`` returns once every changed tensor is copied to
      staging memory, which ends the training-visible stall (``maybe_wait_for_staging`` has nothing left to
      wait for); ``maybe_wait_for_saving`` waits for the commit (``save_future`` is the ckptstore
      ``SaveHandle``) and raises its error; ``close`` closes the store (waits for the save and the uploads).

    Not supported (``ValueError`` from the Config): ``last_save_in_hf`` (use ``ckptstore export``),
    ``initial_load_in_hf`` (torchtitan's HF key conversion; ckptstore's Hub loading takes the keys as they are).
    """

    @dataclass(kw_only=True, slots=True)
    class Config(BaseCheckpointManager.Config):
        remote: Optional[str] = None
        """Remote store URL (``s3://bucket/run``, ``gs://...``, any fsspec URL): every committed step is uploaded
        in the background, and resume falls back to it when the local folder lacks a valid step."""

        storage_options_json: Optional[str] = None
        """fsspec storage options of ``remote`` (and of ``initial_load_path``) as a JSON object string, e.g.
        ``'{"endpoint_url": "http://127.0.0.1:9000"}'``. Credentials are better left to the environment."""

        keep_every: Optional[int] = None
        """Also keep every ``keep_every``-th step (``Retention(every=...)``), besides the newest
        ``keep_latest_k``."""

        nonblocking: bool = True
        """Save in the background: the training stall is the copy of the changed tensors into staging memory."""

        rank_local: str = "error"
        """What resume does with rank-local values (the dataloader's per-dp-rank state) saved by another world
        size: ``"error"`` raises ``IncompatibleCheckpointError`` naming them, ``"fresh"`` keeps this run's."""

        on_rewind: str = "error"
        """Saving a step older than the newest committed one (after ``load_step`` picked an older step):
        ``"error"`` raises, ``"truncate"`` drops the newer steps first (see ``ckptstore.Store``)."""

        collective_timeout: float = 600.0
        """Seconds a rank waits for the others in a collective save or load before naming the missing ones."""

        memory_root: Optional[str] = None
        """The memory tier's root (``ckptstore.Memory.root``): a node-local RAM-backed directory
        (``/dev/shm/<run>``), the same path on every rank of a node. ``None``: no memory tier. Saves then go to
        memory every ``interval`` steps (``Memory.every``)."""

        memory_disk_every: Optional[int] = None
        """Promote every step that is a multiple of it to ``folder`` (and the remote): ``Memory.disk_every``, a
        multiple of ``interval``. ``None``: nothing reaches the disk."""

        memory_keep: int = 2
        """Committed memory steps kept (``Memory.keep``)."""

        memory_replicas: int = 1
        """Peers on other nodes holding each node's part of a memory step (``Memory.replicas``)."""

        memory_capacity: Optional[int] = None
        """Bytes the memory root may hold (``Memory.capacity``); ``None``: bounded by ``memory_keep`` only."""

        def __post_init__(self) -> None:
            # torchtitan rejects keep_latest_k=1 ("the last one may be in the process of being saved"); ckptstore
            # never deletes the step being saved nor the newest committed one, so 1 is safe here.
            k = self.keep_latest_k
            if k == 1:
                self.keep_latest_k = 2
            try:
                BaseCheckpointManager.Config.__post_init__(self)
            finally:
                self.keep_latest_k = k
            if self.last_save_in_hf:
                raise ValueError("checkpoint.last_save_in_hf is not supported by CkptstoreCheckpointManager: "
                                 "export weights with `ckptstore export URL OUT.safetensors --key model`")
            if self.initial_load_in_hf:
                raise ValueError("checkpoint.initial_load_in_hf is not supported by CkptstoreCheckpointManager "
                                 "(torchtitan's HF key conversion); initial_load_path may name a ckptstore store")
            if self.rank_local not in RANK_LOCAL:
                raise ValueError(f"checkpoint.rank_local must be one of {RANK_LOCAL}, got {self.rank_local!r}")
            if self.keep_every is not None and (isinstance(self.keep_every, bool) or
                                                not isinstance(self.keep_every, int) or self.keep_every < 1):
                raise ValueError(f"checkpoint.keep_every must be a positive int or None, got {self.keep_every!r}")
            self.storage_options()          # raises on bad JSON
            self.memory()                   # raises on bad memory_* values

        def memory(self) -> Optional[Memory]:
            """The ``memory_*`` fields as a :class:`ckptstore.Memory` (``every=interval``), or ``None`` without
            ``memory_root``. Raises ``ValueError`` as ``Memory`` does (e.g. ``memory_disk_every`` not a multiple
            of ``interval``)."""
            if not self.memory_root:
                return None
            return Memory(self.memory_root, every=self.interval, disk_every=self.memory_disk_every,
                          keep=self.memory_keep, replicas=self.memory_replicas, capacity=self.memory_capacity)

        def storage_options(self) -> Optional[Dict[str, Any]]:
            """``storage_options_json`` parsed (``None`` when unset); ``ValueError`` unless a JSON object."""
            if not self.storage_options_json:
                return None
            try:
                opts = json.loads(self.storage_options_json)
            except ValueError as e:
                raise ValueError(f"checkpoint.storage_options_json is not valid JSON: {e}") from None
            if not isinstance(opts, dict):
                raise ValueError("checkpoint.storage_options_json must be a JSON object, got "
                                 f"{type(opts).__name__}")
            return opts

    def __init__(self, config: "CkptstoreCheckpointManager.Config", *, dataloader, model_parts, optimizers,
                 lr_schedulers, states: Dict[str, Any], sd_adapter=None, base_folder: str = "") -> None:
        self.enable = config.enable
        self.save_future = None
        self.store: Optional[Store] = None
        if not self.enable:
            return
        self.config = config
        self.sd_adapter = sd_adapter
        self.folder = config.folder if "://" in config.folder else os.path.join(base_folder, config.folder)
        self.interval = config.interval
        self.states = states
        self.states.update({MODEL: ModelWrapper(model_parts), OPTIMIZER: optimizers, DATALOADER: dataloader,
                            LR_SCHEDULER: lr_schedulers})
        for k, v in list(self.states.items()):
            if v is None:                      # e.g. no dataloader: nothing to save or restore for it
                del self.states[k]
        if DATALOADER in self.states:
            self.states[DATALOADER] = DataLoaderState(dataloader, fresh=config.rank_local == "fresh")
        for k in config.exclude_from_loading:
            if k not in self.states:
                raise ValueError(f"checkpoint.exclude_from_loading names {k!r}, which is not in the state "
                                 f"(keys: {sorted(self.states)})")
        self.export_dtype = _DTYPES[config.export_dtype]
        k = config.keep_latest_k
        keep = Retention(last=k if k > 0 else None, every=config.keep_every, metric=None)
        self.store = Store(self.folder, remote=config.remote, storage_options=config.storage_options(),
                           keep=keep if keep.deletes else None, load_path=config.initial_load_path or None,
                           load_components=(MODEL,) if config.initial_load_path and config.initial_load_model_only
                           else None, on_rewind=config.on_rewind, collective_timeout=config.collective_timeout,
                           memory=config.memory())
        log.info("ckptstore checkpointing to %s%s%s", self.store.root,
                 f" (remote {config.remote})" if config.remote else "",
                 f" behind the memory tier {config.memory_root}" if config.memory_root else "")

    # -- save ----------------------------------------------------------------------------------------------
    def _should_save(self, curr_step: int, last_step: bool = False) -> bool:
        if self.config.load_only:
            return False
        if curr_step == 1 and self.config.enable_first_step_checkpoint:
            return True
        return bool(last_step) or curr_step % self.interval == 0

    @torch.no_grad()
    def _save(self, curr_step: int, last_step: bool = False) -> bool:
        """Save ``curr_step`` when the interval (or ``last_step``, or the first step option) says so; returns
        whether it saved. Collective. The last step under ``last_save_model_only`` (and a step 0 seed
        checkpoint) is saved blocking with the model alone, in ``export_dtype``."""
        if not self._should_save(curr_step, last_step):
            return False
        self.maybe_wait_for_saving()          # the previous save's error surfaces here, as with DCP
        if last_step and self.config.last_save_model_only:
            model = {k: v.to(self.export_dtype) if isinstance(v, torch.Tensor) and v.is_floating_point()
                     and v.dtype != self.export_dtype else v for k, v in self.states[MODEL].state_dict().items()}
            if self.store.save({MODEL: model}, curr_step, names=[MODEL_ONLY]) is None:
                return self._not_due(curr_step)
            log.info("saved a model-only checkpoint (%s) at the last step, step %d", self.config.export_dtype,
                     curr_step)
            return True
        blocking = last_step or not self.config.nonblocking
        out = self.store.save(self.states, curr_step, blocking=blocking)
        if out is None:
            return self._not_due(curr_step)
        if not blocking:
            self.save_future = out
        return True

    def _not_due(self, step: int) -> bool:
        """A step the memory tier's cadence does not save (``Store.save`` returned ``None``)."""
        log.info("step %d is due for no tier of the store (memory every %d, disk every %s): not saved", step,
                 self.store.memory.every, self.store.memory.disk_every)
        return False

    def _maybe_wait_for_staging(self) -> None:
        """Nothing to wait for: a non-blocking ``Store.save`` returns after its staging copy."""

    def _wait_for_saving(self) -> None:
        handle, self.save_future = self.save_future, None
        handle.result()

    def _close(self) -> None:
        if self.store is not None:
            try:
                self.save_future = None
                self.store.close()          # waits for the save in flight and the uploads; raises their errors
            finally:
                self.store = None

    # -- load ----------------------------------------------------------------------------------------------
    def _states_to_load(self, model_only: bool) -> Dict[str, Any]:
        if model_only:
            return {MODEL: self.states[MODEL]}
        return {k: v for k, v in self.states.items() if k not in self.config.exclude_from_loading}

    def _is_model_only(self, step: int) -> bool:
        """Step 0 (a seed checkpoint) and steps named ``model-only`` hold the model alone."""
        if step == 0:
            return True
        try:
            return MODEL_ONLY in self.store.commit_info(step).names
        except (CheckpointError, OSError):       # not in the local root: a step only the remote holds
            return self.store.find(MODEL_ONLY) == step

    @torch.no_grad()
    def _load(self, step: int = -1) -> bool:
        """``step=-1``: the newest valid step (local, remote, then ``initial_load_path``), else ``step``
        exactly. Returns whether anything was loaded. Collective.

        Raises ``FileNotFoundError`` (``step`` is not committed), ``CorruptCheckpointError`` (``step`` is
        damaged), ``IncompatibleCheckpointError`` (keys, shapes, rank-local values of another world size),
        ``CheckpointError`` (the newest step is the model-only last step of a finished run)."""
        store, rank_local = self.store, self.config.rank_local
        if step != -1:
            model_only = self._is_model_only(step)
            state = self._states_to_load(model_only)
            store.restore(state, step, keys=list(state), rank_local=rank_local)
            log.info("loaded step %d%s", step, " (model only)" if model_only else "")
            return True
        found = store.resolve()
        if found is None:
            log.info("no checkpoint in %s: fresh start", store.root)
            return False
        s, tier = found
        if tier != "load_path" and self._is_model_only(s):
            if s != 0:
                raise CheckpointError(
                    f"the newest step {s} in {store.root} is the model-only last step of a finished run "
                    "(last_save_model_only=True): nothing to resume. Set checkpoint.load_step to an older "
                    "step, or last_save_model_only=False for runs that continue past their last step")
            store.restore(self._states_to_load(True), s, keys=[MODEL], rank_local=rank_local)
            log.info("loaded the model of the seed checkpoint (step 0)")
            return True
        state = self._states_to_load(False)
        store.resume(state, strict=not self.config.exclude_from_loading, rank_local=rank_local)
        log.info("resumed from %s", store.resumed_from)
        return store.resumed_from is not None
