"""Launch ``tests/dist_worker.py`` as N ranks, the way torchrun does (RANK, WORLD_SIZE, LOCAL_RANK,
MASTER_ADDR=127.0.0.1, MASTER_PORT), each rank in a session of its own; collect their ``RESULT`` lines."""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Dict, List, Optional

REPO = Path(__file__).resolve().parents[1]
WORKER = Path(__file__).resolve().parent / "dist_worker.py"


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Job:
    """N ranks of the worker. ``wait()`` -> rank -> its ``RESULT`` dict (``None`` if it printed none)."""

    def __init__(self, world: int, *args: str, env: Optional[Dict[str, str]] = None, worker: Path = WORKER):
        port = free_port()
        self.procs: List[subprocess.Popen] = []
        base = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(world),
                    OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo",
                    PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
                    **(env or {}))
        for r in range(world):
            self.procs.append(subprocess.Popen(
                [sys.executable, "-u", str(worker), *args], env=dict(base, RANK=str(r), LOCAL_RANK=str(r)),
                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
                cwd=str(REPO)))

    def wait(self, timeout: float = 240, ranks=None) -> Dict[int, Optional[dict]]:
        deadline = time.monotonic() + timeout
        out: Dict[int, Optional[dict]] = {}
        self.outputs: Dict[int, str] = {}
        try:
            for r, p in enumerate(self.procs):
                if ranks is not None and r not in ranks:
                    continue
                text, _ = p.communicate(timeout=max(1.0, deadline - time.monotonic()))
                self.outputs[r] = text
                found = [ln[len("RESULT "):] for ln in text.splitlines() if ln.startswith("RESULT ")]
                merged: Optional[dict] = None
                for line in found:                      # later lines add to earlier ones
                    merged = {**(merged or {}), **json.loads(line)}
                out[r] = merged
        except subprocess.TimeoutExpired:
            self.kill()
            raise
        return out

    def check(self, timeout: float = 240) -> Dict[int, Optional[dict]]:
        """``wait`` and assert every rank exited 0 (showing their output otherwise)."""
        res = self.wait(timeout)
        bad = {r: p.returncode for r, p in enumerate(self.procs) if p.returncode != 0}
        assert not bad, f"ranks failed {bad}:\n" + "\n".join(f"--- rank {r}\n{self.outputs[r][-3000:]}"
                                                              for r in bad)
        return res

    def kill(self) -> None:
        """SIGKILL every rank (each runs in a session of its own), and any process group they started."""
        for p in self.procs:
            for target in (lambda: os.killpg(p.pid, signal.SIGKILL), lambda: p.kill()):
                try:
                    target()
                except (ProcessLookupError, PermissionError):
                    pass
        for p in self.procs:
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                pass
            if p.stdout:
                p.stdout.close()


def run(world: int, *args: str, timeout: float = 240, **kw) -> Dict[int, Optional[dict]]:
    return Job(world, *args, **kw).check(timeout)
