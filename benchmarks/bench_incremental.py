#!/usr/bin/env python
"""Incremental saves while training: what a step really writes, and what a save costs the loop.

Section 1 (fine-tuning, CPU by default): a GPT-like model whose token embedding and lower half of the blocks
are frozen (requires_grad=False, not in the optimizer) is trained for --steps real AdamW steps, saving after
each step into one store. Contenders (--runs, alternated over --repeat): blocking / non-blocking, with
track_versions on / off, and the same with nothing frozen. Per step: bytes total / written / unchanged,
written/total, save seconds, stall. Every saved step is loaded back and compared (CRC32 of every tensor, bit
for bit) with the state at save time.

Section 2 (GPU only; prints "skipped: no CUDA" otherwise): model + AdamW state on the GPU. Stall and wall
time of the save call for Store.save(blocking=False), Store.save(blocking=True) and torch.save of the state
moved to CPU, the time of the training steps right after the save, and correctness: the saved step equals
(bitwise) a copy taken at save time, and training right after a non-blocking save ends bit-identical to the
same training without a save.

Section 3 (--sections pull): remote resume of the newest step after --steps fine-tune steps (the frozen run)
uploaded to a moto S3 server on 127.0.0.1 with keep_last=2 there: the newest step reads the frozen tensors
from the packs of step 1, most of which retention has made dead. Ranged pull (ckptstore.remote.transfer's
RANGED_PULL_THRESHOLD = 0.5, the default) against whole-pack pull (threshold 0), alternated --pull-repeat
times: bytes fetched from S3, ranged GETs, packs whole / by range, resume seconds, local pack bytes on disk;
every resume is compared (CRC32 of every tensor) with the state at the last save.

    python benchmarks/bench_incremental.py --size small --steps 3     # quick, ~1 min on 2 cores
    python benchmarks/bench_incremental.py --sections gpu --size 3gb --json inc_gpu.json
    python benchmarks/bench_incremental.py --sections pull --size small --steps 6 --pull-repeat 3   # ~1-2 min

See benchmarks/README.md ("bench_incremental.py").
"""
from __future__ import annotations

import contextlib
import gc
import os
import statistics
import sys
import time
import traceback
import warnings
from pathlib import Path
from typing import Any, Iterator

# cuBLAS is only deterministic with a fixed workspace; must be set before the first CUDA matmul.
# It has no effect without CUDA, and only the GPU correctness check relies on it.
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

import harness as H  # noqa: E402  (puts the checkout on sys.path)
import common as C  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from ckptstore import Remote, Retention, Store, Writing  # noqa: E402

C.quiet_dcp()
DEBUG = H.DEBUG

# --------------------------------------------------------------------------- model / training


class DevGPT(C.GPT):
    """common.GPT with a device-aware position index (common.GPT.forward builds it on the CPU)."""

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1], device=idx.device))
        for blk in self.blocks:
            x = blk(x)
        return self.head(self.ln_f(x))


def build_training(size: str, frozen: bool, device: torch.device, seed: int
                   ) -> tuple[DevGPT, torch.optim.AdamW]:
    """Deterministic model (same weights for every run of a size) and AdamW over the trainable
    parameters only. frozen=True: wte and the lower half of the blocks get requires_grad=False."""
    cfg = C.SIZES[size]
    torch.manual_seed(seed)
    model = DevGPT(**cfg)
    if frozen:
        model.wte.requires_grad_(False)
        for blk in model.blocks[: cfg["n_layers"] // 2]:
            blk.requires_grad_(False)
    model.to(device)
    trainable = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    opt = torch.optim.AdamW(
        [{"params": [p for _, p in trainable if p.dim() >= 2], "weight_decay": 0.1},
         {"params": [p for _, p in trainable if p.dim() < 2], "weight_decay": 0.0}],
        lr=3e-4, betas=(0.9, 0.95),
    )
    return model, opt


def train_step(model: torch.nn.Module, opt: torch.optim.Optimizer, step: int, batch: int, seq: int,
               device: torch.device) -> None:
    """One real forward/backward/AdamW step on random tokens (the same tokens for a given step in
    every run). Does not synchronize the device."""
    vocab = model.head.out_features
    g = torch.Generator().manual_seed(10_000 + step)
    idx = torch.randint(0, vocab, (batch, seq + 1), generator=g).to(device)
    logits = model(idx[:, :-1])
    loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), idx[:, 1:].reshape(-1))
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def param_counts(model: torch.nn.Module) -> tuple[int, int]:
    total = sum(p.numel() for p in model.parameters())
    frozen = sum(p.numel() for p in model.parameters() if not p.requires_grad)
    return total, frozen


