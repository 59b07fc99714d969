"""ckptstore under the Hugging Face ``transformers.Trainer`` (transformers >= 5, < 6).

    from ckptstore.integrations.transformers import CkptstoreTrainer

    trainer = CkptstoreTrainer(model=model, args=args, train_dataset=ds,
                               store="ckpt/run1", remote="s3://bucket/run1")   # other Store kwargs pass through
    trainer.train(resume_from_checkpoint="auto")   # newest valid step, local then remote; else a fresh start
    trainer.store.close()                          # waits for the uploads, raises their errors

With the memory tier, every checkpoint HF asks for goes to RAM and every ``disk_every``-th to the store root
(``save_steps=1`` saves every step to memory; ``Store`` kwargs pass through, ``memory=`` included)::

    trainer = CkptstoreTrainer(model=model, args=TrainingArguments(..., save_steps=1), train_dataset=ds,
                               store="ckpt/run1", memory=Memory("/dev/shm/run1", every=1, disk_every=50))
    trainer.train(resume_from_checkpoint="auto")   # the newest memory step when it is newer than every disk step

``CkptstoreTrainerMixin`` goes first in the bases of any ``Trainer`` subclass (TRL's ``SFTTrainer`` ...):
``class MyTrainer(CkptstoreTrainerMixin, SFTTrainer)``. HF still decides *when* to save (``save_strategy``,
``save_steps``, ``"best"``); every checkpoint it asks for becomes one ckptstore step numbered
``state.global_step``, holding:

- ``"model"``: the (unwrapped) model's ``state_dict``;
- ``"optimizer"``, ``"scheduler"`` and, when mixed precision uses one, ``"scaler"`` (not with
  ``save_only_model``);
- ``"rng"``: :class:`ckptstore.RNGState` of each rank (Python, NumPy, torch CPU, current CUDA device), the
  generators HF's ``_save_rng_state`` saves (not with ``save_only_model``);
- ``"trainer_state"``: ``dataclasses.asdict(trainer.state)`` with the ``ExportableState`` callbacks' states in
  ``stateful_callbacks``, as HF writes ``trainer_state.json``;
- ``"ckptstore_hf"``: which of the above the step holds, and the world size that saved it.

The commit's ``metrics`` hold the last logged training ``loss`` and, when this step was evaluated, the
``metric_for_best_model`` value (under HF's ``eval_``-prefixed name). Under DDP the save is collective (HF
calls ``_save_checkpoint`` on every rank): rank 0 alone saves the replicated keys, each rank its own RNG.

``TrainingArguments`` keep their meaning: ``save_total_limit=N`` -> ``Retention(last=N)`` (also on the remote);
with ``metric_for_best_model`` the best step is kept too (``Retention(best=1, metric=..., mode=...)`` from
``greater_is_better``); ``load_best_model_at_end`` loads the best step's model from the store;
``state.best_model_checkpoint`` is that step's URL ``<store root>/steps/<N>``. With ``memory=`` (a
:class:`ckptstore.Memory`), HF's saves go to the memory tier at its cadence (a save of a step due for no tier
writes nothing); the best model is then the best of the steps that reach the disk (every ``disk_every``-th:
memory steps are dropped after ``Memory.keep``), so ``best_model_checkpoint`` and ``load_best_model_at_end``
name the best disk step, while ``state.best_metric`` stays HF's best over every evaluation.

Not supported: DeepSpeed and FSDP (``NotImplementedError`` at construction), hyper-parameter search trials
(saved by HF's own code, with a warning), per-checkpoint ``push_to_hub`` (warned once; the final
``push_to_hub()`` still works). Only the private ``Trainer`` methods named in ``OVERRIDDEN`` are replaced; the
module checks at import that they exist.
"""
from __future__ import annotations

import dataclasses
import inspect
import json
import logging
import os
import re
from typing import Any, Dict, Mapping, Optional, Tuple

import transformers
from transformers import Trainer
from transformers.trainer_callback import ExportableState

from ckptstore import RNGState, Retention, Store

