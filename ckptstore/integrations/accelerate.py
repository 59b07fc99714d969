"""ckptstore for HF accelerate loops: :func:`accelerator_state` builds the ckptstore state of an
``accelerate.Accelerator`` (accelerate 1.x), so a loop checkpoints with a plain :class:`ckptstore.Store`.

accelerate's ``save_state`` / ``load_state`` write a folder of pickles and cannot be taken over by its hooks (they
see model weights only), and its ``total_limit`` rotation deletes before it writes. accelerate users own their
loop, so the integration is the state dict and a recipe::

    from accelerate import Accelerator
    from accelerate.utils import DataLoaderConfiguration, set_seed
    from ckptstore import Retention, Store
    from ckptstore.integrations.accelerate import accelerator_state

    set_seed(0)
    accelerator = Accelerator(dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True))
    train_dl = DataLoader(dataset, batch_size=32, shuffle=True, generator=torch.Generator())   # see below
    model, opt, sched, train_dl = accelerator.prepare(model, opt, sched, train_dl)
    store = Store("ckpt/run1", remote="s3://bucket/run1", keep=Retention(last=3))
    state = accelerator_state(accelerator, progress={"epoch": 0, "batch": 0, "step": 0})
    store.resume(state)                                  # collective under accelerate's process group
    p = state["progress"]                                # replaced by the saved dict on resume
    for epoch in range(p["epoch"], epochs):
        train_dl.set_epoch(epoch)                        # the epoch's permutation (seedable sampler)
        dl = accelerator.skip_first_batches(train_dl, p["batch"]) if p["batch"] else train_dl
        for batch in dl:
            ...                                          # forward, accelerator.backward, opt.step, sched.step
            p["batch"] += 1; p["step"] += 1
            store.save(state, p["step"], blocking=False)
        p["epoch"], p["batch"] = epoch + 1, 0
    store.close()

Bit-exact resume needs: the seedable sampler and ``set_epoch`` (each epoch's order a function of the epoch),
a DataLoader ``generator=`` (each DataLoader iterator draws its base seed from the global RNG otherwise, and a
resumed run creates one iterator more, which shifts the RNG that ``RNGState`` restored), and
``skip_first_batches`` for the rest of the interrupted epoch. See docs/integrations/accelerate.md.
"""
from __future__ import annotations

from typing import Any, Dict, Iterable, List, Mapping, Optional

from ckptstore import RNGState

SUPPORTED_VERSIONS = "accelerate >=1.1,<2"
#: Accelerator attributes read here
ACCELERATOR_ATTRIBUTES = ("_models", "_optimizers", "_schedulers", "_custom_objects", "_dataloaders", "scaler",
                          "is_fsdp2", "unwrap_model", "step", "distributed_type")

try:
    import accelerate as _accelerate
    from accelerate import Accelerator as _Accelerator
except ImportError as e:  # pragma: no cover - depends on the environment
    raise ImportError(f"ckptstore.integrations.accelerate needs {SUPPORTED_VERSIONS} "
                      f"(pip install 'ckptstore[accelerate]'): {e}") from e


def check_accelerate(accelerator_cls=_Accelerator) -> None:
    """Raise ``ImportError`` naming the ``Accelerator`` attributes this module reads that ``accelerator_cls``
    lacks (instance attributes are set in ``__init__``: they are looked for in its source)."""
    import inspect
    try:
        src = inspect.getsource(accelerator_cls)
    except (OSError, TypeError):
        src = ""
    missing = [a for a in ACCELERATOR_ATTRIBUTES
               if not hasattr(accelerator_cls, a) and f"self.{a} =" not in src]
    if missing:
        raise ImportError(f"ckptstore.integrations.accelerate supports {SUPPORTED_VERSIONS}; accelerate "
                          f"{getattr(_accelerate, '__version__', '?')} lacks Accelerator.{', Accelerator.'.join(missing)}")


check_accelerate()


def _name(base: str, i: int) -> str:
    return base if i == 0 else f"{base}_{i}"          # accelerate's own file naming: optimizer.bin, optimizer_1.bin


class AcceleratorStep:
    """``accelerator.step`` (the gradient-accumulation counter accelerate saves with its RNG states)."""

    def __init__(self, accelerator):
        self.accelerator = accelerator

    def state_dict(self) -> Dict[str, int]:
        return {"step": int(self.accelerator.step)}

    def load_state_dict(self, sd: Mapping[str, Any]) -> None:
        self.accelerator.step = int(sd["step"])


class FSDP2Model:
    """An FSDP2 model through ``torch.distributed.checkpoint.state_dict`` (sharded DTensors, resharded on load)."""

    def __init__(self, model):
        self.model = model

    def state_dict(self):
        from torch.distributed.checkpoint.state_dict import get_model_state_dict
        return get_model_state_dict(self.model)

    def load_state_dict(self, sd):
        from torch.distributed.checkpoint.state_dict import set_model_state_dict
        set_model_state_dict(self.model, sd)