# --------------------------------------------------------------------------- state trees


def live_tree(model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict[str, Any]:
    """What Store.save flattens for {"model": model, "optimizer": opt}."""
    return {"model": model.state_dict(), "optimizer": opt.state_dict()}


def crc_map(tree: Any) -> dict[str, tuple[str, tuple, int]]:
    return {p: (str(t.dtype), tuple(t.shape), C.crc(t.detach().cpu())) for p, t in C.tree_items(tree)}


def cpu_copy(tree: Any) -> dict[str, torch.Tensor]:
    """path -> a CPU copy of every tensor (synchronous: waits for the work queued on the device)."""
    return {p: t.detach().to("cpu", copy=True) for p, t in C.tree_items(tree)}


def bitwise_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> list[str]:
    """Paths that differ in presence, dtype, shape or any byte (NaN-safe)."""
    bad = sorted(set(a) ^ set(b))
    for p in sorted(set(a) & set(b)):
        x, y = a[p], b[p]
        if x.dtype != y.dtype or x.shape != y.shape or not torch.equal(C.as_bytes(x.cpu()), C.as_bytes(y.cpu())):
            bad.append(p)
    return bad


def max_abs_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    m = 0.0
    for p in set(a) & set(b):
        if a[p].is_floating_point() and a[p].shape == b[p].shape and a[p].numel():
            m = max(m, float((a[p].double() - b[p].double()).abs().max()))
    return m


def sec(x: float | None, nd: int = 3) -> str:
    return "n/a" if x is None else f"{x:.{nd}f}"


def mean(xs: list[float]) -> float | None:
    xs = [x for x in xs if x is not None]
    return statistics.fmean(xs) if xs else None


# --------------------------------------------------------------------------- section 1

# name -> (frozen, track_versions, blocking)
RUNS: dict[str, tuple[bool, bool, bool]] = {
    "frozen": (True, True, True),
    "frozen_nb": (True, True, False),
    "frozen_notv": (True, False, True),
    "frozen_notv_nb": (True, False, False),
    "full": (False, True, True),
    "full_nb": (False, True, False),
}


def finetune(name: str, args, base: Path, device: torch.device, info: dict) -> H.Contender:
    """One run: --steps training steps, a save after each into one fresh store; a sample of row ``name`` per
    step (the SaveResult fields, the call's wall time, the training step's), each step verified at the end."""
    frozen, track, blocking = RUNS[name]

    def run(res: H.Results, root: Path) -> None:
        model, opt = build_training(args.size, frozen, device, args.seed)
        state, outs, expected = {"model": model, "optimizer": opt}, [], {}
        with Store(str(root), writing=Writing(track_versions=track)) as store:
            gc.collect()
            t_run = time.perf_counter()
            for step in range(1, args.steps + 1):
                t0 = time.perf_counter()
                train_step(model, opt, step, args.batch, args.seq, device)
                sync(device)
                train_s = time.perf_counter() - t0
                if args.verify:  # outside the timings; the state does not change until the next step
                    expected[step] = crc_map(live_tree(model, opt))
                t0 = time.perf_counter()
                outs.append((step, train_s, store.save(state, step, blocking=blocking), time.perf_counter() - t0))
            results = [(step, train_s, o if blocking else o.result(), call_s) for step, train_s, o, call_s in outs]
            store.wait()
            run_s = time.perf_counter() - t_run
            for step, train_s, r, call_s in results:
                bad = None
                if args.verify:
                    got, want = crc_map(store.load(step, map_location="cpu")), expected[step]
                    bad = sorted(p for p in set(got) | set(want) if got.get(p) != want.get(p))
                    res.check(name, not bad)
                res.add(name, r.seconds, rep=res.rep, step=step, train_s=train_s, call_s=call_s,
                        bytes_total=r.bytes_total, bytes_written=r.bytes_written, bytes_unchanged=r.bytes_unchanged,
                        blobs_total=r.blobs_total, blobs_new=r.blobs_new, stall_s=r.stall_seconds,
                        ratio=r.bytes_written / r.bytes_total if r.bytes_total else None,
                        hash_cpu_s=r.phases.get("hash_cpu"), write_io_s=r.phases.get("write_io"),
                        verified=None if bad is None else not bad, verify_bad=(bad or [])[:5])
        n_params, n_frozen = param_counts(model)
        info.setdefault(name, []).append(dict(params=n_params, params_frozen=n_frozen, run_s=run_s,
                                              store_disk_bytes=C.disk_bytes(root)))
        print(f"   {name}: params {n_params / 1e6:.1f} M, frozen {n_frozen / 1e6:.1f} M", file=sys.stderr)
    return H.Contender(name, run, records=True, setup=lambda: C.fresh_dir(base, "incr_"),
                       teardown=None if args.keep else C.rmtree)


def section_finetune(args, base: Path) -> dict[str, Any]:
    device = torch.device(args.finetune_device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("section 1: --finetune-device cuda but no CUDA: using cpu")
        device = torch.device("cpu")
    runs = [r.strip() for r in args.runs.split(",") if r.strip()]
    cfg = C.SIZES[args.size]
    print(f"== section 1: fine-tuning, size {args.size} ({cfg['d_model']} x {cfg['n_layers']}, vocab "
          f"{cfg['vocab']}), {args.steps} steps, batch {args.batch} x {args.seq} tokens, on {device}, "
          f"{args.repeat} repeat(s)")
    print(f"   frozen: wte + blocks 0..{cfg['n_layers'] // 2 - 1} (requires_grad=False, not in AdamW); "
          f"store under {base}")
    # warm-up (first-call kernel/allocator costs), so the first run is not penalised
    wm, wo = build_training(args.size, False, device, args.seed)
    train_step(wm, wo, 0, args.batch, args.seq, device)
    sync(device)
    del wm, wo
    gc.collect()
    info: dict[str, list] = {}
    res = H.compare([finetune(n, args, base, device, info) for n in runs], args.repeat)

    rows = [["run", "step", "total MiB", "written MiB", "unchanged MiB", "written/total", "new blobs", "save s",
             "stall s", "call s", "hash cpu s", "train s", "verify"]]
    for name, r in res.rows.items():
        for s in r.samples:
            rows.append([name if args.repeat == 1 else f"{name} #{s['rep'] + 1}", s["step"], C.mib(s["bytes_total"]),
                         C.mib(s["bytes_written"]), C.mib(s["bytes_unchanged"]), sec(s["ratio"]),
                         f"{s['blobs_new']}/{s['blobs_total']}", sec(s["seconds"]), sec(s["stall_s"]),
                         sec(s["call_s"]), sec(s["hash_cpu_s"]), sec(s["train_s"]),
                         {True: "ok", False: "WRONG", None: "-"}[s["verified"]]])
        if not r.samples:
            rows.append([name] + [""] * 11 + [r.note])
    print("\n" + C.align_table(rows))

    # steady state: steps 2..K (step 1 writes everything into the empty store)
    def steady(run: str, key: str) -> float | None:
        ss = res.rows[run].samples if run in res.rows else []
        return mean([s[key] for s in ss if s["step"] >= 2] or [s[key] for s in ss])

    summ = [["run", "frozen", "track", "blocking", "total MiB", "written MiB", "unchanged MiB", "written/total",
             "save s", "stall s", "call s", "run s", "store MiB"]]
    for name in runs:
        frozen, track, blocking = RUNS[name]
        if not res.rows[name].samples:
            summ.append([name] + ["n/a"] * 11 + [res.rows[name].note])
            continue
        summ.append([name, "yes" if frozen else "no", "on" if track else "off", "yes" if blocking else "no",
                     C.mib(steady(name, "bytes_total")), C.mib(steady(name, "bytes_written")),
                     C.mib(steady(name, "bytes_unchanged")), sec(steady(name, "ratio")), sec(steady(name, "seconds")),
                     sec(steady(name, "stall_s")), sec(steady(name, "call_s")),
                     sec(mean([i["run_s"] for i in info[name]]), 2), C.mib(info[name][-1]["store_disk_bytes"])])
    print(f"\nSteady state: mean over steps 2..{args.steps} (step 1 fills the empty store)\n" + C.align_table(summ))
    notes = []
    for a, b, what in (("frozen_notv", "frozen", "save s"), ("frozen_notv_nb", "frozen_nb", "stall s")):
        key = "seconds" if what == "save s" else "stall_s"
        if a in runs and b in runs and steady(a, key) is not None and steady(b, key):
            x, y, hx, hy = steady(a, key), steady(b, key), steady(a, "hash_cpu_s"), steady(b, "hash_cpu_s")
            notes.append(f"{a} vs {b}: {what} {x:.3f} vs {y:.3f} ({x - y:+.3f} s per save, x{x / y:.2f}); "
                         f"hash cpu {hx:.3f} vs {hy:.3f} s ({hx - hy:+.3f})")
    for a, b in (("full", "frozen"), ("full_nb", "frozen_nb")):
        if a in runs and b in runs and steady(a, "bytes_written") and steady(b, "bytes_written") is not None:
            x, y = steady(a, "bytes_written"), steady(b, "bytes_written")
            notes.append(f"{b}: writes {y / x:.2f} of what {a} writes per step ({C.mib(y)} vs {C.mib(x)} MiB)")
    if notes:
        print("\n" + "\n".join(notes))
    return {"device": str(device), "runs": res.to_json(), "info": info, "notes": notes}


# --------------------------------------------------------------------------- section 2


def tree_to_cpu(obj: Any) -> Any:
    """A CPU copy of a nested state (always a copy, also of tensors already on the CPU such as AdamW's
    `step` counters, which the optimizer updates in place)."""
    if torch.is_tensor(obj):
        return obj.detach().to("cpu", copy=True)
    if isinstance(obj, dict):
        return {k: tree_to_cpu(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(tree_to_cpu(v) for v in obj)
    return obj


GPU_METHODS = ("ckptstore_nb", "ckptstore", "torch_save")


def gpu_train(model, opt, first_step: int, n: int, args, device) -> float:
    """n training steps, timed to completion on the device."""
    sync(device)
    t0 = time.perf_counter()
    for i in range(n):
        train_step(model, opt, first_step + i, args.gpu_batch, args.gpu_seq, device)
    sync(device)
    return time.perf_counter() - t0


def gpu_timings(args, base: Path, device: torch.device) -> dict[str, Any]:
    """For each method: --gpu-saves saves in one store / folder, each followed right away by
    --gpu-train-after training steps. A fresh model per method, same weights and tokens."""
    n_after = args.gpu_train_after
    rows: list[dict[str, Any]] = []

    model, opt = build_training(args.size, False, device, args.seed)
    gpu_train(model, opt, 1, 2, args, device)                    # warm-up: kernels, AdamW state
    alone = [gpu_train(model, opt, 3 + i * n_after, n_after, args, device) for i in range(3)]
    state_bytes = sum(C.nbytes(t) for _, t in C.tree_items(live_tree(model, opt)))
    train_alone = statistics.median(alone)
    del model, opt
    gc.collect()
    torch.cuda.empty_cache()

    for method in [m.strip() for m in args.gpu_methods.split(",") if m.strip()]:
        model, opt = build_training(args.size, False, device, args.seed)
        gpu_train(model, opt, 1, 2, args, device)
        state = {"model": model, "optimizer": opt}
        folder = C.fresh_dir(base, f"gpu_{method}_")
        store = None
        try:
            if method in ("ckptstore_nb", "ckptstore"):
                store = Store(str(folder / "store"))
            step = 3
            for j in range(1, args.gpu_saves + 1):
                row: dict[str, Any] = {"method": method, "save": j}
                sync(device)                                         # earlier training done
                t0 = time.perf_counter()
                if method == "ckptstore_nb":
                    h = store.save(state, j, blocking=False)
                    row["call_s"] = time.perf_counter() - t0
                    row["stall_s"] = h.stall_seconds
                elif method == "ckptstore":
                    r = store.save(state, j, blocking=True)
                    row["call_s"] = time.perf_counter() - t0
                    row["stall_s"] = r.stall_seconds
                    row["total_s"], row["bytes_written"] = r.seconds, r.bytes_written
                elif method == "torch_save":
                    cpu_state = tree_to_cpu(live_tree(model, opt))   # .to("cpu") waits for the GPU
                    d2h = time.perf_counter() - t0
                    written = C.torch_save_fsync(cpu_state, folder / f"step{j}.pt")
                    row["call_s"] = row["stall_s"] = row["total_s"] = time.perf_counter() - t0
                    row["d2h_s"], row["bytes_written"] = d2h, written
                    del cpu_state
                else:
                    raise ValueError(f"unknown --gpu-methods entry {method!r}")
                row["train_after_s"] = gpu_train(model, opt, step, n_after, args, device)
                step += n_after
                if method == "ckptstore_nb":
                    r = h.result()
                    row["total_s"], row["bytes_written"] = r.seconds, r.bytes_written
                    row["background_after_train_s"] = max(0.0, r.seconds - row["call_s"] - row["train_after_s"])
                rows.append(row)
        except Exception as e:
            if DEBUG:
                traceback.print_exc()
            rows.append({"method": method, "error": C.fmt_note(e)})
        finally:
            if store is not None:
                with contextlib.suppress(Exception):
                    store.close()
            if not args.keep:
                C.rmtree(folder)
            del model, opt, state
            gc.collect()
            torch.cuda.empty_cache()
    return {"state_bytes": state_bytes, "train_alone_s": train_alone, "train_alone_all_s": alone,
            "rows": rows}


@contextlib.contextmanager
def deterministic() -> Iterator[None]:
    """Deterministic kernels (warn only) and the math SDPA backend, restored afterwards."""
    prev = torch.are_deterministic_algorithms_enabled()
    prev_warn = torch.is_deterministic_algorithms_warn_only_enabled()
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        try:
            from torch.nn.attention import SDPBackend, sdpa_kernel
            ctx = sdpa_kernel([SDPBackend.MATH])
        except Exception:  # older torch
            ctx = contextlib.nullcontext()
        with ctx, warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        torch.use_deterministic_algorithms(prev, warn_only=prev_warn)


def gpu_correctness(args, base: Path, device: torch.device) -> dict[str, Any]:
    """Starting from one snapshot S0 (taken after 2 training steps), with the same tokens:

    A, A'   control: 1 step (-> S1), then M steps; no save. A == A' tells if training is bitwise
            deterministic here (if not, the comparisons against A fall back to max |diff|).
    sync    sync, copy taken at save time (= S0), save(blocking=False), M steps right away with no
            sync; the loaded step must equal the copy; the end state must equal the no-save run
            with M steps from S0 (A0, also a control).
    queued  1 step with no sync, save(blocking=False) while its kernels are still queued, M steps
            right away; the loaded step must equal A's S1; the end state must equal A.
    """
    M = args.gpu_train_after
    out: dict[str, Any] = {}
    model, opt = build_training(args.size, False, device, args.seed)
    state = {"model": model, "optimizer": opt}
    folder = C.fresh_dir(base, "gpu_check_")
    store = Store(str(folder / "store"))

    with deterministic():
        gpu_train(model, opt, 1, 2, args, device)
        s0_model = {k: v.detach().clone() for k, v in model.state_dict().items()}
        s0_opt = tree_to_cpu(opt.state_dict())

        def restore() -> None:
            sync(device)
            with torch.no_grad():
                for k, v in model.state_dict().items():
                    v.copy_(s0_model[k])
            # load_state_dict may keep CPU tensors it is given (the step counters): give it a copy
            opt.load_state_dict(tree_to_cpu(s0_opt))
            opt.zero_grad(set_to_none=True)
            sync(device)

        def save_then_train(step: int) -> tuple[dict, dict]:
            """save(blocking=False), then M training steps right away with no sync; (end state, saved step)."""
            h = store.save(state, step, blocking=False)
            for i in range(M):
                train_step(model, opt, 101 + i, args.gpu_batch, args.gpu_seq, device)
            h.result()
            return cpu_copy(live_tree(model, opt)), dict(C.tree_items(store.load(step, map_location="cpu")))

        try:
            # controls
            restore()
            gpu_train(model, opt, 100, 1, args, device)
            a_s1 = cpu_copy(live_tree(model, opt))
            gpu_train(model, opt, 101, M, args, device)
            a_end = cpu_copy(live_tree(model, opt))
            restore()
            gpu_train(model, opt, 100, 1 + M, args, device)
            a2_end = cpu_copy(live_tree(model, opt))
            restore()
            gpu_train(model, opt, 101, M, args, device)
            a0_end = cpu_copy(live_tree(model, opt))
            det = not bitwise_diff(a_end, a2_end)
            out["deterministic"] = det
            out["control_max_abs_diff"] = max_abs_diff(a_end, a2_end)

            # sync: copy taken at save time, then save, then training with no sync in between
            restore()
            snap = cpu_copy(live_tree(model, opt))
            end, loaded = save_then_train(1)
            bad = bitwise_diff(snap, loaded)
            out["sync_saved_equals_copy"] = not bad
            out["sync_saved_bad"] = bad[:5]
            out["sync_end_equals_nosave"] = not bitwise_diff(end, a0_end)
            out["sync_end_max_abs_diff"] = max_abs_diff(end, a0_end)

            # queued: save while the previous step's kernels are still in flight
            restore()
            train_step(model, opt, 100, args.gpu_batch, args.gpu_seq, device)
            end, loaded = save_then_train(2)
            bad = bitwise_diff(a_s1, loaded)
            out["queued_saved_equals_s1"] = not bad
            out["queued_saved_max_abs_diff"] = max_abs_diff(a_s1, loaded)
            out["queued_end_equals_nosave"] = not bitwise_diff(end, a_end)
            out["queued_end_max_abs_diff"] = max_abs_diff(end, a_end)
        finally:
            with contextlib.suppress(Exception):
                store.close()
            if not args.keep:
                C.rmtree(folder)
    return out


def section_gpu(args: Any, base: Path) -> dict[str, Any]:
    print(f"== section 2: GPU, size {args.size}")
    if not torch.cuda.is_available():
        print("skipped: no CUDA")
        return {"skipped": "no CUDA"}
    device = torch.device("cuda", torch.cuda.current_device())
    name = torch.cuda.get_device_name(device)
    print(f"   {name}; batch {args.gpu_batch} x {args.gpu_seq} tokens; {args.gpu_saves} saves per method, "
          f"each followed by {args.gpu_train_after} training steps")
    res: dict[str, Any] = {"device": name}

    def attempt(key: str, fn) -> Any:
        """``res[key] = fn()``; a failure is printed and kept as ``res[key + "_error"]`` (the section goes on)."""
        try:
            res[key] = fn()
            return res[key]
        except Exception as e:
            if DEBUG:
                traceback.print_exc()
            print(f"   {key} FAILED: {C.fmt_note(e)}")
            res[f"{key}_error"] = C.fmt_note(e)
    tm = attempt("timings", lambda: gpu_timings(args, base, device))
    if tm is not None:
        ta = tm["train_alone_s"]
        print(f"   state {C.gb(tm['state_bytes'])}; {args.gpu_train_after} training steps alone: {ta:.3f} s "
              f"(median of {len(tm['train_alone_all_s'])})")
        rows = []
        for r in tm["rows"]:
            if "error" in r:
                rows.append([r["method"]] + [""] * 7 + ["FAILED " + r["error"]])
                continue
            note = f"D2H {r['d2h_s']:.3f} s" if "d2h_s" in r else ""
            if "background_after_train_s" in r:
                note = f"save ran {r['background_after_train_s']:.3f} s past the steps"
            rows.append([r["method"], r["save"], sec(r["call_s"], 4), sec(r["stall_s"], 4), sec(r["total_s"]),
                         sec(r["train_after_s"]), f"{r['train_after_s'] / ta:.2f}" if ta else "n/a",
                         C.mib(r.get("bytes_written")), note])
        print()
        print(C.align_table([["method", "save", "call s", "stall s", "total s", "train after s", "x alone",
                              "written MiB", "note"]] + rows))
    ck = attempt("correctness", lambda: gpu_correctness(args, base, device))
    if ck is not None:
        yn = {True: "yes", False: "NO"}
        print()
        print(f"   training bitwise deterministic here: {yn[ck['deterministic']]}"
              f" (control max |diff| {ck['control_max_abs_diff']:.3g})")
        print(f"   sync:   saved step == copy at save time: {yn[ck['sync_saved_equals_copy']]}"
              f"{'  ' + ', '.join(ck['sync_saved_bad']) if ck['sync_saved_bad'] else ''}; "
              f"end state == no-save run: {yn[ck['sync_end_equals_nosave']]} "
              f"(max |diff| {ck['sync_end_max_abs_diff']:.3g})")
        print(f"   queued: saved step == state after the queued step: {yn[ck['queued_saved_equals_s1']]} "
              f"(max |diff| {ck['queued_saved_max_abs_diff']:.3g}); end state == no-save run: "
              f"{yn[ck['queued_end_equals_nosave']]} (max |diff| {ck['queued_end_max_abs_diff']:.3g})")
        if not ck["deterministic"]:
            print("   (training is not bitwise deterministic here: comparisons with the no-save run and the "
                  "'queued' saved step are only meaningful as max |diff| against the control's)")
    return res


# --------------------------------------------------------------------------- section 3: ranged pulls


def remote_step_objects(storage, step: int) -> tuple[int, int]:
    """(bytes of the packs the step reads, bytes of its own blobs) on the remote."""
    from ckptstore.format.catalog import Catalog
    from ckptstore.format.layout import pack_path
    cat = Catalog(storage)
    commit = cat.read_commit(step)
    packs, blobs = set(), {}
    for rank in commit.manifests:
        m = cat.read_manifest(commit, rank)
        packs |= m.pack_ids()
        blobs.update({c.blob_id: c.nbytes for c in m.chunk_refs() if c.pack is None})
    return sum(storage.size(pack_path(p)) for p in packs), sum(blobs.values())


def section_pull(args, base: Path) -> dict[str, Any]:
    import ckptstore.remote.transfer as transfer
    from backends.launcher import S3Server
    from ckptstore import Packing
    device = torch.device("cpu")
    threshold = int(args.pull_pack_threshold * C.MiB)
    packing = Packing(threshold=threshold, target_size=max(threshold, Packing().target_size))
    print(f"== section 3: remote resume after {args.steps} fine-tune steps (frozen run, size {args.size}), "
          f"keep_last=2 on moto S3, chunks under {args.pull_pack_threshold:g} MiB packed; ranged vs whole-pack "
          f"pull, {args.pull_repeat} each, alternated")
    run_dir = C.fresh_dir(base, "pull_")
    server = S3Server(workdir=run_dir / "moto").start()
    default = transfer.RANGED_PULL_THRESHOLD
    out: dict[str, Any] = {}
    try:
        opts = server.storage_options()
        remote = f"{server.new_bucket_url('pull')}/ckpt"
        model, opt = build_training(args.size, True, device, args.seed)
        with Store(str(run_dir / "train"), remote=remote, storage_options=opts, keep=Retention(last=2),
                   writing=Writing(packing=packing)) as store:
            for step in range(1, args.steps + 1):
                train_step(model, opt, step, args.batch, args.seq, device)
                store.save({"model": model, "optimizer": opt}, step)
            store.wait_for_uploads()
            packs_bytes, blobs_bytes = remote_step_objects(store.remote_storage, args.steps)
            out.update(step_bytes=store.catalog.read_commit(args.steps).bytes_total,
                       referenced_pack_bytes=packs_bytes, blob_bytes=blobs_bytes)
        want = crc_map(live_tree(model, opt))
        print(f"   newest step {args.steps}: {C.mib(out['step_bytes'])} MiB of state; it reads "
              f"{C.mib(packs_bytes)} MiB of packs and {C.mib(blobs_bytes)} MiB of blobs on the remote")

        def pull(mode: str, threshold: float) -> H.Contender:
            def run(root: Path) -> dict[str, Any]:
                transfer.RANGED_PULL_THRESHOLD = threshold
                m2, o2 = build_training(args.size, True, device, args.seed + 1)
                gc.collect()
                t0 = time.perf_counter()
                with Store(str(root), remote=Remote(remote, upload=False), storage_options=opts,
                           writing=Writing(packing=packing)) as s:
                    got = s.resume({"model": m2, "optimizer": o2})
                    resume_s, st = time.perf_counter() - t0, s.pulled[-1]
                ok = got == args.steps and crc_map(live_tree(m2, o2)) == want
                return dict(seconds=resume_s, pull_s=st.seconds, bytes_fetched=st.bytes_fetched,
                            ranges=st.ranges_fetched, packs_whole=st.packs_whole, packs_ranged=st.packs_ranged,
                            local_pack_bytes=sum(f.stat().st_size for f in (root / "packs").rglob("*.pack")), ok=ok,
                            note="" if ok else "WRONG DATA")
            return H.Contender(mode, run, setup=lambda: C.fresh_dir(run_dir, "resume_"), teardown=C.rmtree)

        res = H.compare([pull("ranged", default), pull("whole", 0.0)], args.pull_repeat)
    finally:
        transfer.RANGED_PULL_THRESHOLD = default
        server.stop()
        if not args.keep:
            C.rmtree(run_dir)

    def first(key, fmt=str):
        return lambda r: fmt(r.samples[0][key])
    print("\n" + res.table(head="pull", unit="s (resume)", columns=[
        ("pull s", lambda r: sec(r.median("pull_s"))), ("fetched MiB", first("bytes_fetched", C.mib)),
        ("ranged GETs", first("ranges")), ("packs whole/ranged", lambda r: f"{r.samples[0]['packs_whole']}/"
                                                                          f"{r.samples[0]['packs_ranged']}"),
        ("local packs MiB", first("local_pack_bytes", C.mib))]))
    return dict(out, rows=res.to_json())


# --------------------------------------------------------------------------- main


def main() -> None:
    ap = H.parser(__doc__, repeat=1, sizes=C.SIZES, size="small", verify=True)
    ap.add_argument("--sections", default="finetune,gpu", help="finetune,gpu,pull")
    ap.add_argument("--steps", type=int, default=5, help="training steps = saves per run (section 1)")
    ap.add_argument("--runs", default=",".join(RUNS), help=f"section 1 runs, from {','.join(RUNS)}")
    ap.add_argument("--batch", type=int, default=4, help="section 1 batch size")
    ap.add_argument("--seq", type=int, default=64, help=f"section 1 sequence length (<= {C.CONTEXT})")
    ap.add_argument("--finetune-device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--gpu-batch", type=int, default=8)
    ap.add_argument("--gpu-seq", type=int, default=C.CONTEXT)
    ap.add_argument("--gpu-saves", type=int, default=3, help="saves per method (the first one allocates)")
    ap.add_argument("--gpu-train-after", type=int, default=3, help="training steps timed after each save")
    ap.add_argument("--gpu-methods", default=",".join(GPU_METHODS))
    ap.add_argument("--keep", action="store_true", help="keep the stores")
    ap.add_argument("--pull-repeat", type=int, default=3, help="section 3: resumes per pull mode")
    ap.add_argument("--pull-pack-threshold", type=float, default=4.0,
                    help="section 3: Packing.threshold in MiB (default 4, the Store's; 17 packs every tensor "
                         "of --size small)")
    args = ap.parse_args()
    if args.steps < 1 or args.seq > C.CONTEXT or args.gpu_seq > C.CONTEXT:
        ap.error(f"--steps >= 1 and --seq / --gpu-seq <= {C.CONTEXT}")
    bad = [m for m in args.gpu_methods.split(",") if m.strip() and m.strip() not in GPU_METHODS]
    bad += [r for r in args.runs.split(",") if r.strip() and r.strip() not in RUNS]
    if bad:
        ap.error(f"unknown --runs / --gpu-methods entries {bad}")
    base = H.scratch_dir(args.dir, warn_tmpfs=False)
    sections = {s.strip() for s in args.sections.split(",") if s.strip()}
    print(H.banner(dir=f"{base} ({C.fs_type(base)})"))
    report: dict[str, Any] = {}
    if "finetune" in sections:
        report["finetune"] = section_finetune(args, base)
        print()
    if "gpu" in sections:
        report["gpu"] = section_gpu(args, base)
    if "pull" in sections:
        report["pull"] = section_pull(args, base)
    H.write_json(args.json, args, **report)


if __name__ == "__main__":
    main()