__all__ = ["CkptstoreTrainerMixin", "CkptstoreTrainer", "OVERRIDDEN", "SUPPORTED"]

log = logging.getLogger("ckptstore.integrations.transformers")

#: the transformers versions this adapter supports (the extra ``ckptstore[transformers]`` pins them)
SUPPORTED = ">=5,<6"
#: the ``Trainer`` methods this adapter overrides or calls (private ones included): checked at import
OVERRIDDEN = ("train", "_save_checkpoint", "_load_from_checkpoint", "_load_optimizer_and_scheduler",
              "_load_scaler", "_load_rng_state", "_load_best_model", "_init_training_state", "store_flos")

_RESUME_DIR = ".ckptstore-resume"
_STEP_URL = re.compile(r"^(?P<store>.+?)/+steps/+(?P<step>[0-9]{1,12})/*$")
#: Store keyword arguments the trainer's constructor passes through (besides store=, remote=, storage_options=)
_STORE_ARGS = tuple(n for n in inspect.signature(Store.__init__).parameters
                    if n not in ("self", "root", "remote", "storage_options"))


def _check_transformers(trainer_cls=Trainer, version: str = transformers.__version__) -> None:
    """Raise ``ImportError`` unless ``version`` is in ``SUPPORTED`` and ``trainer_cls`` has every method of
    ``OVERRIDDEN``."""
    try:
        major = int(str(version).split(".")[0])
    except ValueError:
        major = -1
    missing = [m for m in OVERRIDDEN if not callable(getattr(trainer_cls, m, None))]
    if major != 5 or missing:
        why = f"lacks {', '.join(missing)}" if missing else "is not supported"
        raise ImportError(f"ckptstore.integrations.transformers needs transformers{SUPPORTED}, whose Trainer has "
                          f"{', '.join(OVERRIDDEN)}; the installed transformers {version} {why} "
                          "(pip install 'ckptstore[transformers]')")


_check_transformers()


@dataclasses.dataclass
class _Resume:
    """The store step ``train()`` resumes from and the local dir HF reads ``trainer_state.json`` from."""
    step: int
    dir: str
    keys: Tuple[str, ...]
    world_size: int
    best_model_checkpoint: Optional[str]
    #: the step's values when it was resumed whole (a memory step, read by ``Store.resume``): applied by the
    #: ``_load_*`` overrides instead of ``Store.restore`` of each group of keys
    loaded: Optional[Dict[str, Any]] = None


def _plain(obj: Any) -> Any:
    """JSON fallback for numpy scalars / arrays and tensors restored into ``trainer_state``."""
    if hasattr(obj, "tolist"):
        return obj.tolist()
    if isinstance(obj, bytes):
        return obj.decode("utf-8", "replace")
    raise TypeError(f"trainer_state holds a {type(obj).__name__}, which trainer_state.json cannot hold")