class FSDP2Optimizer:
    """An optimizer of an FSDP2 model through ``get_optimizer_state_dict`` / ``set_optimizer_state_dict``."""

    def __init__(self, model, optimizer):
        self.model, self.optimizer = model, optimizer

    def state_dict(self):
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict
        return get_optimizer_state_dict(self.model, self.optimizer)

    def load_state_dict(self, sd):
        from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict
        set_optimizer_state_dict(self.model, self.optimizer, sd)


def _owner(models: List[Any], optimizer) -> Any:
    params = {id(p) for g in optimizer.param_groups for p in g["params"]}
    for m in models:
        if any(id(p) in params for p in m.parameters()):
            return m
    raise ValueError("accelerator_state: an optimizer's parameters belong to none of the prepared models "
                     "(FSDP2 needs the model of each optimizer)")


def accelerator_state(accelerator, *, rng: bool = True, **extra: Any) -> Dict[str, Any]:
    """The ckptstore state of ``accelerator``: a dict for :meth:`ckptstore.Store.save` / ``resume`` /
    ``restore``, whose Stateful values read and restore the live objects in place.

    Keys (``_i`` for the i-th object after the first, as accelerate names its files):

    - ``model``: each prepared model, unwrapped (``accelerator.unwrap_model``: no ``module.`` prefix, so a DDP
      and a single-process run load each other's steps). Under FSDP2 (``accelerator.is_fsdp2``) the DCP
      tutorial's pattern instead: ``get_model_state_dict`` (DTensor shards, resharded on load);
    - ``optimizer``: each prepared optimizer (``AcceleratedOptimizer``; under FSDP2 ``get_optimizer_state_dict``
      of the model that owns its parameters);
    - ``scheduler``: each prepared scheduler; ``scaler``: the ``GradScaler`` when mixed precision uses one;
    - ``dataloader``: each prepared dataloader with ``use_stateful_dataloader=True`` (its exact position);
      other dataloaders are resumed with ``accelerator.skip_first_batches`` (see the module docstring);
    - ``custom``: each object passed to ``accelerator.register_for_checkpointing`` (Stateful);
    - ``accelerator``: ``accelerator.step`` (gradient accumulation); ``rng``: :class:`ckptstore.RNGState`
      (Python, NumPy, torch CPU and current CUDA device; per rank, so rank-local), unless ``rng=False``;
    - the caller's ``extra`` entries (e.g. ``progress={"epoch": 0, "batch": 0}``), saved as given and replaced
      by the saved values on resume.

    Raises ``ValueError`` when an ``extra`` key collides with one of the above (naming it), and when, under
    FSDP2, an optimizer's parameters belong to no prepared model."""
    state: Dict[str, Any] = {}
    models = list(accelerator._models)
    fsdp2 = bool(getattr(accelerator, "is_fsdp2", False))
    for i, m in enumerate(models):
        state[_name("model", i)] = FSDP2Model(m) if fsdp2 else accelerator.unwrap_model(m)
    for i, opt in enumerate(accelerator._optimizers):
        state[_name("optimizer", i)] = (FSDP2Optimizer(_owner(models, opt.optimizer), opt.optimizer) if fsdp2
                                        else opt)
    for i, s in enumerate(accelerator._schedulers):
        state[_name("scheduler", i)] = s
    if accelerator.scaler is not None:
        state["scaler"] = accelerator.scaler
    stateful_dls = [dl for dl in accelerator._dataloaders if getattr(dl, "use_stateful_dataloader", False)]
    for i, dl in enumerate(stateful_dls):
        state[_name("dataloader", i)] = dl
    for i, obj in enumerate(accelerator._custom_objects):
        state[_name("custom", i)] = obj
    state["accelerator"] = AcceleratorStep(accelerator)
    if rng:
        state["rng"] = RNGState()
    for k, v in extra.items():
        if k in state:
            raise ValueError(f"accelerator_state: extra key {k!r} collides with the accelerator's own entry "
                             f"{k!r} (keys: {sorted(state)})")
        state[k] = v
    return state


def replicated_keys(accelerator, state: Mapping[str, Any]) -> List[str]:
    """The keys of ``state`` (from :func:`accelerator_state`) that every rank holds identically under DDP
    (models, optimizers, schedulers, scaler, accelerator step): pass them as ``Store.save(...,
    replicated=...)`` so only rank 0 saves them. Empty under FSDP2 (sharded) and for a single process."""
    if getattr(accelerator, "is_fsdp2", False) or getattr(accelerator, "num_processes", 1) <= 1:
        return []
    prefixes: Iterable[str] = ("model", "optimizer", "scheduler")
    return [k for k in state if k in ("scaler", "accelerator") or
            any(k == p or (k.startswith(p + "_") and k[len(p) + 1:].isdigit()) for p in prefixes)]
