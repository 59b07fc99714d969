"""A real HF ``Trainer`` run on CPU for tests/integrations/test_integration_hf.py: a tiny GPT-2 from a config
(dropout on), random tokens, the default optimizer (fused AdamW), ``CkptstoreTrainer`` (or the plain ``Trainer`` with
``--plain``). One process, or one rank of a DDP job launched like torchrun (tests/dist.py sets RANK,
WORLD_SIZE, MASTER_ADDR=127.0.0.1, MASTER_PORT; accelerate then runs gloo).

Rank 0 appends every logged ``loss`` / ``eval_loss`` as a JSON line to ``--log`` (flushed and fsynced before
anything else happens), so a SIGKILL loses nothing logged. Crashes are real SIGKILLs the process sends itself:
``--kill-at S`` right after step S's training loss is logged (every rank), ``--kill-in-save S`` inside the save of
step S, just before its commit marker is written (its chunks and manifests are on disk). At the end it prints
``RESULT {json}``: the trainer's resume source, ``best_model_checkpoint``, a digest of the final model.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import signal

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("AWS_EC2_METADATA_DISABLED", "true")

import torch  # noqa: E402
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments  # noqa: E402
from helpers import arm_kill_in_save  # noqa: E402
from rank import result  # noqa: E402

SEQ, VOCAB = 32, 128


class RandomTokens(torch.utils.data.Dataset):
    def __init__(self, n: int, seed: int):
        self.data = torch.randint(0, VOCAB, (n, SEQ), generator=torch.Generator().manual_seed(seed))

    def __len__(self):
        return len(self.data)

    def __getitem__(self, i):
        return {"input_ids": self.data[i], "labels": self.data[i].clone()}


def model_digest(model: torch.nn.Module) -> str:
    h = hashlib.sha256()
    for k, v in sorted(model.state_dict().items()):
        h.update(k.encode())
        h.update(v.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def _durable_append(path: str, rec: dict) -> None:
    with open(path, "a", encoding="utf-8") as f:
        f.write(json.dumps(rec) + "\n")
        f.flush()
        os.fsync(f.fileno())


class LogAndCrash(TrainerCallback):
    def __init__(self, a, trainer_ref):
        self.a, self.trainer_ref = a, trainer_ref

    tier = None          # where the trainer's Store resumed from (resumed_from["tier"]) as training began

    def on_train_begin(self, args, state, control, **kwargs):
        store = getattr(self.trainer_ref(), "store", None)
        self.tier = (store.resumed_from or {}).get("tier") if store is not None else None
        if args.process_index == 0 and self.a.log:
            _durable_append(self.a.log, {"start": True,
                                         "resumed_step": getattr(self.trainer_ref(), "resumed_step", None)})

    def on_log(self, args, state, control, logs=None, **kwargs):
        logs = logs or {}
        rec = {k: logs[k] for k in ("loss", "eval_loss") if k in logs}
        if rec and args.process_index == 0 and self.a.log:
            _durable_append(self.a.log, {"step": state.global_step, **rec})
        if "loss" in logs and state.global_step == self.a.kill_at:
            trainer = self.trainer_ref()
            if self.a.uploads_before_kill and hasattr(trainer, "store"):
                trainer.store.wait_for_uploads(60)
            os.kill(os.getpid(), signal.SIGKILL)


def parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--store")
    p.add_argument("--remote")
    p.add_argument("--storage-options", default="{}")
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--save-steps", type=int, default=2)
    p.add_argument("--limit", type=int)
    p.add_argument("--eval", action="store_true", help="eval every save, metric_for_best_model=eval_loss, "
                   "load_best_model_at_end")
    p.add_argument("--save-only-model", action="store_true")
    p.add_argument("--resume", default="auto", help="auto | true | none | an int step | a URL or dir")
    p.add_argument("--on-rewind", default="error")
    p.add_argument("--load-path")
    p.add_argument("--kill-at", type=int)
    p.add_argument("--kill-in-save", type=int)
    p.add_argument("--uploads-before-kill", action="store_true")
    p.add_argument("--non-blocking", action="store_true")
    p.add_argument("--plain", action="store_true", help="transformers' own Trainer (its own checkpoints)")
    p.add_argument("--log")
    p.add_argument("--memory-root", help="Store(memory=Memory(this, every=1, disk_every=--disk-every))")
    p.add_argument("--disk-every", type=int)
    p.add_argument("--n-train", type=int, default=32)
    p.add_argument("--no-use-cpu", action="store_true", help="TrainingArguments(use_cpu=False): under torchrun on "
                   "CPU, HF then trains independent processes (tests the adapter's check)")
    return p.parse_args(argv)


def make_trainer(a: argparse.Namespace):
    """The trainer ``a`` describes, with the logging / crashing callback."""
    import weakref
    torch.manual_seed(0)
    cfg = GPT2Config(n_layer=2, n_embd=64, n_head=2, vocab_size=VOCAB, n_positions=SEQ, resid_pdrop=0.1,
                     embd_pdrop=0.1, attn_pdrop=0.1, bos_token_id=0, eos_token_id=0)
    model = GPT2LMHeadModel(cfg)
    kw = {}
    if a.eval:
        kw = dict(eval_strategy="steps", eval_steps=a.save_steps, metric_for_best_model="eval_loss",
                  greater_is_better=False, load_best_model_at_end=True)
    args = TrainingArguments(
        output_dir=a.out, max_steps=a.steps, per_device_train_batch_size=4, per_device_eval_batch_size=8,
        learning_rate=3e-3, logging_steps=1, save_strategy="steps", save_steps=a.save_steps,
        save_total_limit=a.limit, save_only_model=a.save_only_model, report_to=[], use_cpu=not a.no_use_cpu, seed=0,
        disable_tqdm=True, dataloader_num_workers=0, **kw)
    ds_train, ds_eval = RandomTokens(a.n_train, 1), RandomTokens(8, 2)
    if a.plain:
        trainer = Trainer(model=model, args=args, train_dataset=ds_train, eval_dataset=ds_eval)
    else:
        from ckptstore import Memory
        from ckptstore.integrations.transformers import CkptstoreTrainer
        memory = Memory(a.memory_root, every=1, disk_every=a.disk_every) if a.memory_root else None
        trainer = CkptstoreTrainer(model=model, args=args, train_dataset=ds_train, eval_dataset=ds_eval,
                                   store=a.store, remote=a.remote,
                                   storage_options=json.loads(a.storage_options) if a.remote else None,
                                   ckptstore_blocking=not a.non_blocking, collective_timeout=60,
                                   on_rewind=a.on_rewind, load_path=a.load_path, memory=memory)
        if a.kill_in_save is not None:
            arm_kill_in_save(trainer.store, a.kill_in_save)
    trainer.add_callback(LogAndCrash(a, weakref.ref(trainer)))
    return trainer


def resumed_tier(trainer) -> str:
    return next(cb.tier for cb in trainer.callback_handler.callbacks if isinstance(cb, LogAndCrash))


def main() -> None:
    a = parse()
    trainer = make_trainer(a)
    resume = {"auto": "auto", "true": True, "none": None}.get(a.resume, a.resume)
    if a.plain and resume == "auto":                  # transformers' own Trainer knows no "auto"
        resume = None
    if isinstance(resume, str) and resume.isdigit():
        resume = int(resume)
    trainer.train(resume_from_checkpoint=resume)
    out = {"best_model_checkpoint": trainer.state.best_model_checkpoint, "model": model_digest(trainer.model),
           "global_step": trainer.state.global_step}
    if not a.plain:
        out["resumed_step"] = trainer.resumed_step
        out["tier"] = resumed_tier(trainer)
        trainer.store.close()
    result(out, default=str)


if __name__ == "__main__":
    main()