class CkptstoreTrainerMixin:
    """Put first in the bases of a ``transformers.Trainer`` subclass; see the module docstring.

    Keyword arguments (the rest go to the trainer):
        store: a :class:`ckptstore.Store`, or its root (local path or URL). Default
            ``<args.output_dir>/ckptstore``.
        remote, storage_options: the Store's remote URL and fsspec options (only with a root, not a Store).
        ckptstore_blocking: ``False`` makes each save non-blocking (training waits only for the copy of the
            state into staging memory; ``train()`` waits for the last save before it returns).
        Store keyword arguments (``keep=``, ``writing=``, ``config=``, ``load_path=``, ``memory=`` ...): passed
            to ``Store``; ``keep`` defaults to the retention ``TrainingArguments`` ask for.

    Attributes: ``store``, the :class:`ckptstore.Store` (close it when done: ``trainer.store.close()``);
    ``resumed_step``, the store step the last ``train()`` resumed from (``None``: a fresh start or HF's own
    checkpoint directory).

    Raises ``NotImplementedError`` under DeepSpeed or FSDP, ``ValueError`` for Store arguments given with a
    ready ``Store``, and ``ValueError`` naming both sides when the Store's rank / world size differ from
    ``TrainingArguments``' ``process_index`` / ``world_size`` (e.g. torchrun on CPU without ``use_cpu=True``).
    """

    def __init__(self, *args, store: Any = None, remote: Any = None,
                 storage_options: Optional[Mapping[str, Any]] = None, ckptstore_blocking: bool = True,
                 **kwargs):
        store_kwargs = {k: kwargs.pop(k) for k in list(kwargs) if k in _STORE_ARGS}
        super().__init__(*args, **kwargs)
        if getattr(self, "is_deepspeed_enabled", False) or getattr(self, "is_fsdp_enabled", False):
            raise NotImplementedError(
                "ckptstore.integrations.transformers supports single-process and DDP training; DeepSpeed and FSDP "
                "are not supported (their sharded optimizer state is saved by accelerate's own code): use the "
                "plain Trainer, or ckptstore's Store with the AppState pattern (README, 'Distributed')")
        self._ckpt_blocking = bool(ckptstore_blocking)
        self._ckpt_resume: Optional[_Resume] = None
        self.resumed_step: Optional[int] = None
        self._ckpt_warned_push = False
        if isinstance(store, Store):
            extra = [k for k, v in (("remote", remote), ("storage_options", storage_options)) if v is not None]
            extra += sorted(store_kwargs)
            if extra:
                raise ValueError(f"store= is a ready Store: pass {extra} to Store(...) instead")
            self._ckpt_check_processes(store)
            self.store = store
            self._ckpt_remote_url = getattr(getattr(store, "remote_storage", None), "url", None)
            return
        root = os.fspath(store) if store is not None else os.path.join(self.args.output_dir, "ckptstore")
        if "keep" not in store_kwargs:
            store_kwargs["keep"] = self._ckpt_retention()
        opened = Store(root, remote=remote, storage_options=storage_options, **store_kwargs)
        try:
            self._ckpt_check_processes(opened)
        except ValueError:
            opened.close()
            raise
        #: the ckptstore.Store every checkpoint goes to
        self.store = opened
        self._ckpt_remote_url = getattr(self.store.remote_storage, "url", None)

    def _ckpt_check_processes(self, store: Store) -> None:
        """Raise ``ValueError`` naming both sides when the Store's rank / world size differ from the process
        index / world size ``TrainingArguments`` give (what HF trains with): a save would then be collective over
        processes that HF trains independently (each believing it is the only one), or the reverse, and hang or
        write one step from unrelated processes.

        The common cause (transformers 5, accelerate 1.x): ``torchrun`` on CPU without
        ``TrainingArguments(use_cpu=True)``. accelerate's ``PartialState`` then opens the torch.distributed
        process group (world size N) but reports ``DistributedType.NO``, so ``args.parallel_mode`` is
        ``NOT_PARALLEL``, ``args.world_size`` is 1 and every process is ``process_index`` 0, while the Store (rank
        and world size from the process group) saves collectively over N ranks."""
        hf = (int(self.args.process_index), int(self.args.world_size))
        mine = (int(store.rank), int(store.world_size))
        if hf == mine:
            return
        import torch.distributed as dist
        group = dist.get_world_size() if dist.is_available() and dist.is_initialized() else None
        mode = getattr(self.args.parallel_mode, "name", self.args.parallel_mode)
        seen = (f"a torch.distributed process group of {group} ranks is initialised" if group is not None
                else "no torch.distributed process group is initialised")
        fix = (" On CPU under torchrun, pass TrainingArguments(use_cpu=True): accelerate then trains the ranks as "
               "one DDP job over gloo (without it, accelerate opens the process group but reports "
               "DistributedType.NO, and HF trains independent copies)." if group is not None and hf[1] == 1 else "")
        raise ValueError(
            f"ckptstore: transformers and the Store disagree about this process: TrainingArguments give "
            f"process_index {hf[0]} of world_size {hf[1]} (parallel_mode {mode}), the Store is rank {mine[0]} of "
            f"{mine[1]} ({seen}); a save would be collective over processes HF does not train together: it "
            f"would hang, or commit steps assembled from independently trained processes.{fix} To train separate "
            f"processes on purpose, give each its own "
            f"store=Store(<its own root>, rank={hf[0]}, world_size={hf[1]}).")

    # -- mapping TrainingArguments ------------------------------------------------------------------------
    def _ckpt_metric(self) -> Optional[str]:
        """The metric HF judges "best" by, as it appears in the eval logs (``eval_`` prefixed), or ``None``."""
        m = self.args.metric_for_best_model
        if not m:
            return None
        return m if m.startswith("eval_") else f"eval_{m}"

    def _ckpt_retention(self) -> Optional[Retention]:
        """``save_total_limit`` / ``metric_for_best_model`` / ``greater_is_better`` as a Retention (or None)."""
        limit, metric = self.args.save_total_limit, self._ckpt_metric()
        if limit is not None and limit <= 0:
            limit = None
        if metric is None:
            return Retention(last=limit, metric=None) if limit is not None else None
        mode = "max" if self.args.greater_is_better else "min"
        return Retention(last=limit, best=1 if limit is not None else None, metric=metric, mode=mode)

    def _ckpt_step_url(self, step: int) -> str:
        return f"{self.store.root}/steps/{step}"

    def _ckpt_step_of(self, url: Any) -> Optional[int]:
        """The step of a step URL ``"<store>/steps/<N>"`` (any store root: a resumed run may have its local root
        elsewhere), or ``None`` for anything else (an HF checkpoint dir)."""
        m = _STEP_URL.match(url) if isinstance(url, str) else None
        return int(m.group("step")) if m else None

    def _ckpt_parse_step_url(self, url: str) -> Optional[int]:
        """The step of ``"<this store's root or remote URL>/steps/<N>"``; ``ValueError`` for another store's."""
        step = self._ckpt_step_of(url)
        if step is None:
            return None
        base = _STEP_URL.match(url).group("store").rstrip("/")
        mine = {str(self.store.root).rstrip("/")}
        if self._ckpt_remote_url:
            mine.add(self._ckpt_remote_url.rstrip("/"))
        if base not in mine and os.path.abspath(base) not in mine:
            raise ValueError(f"resume_from_checkpoint={url!r} names a step of another store than this trainer's "
                             f"({sorted(mine)})")
        return step

    # -- saving -------------------------------------------------------------------------------------------
    def _ckpt_state(self, full: bool) -> Dict[str, Any]:
        state: Dict[str, Any] = {"model": self.model}
        if full:
            if self.optimizer is not None:
                state["optimizer"] = self.optimizer
            if self.lr_scheduler is not None:
                state["scheduler"] = self.lr_scheduler
            scaler = getattr(self.accelerator, "scaler", None)
            if scaler is not None:
                state["scaler"] = scaler
            state["rng"] = RNGState()
        state["trainer_state"] = dataclasses.asdict(self.state)
        state["ckptstore_hf"] = {"keys": sorted([*state, "ckptstore_hf"]), "world_size": int(self.args.world_size),
                                 "transformers": transformers.__version__}
        return state

    def _ckpt_metrics(self) -> Dict[str, float]:
        """The last logged training loss, and ``metric_for_best_model`` when this step was evaluated."""
        step, metric, history = self.state.global_step, self._ckpt_metric(), self.state.log_history
        out: Dict[str, float] = {}
        loss = next((e["loss"] for e in reversed(history) if "loss" in e), None)
        if loss is not None:
            out["loss"] = float(loss)
        if metric is not None:
            value = next((e[metric] for e in reversed(history) if e.get("step") == step and metric in e), None)
            if value is not None:
                out[metric] = float(value)
        return out

    def _save_checkpoint(self, model, trial) -> None:
        """Save this checkpoint as store step ``state.global_step`` (collective under DDP); see the module
        docstring for what a step holds. Raises what ``Store.save`` raises (``CommitError`` under DDP when any
        rank failed; nothing is then committed)."""
        if trial is not None or getattr(self, "hp_search_backend", None) is not None:
            log.warning("hyper-parameter search: trial checkpoints are saved by transformers' own code")
            return super()._save_checkpoint(model, trial)
        self.store_flos()                       # collective under DDP, as in HF's own _save_checkpoint
        step = self.state.global_step
        memory = self.store.memory
        if self._ckpt_metric() is not None:
            if memory is None:
                if self.state.best_global_step == step:
                    self.state.best_model_checkpoint = self._ckpt_step_url(step)
            elif memory.promoted(step):
                self._ckpt_best_on_disk(step)
        for cb in [cb for cb in self.callback_handler.callbacks + [self.control]
                   if isinstance(cb, ExportableState)]:
            name, cb_state = cb.__class__.__name__, cb.state()
            if isinstance(self.state.stateful_callbacks.get(name), list):
                self.state.stateful_callbacks[name].append(cb_state)
            else:
                self.state.stateful_callbacks[name] = cb_state
        state = self._ckpt_state(full=not self.args.save_only_model)
        replicated = [k for k in state if k != "rng"]
        if self.args.push_to_hub and not self._ckpt_warned_push:
            self._ckpt_warned_push = True
            log.warning("push_to_hub: checkpoints go to the ckptstore store, not to the Hub; call "
                        "trainer.push_to_hub() after training")
        out = self.store.save(state, step, metrics=self._ckpt_metrics(), blocking=self._ckpt_blocking,
                              names=[f"checkpoint-{step}"], replicated=replicated)
        if out is None:
            log.debug("step %d is due for no tier of the store (memory every %d, disk every %s): not saved", step,
                      memory.every, memory.disk_every)

    def _ckpt_logged(self, metric: str, step: int) -> Optional[float]:
        """``metric``'s value logged at ``step`` (``state.log_history``), or ``None``."""
        return next((float(e[metric]) for e in reversed(self.state.log_history)
                     if e.get("step") == step and metric in e), None)

    def _ckpt_best_on_disk(self, step: int) -> None:
        """With a memory tier: ``best_model_checkpoint`` becomes disk step ``step`` when its metric beats the
        current best disk step's (HF's rule: strictly greater / less per ``greater_is_better``); memory steps are
        dropped after ``Memory.keep``, so only a disk step can be loaded at the end."""
        metric = self._ckpt_metric()
        value = self._ckpt_logged(metric, step)
        if value is None:
            return
        best = self._ckpt_step_of(self.state.best_model_checkpoint)
        old = self._ckpt_logged(metric, best) if best is not None else None
        if old is None or (value > old if self.args.greater_is_better else value < old):
            self.state.best_model_checkpoint = self._ckpt_step_url(step)

    # -- resuming -----------------------------------------------------------------------------------------
    def train(self, resume_from_checkpoint: Any = None, trial=None, ignore_keys_for_eval=None, **kwargs):
        """HF's ``train`` with ``resume_from_checkpoint`` extended:

        - ``"auto"`` or ``True``: the newest valid step of the store (local, then remote: ``Store.resolve()``);
          else, with ``Store(load_path=...)``, a fresh start from those model weights (a ckptstore step's
          ``"model"`` or Hub-format safetensors); else the newest HF ``checkpoint-N`` dir in ``output_dir``
          holding ``trainer_state.json`` (a run started with the plain Trainer); else a fresh start (HF's own
          ``True`` raises on a first launch);
        - an ``int`` step or ``"<store root or remote URL>/steps/<N>"``: that step (``FileNotFoundError`` when it
          is not committed, ``ValueError`` for another store's URL);
        - any other path: HF's own checkpoint directory, loaded by HF's code (migration).

        Collective under DDP (every rank calls it, as with HF). Returns HF's ``TrainOutput``; waits for a
        non-blocking save in flight before returning (raising its error)."""
        self._ckpt_resume = self.resumed_step = None
        rfc = resume_from_checkpoint
        step: Optional[int] = None
        whole = False
        if rfc is True or rfc == "auto":
            found = self.store.resolve()
            rfc = None
            if found is not None and found[1] != "load_path":
                step, whole = found[0], found[1] == "memory"
            elif found is not None:             # no step of this run: the Store's load_path seeds the model
                self.store.resume({"model": self.model}, strict=False)
                log.info("no step of this run in %s: the model starts from load_path (%s), training from step 0",
                         self.store.root, self.store.resumed_from)
            else:
                rfc = self._ckpt_hf_checkpoint()
                if rfc is None:
                    log.info("no checkpoint in %s: fresh start", self.store.root)
        elif isinstance(rfc, int) and not isinstance(rfc, bool):
            step = rfc
        elif isinstance(rfc, str) and _STEP_URL.match(rfc):
            step = self._ckpt_parse_step_url(rfc)
        if step is not None:
            rfc = self._ckpt_materialise(step, whole=whole)
        try:
            return super().train(resume_from_checkpoint=rfc, trial=trial, ignore_keys_for_eval=ignore_keys_for_eval,
                                 **kwargs)
        finally:
            self.store.wait()

    def _ckpt_hf_checkpoint(self) -> Optional[str]:
        """The newest ``checkpoint-N`` dir of ``output_dir`` that HF itself wrote (has trainer_state.json)."""
        out = self.args.output_dir
        if not out or not os.path.isdir(out):
            return None
        dirs = []
        for name in os.listdir(out):
            m = re.fullmatch(r"checkpoint-([0-9]+)", name)
            if m and os.path.isfile(os.path.join(out, name, "trainer_state.json")):
                dirs.append((int(m.group(1)), os.path.join(out, name)))
        if dirs:
            log.info("no step in %s: resuming from transformers' own %s", self.store.root, max(dirs)[1])
        return max(dirs)[1] if dirs else None

    def _ckpt_materialise(self, step: int, whole: bool = False) -> Optional[str]:
        """Read step ``step``'s trainer state from the store and write it as
        ``<output_dir>/.ckptstore-resume/rank<r>/checkpoint-<step>/trainer_state.json`` (the dir HF's ``train``
        reads it from); the model, optimizer and RNG are restored later by the ``_load_*`` overrides.

        ``whole`` (``resolve()`` chose a memory step, which only ``Store.resume`` reads: it rebuilds a lost
        node's part from peers): every key is read now by ``Store.resume`` into plain values, applied later by
        the ``_load_*`` overrides; should the memory step fail to load, resume falls back to the disk / remote
        step it returns. ``None``: resume found nothing (a fresh start)."""
        loaded: Optional[Dict[str, Any]] = None
        if whole:
            loaded = {k: {} for k in ("model", "optimizer", "scheduler", "scaler", "rng", "trainer_state",
                                      "ckptstore_hf")}
            got = self.store.resume(loaded, strict=False, rank_local="fresh")
            if got is None:
                log.info("no checkpoint of %s loads: fresh start", self.store.root)
                return None
            step, holder = got, loaded
        else:
            holder = {"trainer_state": None, "ckptstore_hf": None}
            self.store.restore(holder, step, keys=list(holder))
        meta, ts = holder.pop("ckptstore_hf"), dict(holder.pop("trainer_state"))
        best = ts.get("best_model_checkpoint")
        if self._ckpt_step_of(best) is not None:   # HF drops a path that is no local dir: set again after that
            ts["best_model_checkpoint"] = None
        d = os.path.abspath(os.path.join(self.args.output_dir, _RESUME_DIR, f"rank{self.args.process_index}",
                                         f"checkpoint-{step}"))
        os.makedirs(d, exist_ok=True)
        tmp = os.path.join(d, "trainer_state.json.tmp")
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(json.dumps(ts, indent=2, sort_keys=True, default=_plain) + "\n")
        os.replace(tmp, os.path.join(d, "trainer_state.json"))
        self._ckpt_resume = _Resume(step=step, dir=d, keys=tuple(meta["keys"]), world_size=int(meta["world_size"]),
                                    best_model_checkpoint=best, loaded=loaded)
        self.resumed_step = step
        log.info("resuming from step %d of %s", step, self.store.root)
        return d

    def _ckpt_mine(self, checkpoint: Optional[str]) -> Optional[_Resume]:
        r = self._ckpt_resume
        if r is not None and checkpoint is not None and os.path.abspath(os.fspath(checkpoint)) == r.dir:
            return r
        return None

    def _init_training_state(self, *args, **kwargs):
        out = super()._init_training_state(*args, **kwargs)
        r = self._ckpt_resume
        best = self._ckpt_step_of(r.best_model_checkpoint) if r is not None else None
        if best is not None:
            if self.store.find(f"checkpoint-{best}") == best:
                self.state.best_model_checkpoint = self._ckpt_step_url(best)
            else:
                log.warning("the best step %s recorded in step %d is gone (retention?): ignored",
                            r.best_model_checkpoint, r.step)
        return out

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model=None) -> None:
        r = self._ckpt_mine(resume_from_checkpoint)
        if r is None:
            return super()._load_from_checkpoint(resume_from_checkpoint, model)
        target = model if model is not None else self.model
        if r.loaded is not None:
            target.load_state_dict(r.loaded.pop("model"))
        else:
            self.store.restore({"model": target}, r.step, keys=["model"])

    def _load_optimizer_and_scheduler(self, checkpoint: Optional[str]) -> None:
        r = self._ckpt_mine(checkpoint)
        if r is None:
            return super()._load_optimizer_and_scheduler(checkpoint)
        keys = [k for k in ("optimizer", "scheduler") if k in r.keys]
        if "optimizer" not in r.keys:
            log.warning("step %d was saved with save_only_model=True: it holds no optimizer, scheduler or RNG "
                        "state; they start fresh (training does not continue exactly)", r.step)
        targets = {"optimizer": self.optimizer, "scheduler": self.lr_scheduler}
        if r.loaded is not None:
            for k in keys:
                targets[k].load_state_dict(r.loaded.pop(k))
        elif keys:
            self.store.restore(targets, r.step, keys=keys)

    def _load_scaler(self, checkpoint: Optional[str]) -> None:
        r = self._ckpt_mine(checkpoint)
        if r is None:
            return super()._load_scaler(checkpoint)
        scaler = getattr(self.accelerator, "scaler", None)
        if "scaler" in r.keys and scaler is not None:
            if r.loaded is not None:
                scaler.load_state_dict(r.loaded.pop("scaler"))
            else:
                self.store.restore({"scaler": scaler}, r.step, keys=["scaler"])

    def _load_rng_state(self, checkpoint: Optional[str]) -> None:
        r = self._ckpt_mine(checkpoint)
        if r is None:
            return super()._load_rng_state(checkpoint)
        if "rng" not in r.keys:
            return
        if r.world_size != self.args.world_size:
            log.warning("step %d was saved by %d processes, this run has %d: the RNG states start fresh "
                        "(reproducibility is not guaranteed)", r.step, r.world_size, self.args.world_size)
        if r.loaded is not None:
            rng = r.loaded.pop("rng")
            if rng:                         # {} (this run's placeholder) when another world size saved it
                RNGState().load_state_dict(rng)
            return
        self.store.restore({"rng": RNGState()}, r.step, keys=["rng"], rank_local="fresh")

    def _load_best_model(self) -> None:
        step = self._ckpt_step_of(self.state.best_model_checkpoint)
        if step is None:
            return super()._load_best_model()
        log.info("loading the best model from step %d of %s (score: %s)", step, self.store.root,
                 self.state.best_metric)
        self.store.wait()
        self.store.restore({"model": self.model}, step, keys=["model"])


class CkptstoreTrainer(CkptstoreTrainerMixin, Trainer):
    """``transformers.Trainer`` whose checkpoints go to a :class:`ckptstore.Store` (see the module docstring
    and :class:`CkptstoreTrainerMixin` for the extra keyword arguments)."""
