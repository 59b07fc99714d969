#!/usr/bin/env python3
"""Kill a training run with SIGKILL and resume it: the losses are identical to an uninterrupted run.

    python examples/demo_kill_resume.py --out demo_out        (what `make demo` runs)

1. an uninterrupted reference run of ``examples/train_lm.py`` into ``OUT/ref``;
2. the same run into ``OUT/run``, SIGKILLed at a random moment: in the middle of training or in the middle of a
   checkpoint save (chosen at random; ``--kill-seed`` makes it reproducible);
3. the same command again: it resumes from the newest committed checkpoint and runs to the end;
4. the losses side by side, whether they are identical bit for bit, and the store's listing.

Exits 1 when the losses differ.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Dict, List, Optional

REPO = Path(__file__).resolve().parents[1]
TRAIN = REPO / "examples" / "train_lm.py"
ENV = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))


class Child:
    """train_lm.py in a subprocess; its stdout is echoed with a prefix and kept."""

    def __init__(self, tag: str, argv: List[str]):
        self.tag, self.lines = tag, []
        self.proc = subprocess.Popen([sys.executable, "-u", str(TRAIN), *argv], stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True, env=ENV, cwd=str(REPO))
        self.cond = threading.Condition()
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            line = line.rstrip("\n")
            if not line.startswith(("saving step", "saved step")):  # too chatty for a demo
                print(f"  [{self.tag}] {line}", flush=True)
            with self.cond:
                self.lines.append(line)
                self.cond.notify_all()
        with self.cond:
            self.cond.notify_all()

    def wait_for(self, prefix: str, nth: int) -> bool:
        with self.cond:
            while sum(l.startswith(prefix) for l in self.lines) < nth:
                if not self.reader.is_alive():
                    return False
                self.cond.wait(0.2)
            return True

    def wait(self) -> int:
        rc = self.proc.wait()
        self.reader.join()
        return rc

    def kill(self) -> bool:
        alive = self.proc.poll() is None
        if alive:
            self.proc.send_signal(signal.SIGKILL)
        self.wait()
        return alive


def read_log(path: Path) -> List[dict]:
    return [json.loads(l) for l in path.read_text().splitlines()] if path.exists() else []


def log_lines(path: Path) -> int:
    try:
        with open(path, "rb") as f:
            return f.read().count(b"\n")
    except FileNotFoundError:
        return 0


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="output directory (its ref/ and run/ are replaced)")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--ckpt-every", type=int, default=20)
    p.add_argument("--corpus-bytes", type=int, default=100_000,
                   help="training text (97 batches per epoch at the default batch size: the run crosses epochs)")
    p.add_argument("--kill-seed", type=int, default=None, help="seed of the kill moment (default: random)")
    p.add_argument("--every", type=int, default=20, help="table: show every k-th step (plus the resume window)")
    p.add_argument("train_args", nargs="*", help="extra arguments for train_lm.py (after --)")
    args = p.parse_args(argv)

    out = Path(args.out).resolve()
    ref_dir, run_dir = out / "ref", out / "run"
    for d in (ref_dir, run_dir):
        shutil.rmtree(d, ignore_errors=True)
        d.mkdir(parents=True)
    kill_seed = args.kill_seed if args.kill_seed is not None else random.SystemRandom().randrange(10**6)
    rng = random.Random(kill_seed)
    common = ["--steps", str(args.steps), "--ckpt-every", str(args.ckpt_every), "--corpus-bytes",
              str(args.corpus_bytes), *args.train_args]
    t_demo = time.monotonic()

    print(f"== 1. reference run, uninterrupted ({args.steps} steps, checkpoint every {args.ckpt_every})", flush=True)
    t = time.monotonic()
    ref = Child("ref", ["--store", str(ref_dir / "store"), "--log", str(ref_dir / "loss.jsonl"), *common])
    if ref.wait() != 0:
        print("reference run failed", file=sys.stderr)
        return 2
    t_ref = time.monotonic() - t
    save_s = [float(m.group(1)) for m in (re.search(r" in ([0-9.]+)s$", l) for l in ref.lines
                                           if l.startswith("saved step")) if m]
    save_s = sorted(save_s)[len(save_s) // 2] if save_s else 0.1

    run_log = run_dir / "loss.jsonl"
    run_argv = ["--store", str(run_dir / "store"), "--log", str(run_log), *common]
    n_saves = args.steps // args.ckpt_every
    mid_save = rng.random() < 0.5 and n_saves >= 3
    print(f"\n== 2. the same run, SIGKILLed {'during a checkpoint save' if mid_save else 'during training'} "
          f"(kill seed {kill_seed})", flush=True)
    run1 = Child("run 1", run_argv)
    if mid_save:
        nth = rng.randint(max(1, n_saves // 3), max(1, 2 * n_saves // 3))
        run1.wait_for("saving step", nth)
        time.sleep(rng.uniform(0.0, 0.8) * save_s)
    else:
        target = rng.randint(int(0.3 * args.steps), int(0.7 * args.steps))
        while log_lines(run_log) < target and run1.proc.poll() is None:
            time.sleep(0.005)
        time.sleep(rng.uniform(0.0, 0.05))
    killed = run1.kill()
    done1 = len(read_log(run_log))
    started = [int(l.split()[2]) for l in run1.lines if l.startswith("saving step")]
    saved = [int(l.split()[2]) for l in run1.lines if l.startswith("saved step")]
    in_flight = started[-1] if started and started[-1] not in saved else None
    if killed:
        where = f"in the middle of saving step {in_flight}" if in_flight is not None else "between checkpoints"
        print(f"  SIGKILL after {done1} logged steps, {where}; last completed save: "
              f"{saved[-1] if saved else None}", flush=True)
    elif run1.proc.returncode != 0:
        print(f"run 1 failed (exit status {run1.proc.returncode})", file=sys.stderr)
        return 2
    else:
        print("  (the run finished before the kill; nothing to resume)", flush=True)

    print("\n== 3. the same command again", flush=True)
    run2 = Child("run 2", run_argv)
    if run2.wait() != 0:
        print("resumed run failed", file=sys.stderr)
        return 2
    resumed = next((int(l.split()[-1]) for l in run2.lines if l.startswith("resumed from step")), None)
    print(f"  => resumed from step {resumed}, the newest committed checkpoint" if resumed is not None
          else "  => fresh start (no checkpoint had been committed)")

    # -- compare ----------------------------------------------------------------------------------------------
    ref_loss = {r["step"]: r["loss"] for r in read_log(ref_dir / "loss.jsonl")}
    entries = read_log(run_log)
    first, second = entries[:done1], entries[done1:]
    l1 = {r["step"]: r["loss"] for r in first}
    l2 = {r["step"]: r["loss"] for r in second}
    merged: Dict[int, float] = {**l1, **l2}
    redone_same = all(l1[s] == l2[s] for s in set(l1) & set(l2))
    missing = [s for s in range(1, args.steps + 1) if s not in merged]
    differ = [s for s in range(1, args.steps + 1) if s in merged and merged[s] != ref_loss.get(s)]
    identical = not missing and not differ and redone_same and len(ref_loss) == args.steps

    pivot = resumed if resumed is not None else 0
    show = set(range(args.every, args.steps + 1, args.every)) | {1, args.steps}
    show |= set(range(max(1, pivot - 2), min(args.steps, pivot + 3) + 1))
    show |= set(range(max(1, done1 - 1), min(args.steps, done1 + 1) + 1))
    show |= set(differ[:5])
    print(f"\n== 4. losses (every {args.every}th step, and around the kill / resume)")
    print(f"  {'step':>5}  {'reference':>20}  {'run 1 (killed)':>20}  {'run 2 (resumed)':>20}  same")
    fmt = lambda v: repr(v) if v is not None else "-"
    prev = 0
    for s in sorted(show):
        if s != prev + 1 and prev:
            print(f"  {'...':>5}")
        same = "yes" if merged.get(s) == ref_loss.get(s) else "NO"
        note = "  <- first step after resume" if resumed is not None and s == resumed + 1 else ""
        note = note or ("  <- last step before the kill" if killed and s == max(l1, default=0) else "")
        print(f"  {s:>5}  {fmt(ref_loss.get(s)):>20}  {fmt(l1.get(s)):>20}  {fmt(l2.get(s)):>20}  {same:>4}{note}")
        prev = s
    redone = sorted(set(l1) & set(l2))
    if redone:
        print(f"  steps {redone[0]}..{redone[-1]} ran in both runs (after the last checkpoint before the kill): "
              f"{'same losses both times' if redone_same else 'LOSSES DIFFER between the two attempts'}")
    if identical:
        print(f"\nIDENTICAL: all {args.steps} losses of the killed+resumed run equal the reference bit for bit.")
    else:
        print(f"\nDIFFERENT: {len(differ)} steps differ (first: {differ[:5]}), missing steps: {missing[:10]}, "
              f"redone steps consistent: {redone_same}")

    print(f"\n== 5. the store: {run_dir / 'store'}", flush=True)
    list_store(run_dir / "store")
    print(f"\nreference run {t_ref:.1f}s; demo total {time.monotonic() - t_demo:.1f}s")
    return 0 if identical else 1


def list_store(root: Path) -> None:
    exe = Path(sys.executable).with_name("ckptstore")
    cmd = None
    if exe.exists():
        cmd = [str(exe), "ls", str(root)]
    elif (REPO / "ckptstore" / "cli.py").exists():
        cmd = [sys.executable, "-c", "import sys; from ckptstore.cli import main; sys.argv[0] = 'ckptstore'; "
               "sys.exit(main())", "ls", str(root)]
    if cmd is not None:
        sys.stdout.flush()
        if subprocess.run(cmd, env=ENV, cwd=str(REPO)).returncode == 0:
            return
    sys.path.insert(0, str(REPO))
    from ckptstore import Store
    with Store(str(root)) as s:
        print(f"  committed steps: {s.steps()}  (latest: {s.latest_step()})")


if __name__ == "__main__":
    sys.exit(main())
