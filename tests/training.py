"""The training-run harness shared by the kill/resume tests: ``examples/train_lm.py`` in a subprocess.

``Child`` runs it and follows its stdout (``saving step S`` / ``saved step S ...`` / ``resumed from step S``),
``read_log`` / ``check_against_reference`` compare its per-step losses with an uninterrupted run.
"""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Dict, List, Optional

REPO = Path(__file__).resolve().parents[1]
TRAIN = REPO / "examples" / "train_lm.py"
# the checkout's package (also when pytest is run without -m from elsewhere), and examples/ for the demo's log_lines
for _p in (str(REPO), str(REPO / "examples")):
    if _p not in sys.path:
        sys.path.insert(0, _p)

from demo_kill_resume import log_lines  # noqa: E402,F401  (tests take it from here)

# A small, fast configuration (~10-15 ms per step here). ckpt-every is not part of the run config.
# 20 kB of corpus = 622 windows = 77 batches per epoch: the runs cross epoch boundaries (steps 77, 154).
MODEL_ARGS = ["--block", "32", "--batch-size", "8", "--d-model", "64", "--layers", "2", "--heads", "4",
              "--corpus-bytes", "20000"]
CKPT_EVERY = 5
N_REF = 200

_SAVING = re.compile(r"^saving step (\d+)$")
_SAVED = re.compile(r"^saved step (\d+) .* in ([0-9.]+)s$")
_RESUMED = re.compile(r"^resumed from step (\d+)$")


class Child:
    """``train_lm.py`` in a subprocess; a thread collects its stdout lines as they come."""

    def __init__(self, store: Path, log: Path, steps: int, *extra: str, ckpt_every: int = CKPT_EVERY):
        cmd = [sys.executable, "-u", str(TRAIN), "--store", str(store), "--log", str(log), "--steps", str(steps),
               "--ckpt-every", str(ckpt_every), *MODEL_ARGS, *extra]
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
        self.t0 = time.monotonic()
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                                     cwd=str(REPO))
        self.lines: List[str] = []
        self.cond = threading.Condition()
        self.killed = False
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            with self.cond:
                self.lines.append(line.rstrip("\n"))
                self.cond.notify_all()
        with self.cond:
            self.cond.notify_all()

    def wait_line(self, pattern: re.Pattern, nth: int = 1, timeout: float = 120.0) -> Optional[re.Match]:
        """Block until the ``nth`` line matching ``pattern``; ``None`` if the process ended first."""
        deadline = time.monotonic() + timeout
        with self.cond:
            while True:
                found = [m for m in map(pattern.match, self.lines) if m]
                if len(found) >= nth:
                    return found[nth - 1]
                if self.proc.poll() is not None and not self._reader.is_alive():
                    return None
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"no line matching {pattern.pattern!r} within {timeout}s:\n" + self.output())
                self.cond.wait(min(left, 0.5))

    def kill(self) -> bool:
        """SIGKILL; returns False when the process had already exited."""
        alive = self.proc.poll() is None
        if alive:
            self.proc.send_signal(signal.SIGKILL)
            self.killed = True
        self.proc.wait()
        self._reader.join()
        return alive

    def finish(self, timeout: float = 300.0) -> None:
        try:
            self.proc.wait(timeout)
        finally:
            if self.proc.poll() is None:
                self.kill()
        self._reader.join()
        assert self.proc.returncode == 0, f"train_lm.py exited {self.proc.returncode}:\n{self.output()}"

    def output(self) -> str:
        return "\n".join(self.lines)

    # -- what the run said ----------------------------------------------------------------------------------
    def resumed_from(self) -> Optional[int]:
        """The resume step, ``None`` for a fresh start; ``-1`` when it died before saying."""
        for line in self.lines:
            m = _RESUMED.match(line)
            if m:
                return int(m.group(1))
            if line == "fresh start":
                return None
        return -1

    def saved(self) -> List[int]:
        return [int(m.group(1)) for m in map(_SAVED.match, self.lines) if m]

    def save_in_flight(self) -> Optional[int]:
        """The step of a ``saving`` line with no ``saved`` line after it (after the process is gone)."""
        started = [int(m.group(1)) for m in map(_SAVING.match, self.lines) if m]
        return started[-1] if started and started[-1] not in self.saved() else None


def read_log(path: Path) -> Dict[int, List[float]]:
    """step -> every loss logged for it, in order (a step redone after a kill is logged again)."""
    out: Dict[int, List[float]] = {}
    if not path.exists():
        return out
    for i, line in enumerate(path.read_text().splitlines()):
        rec = json.loads(line)  # one write() per line: a kill never leaves half a line
        out.setdefault(int(rec["step"]), []).append(rec["loss"])
    return out


def check_against_reference(log: Dict[int, List[float]], ref: Dict[int, float], steps: int) -> None:
    missing = [s for s in range(1, steps + 1) if s not in log]
    assert not missing, f"steps never logged: {missing[:20]}"
    extra = sorted(set(log) - set(range(1, steps + 1)))
    assert not extra, f"steps beyond the run: {extra[:20]}"
    unstable = {s: v for s, v in log.items() if len(set(v)) != 1}
    assert not unstable, f"a redone step logged different losses: {dict(list(unstable.items())[:5])}"
    merged = {s: v[-1] for s, v in log.items()}
    diff = [(s, ref[s], merged[s]) for s in range(1, steps + 1) if merged[s] != ref[s]]
    assert not diff, f"{len(diff)} steps differ from the reference (step, ref, got): {diff[:10]}"


