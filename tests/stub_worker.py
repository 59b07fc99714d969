"""A process that writes ckptstore Lightning stubs, for tests/integrations/test_integration_lightning.py.

``python stub_worker.py MODE ROOT [PATH STEP]``:

- ``save``: ``CkptstoreCheckpointIO(ROOT).save_checkpoint({"global_step": STEP, ...}, PATH)`` (a commit, then the
  stub at PATH), then ``teardown()``;
- ``resume``: ``CkptstoreCheckpointIO(ROOT).resume_path()`` (what a restarted Lightning run calls first; it
  rewrites the stubs a killed run did not write); prints ``RESUME <path>``.

With ``--kill-in-stub`` the process SIGKILLs itself right after the stub's temporary file is created (inside the
stub write). With ``--hold-in-stub`` it prints ``HOLDING <temporary file>`` there and waits for a line on stdin
before it goes on (a live writer caught mid-write). Both wrap ``tempfile.mkstemp`` in this process only.
"""
from __future__ import annotations

import argparse
import os
import signal
import sys
import tempfile
import warnings

warnings.filterwarnings("ignore")

import torch  # noqa: E402

from ckptstore.integrations import lightning as ckl  # noqa: E402


def arm(kill: bool, hold: bool) -> None:
    real = tempfile.mkstemp

    def mkstemp(*args, **kwargs):
        fd, name = real(*args, **kwargs)
        if os.path.basename(name).startswith(".ckptstore-stub-"):
            if kill:
                os.kill(os.getpid(), signal.SIGKILL)
            if hold:
                print(f"HOLDING {name}", flush=True)
                sys.stdin.readline()
        return fd, name

    tempfile.mkstemp = mkstemp


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("mode", choices=["save", "resume"])
    p.add_argument("root")
    p.add_argument("path", nargs="?")
    p.add_argument("step", type=int, nargs="?", default=0)
    p.add_argument("--kill-in-stub", action="store_true")
    p.add_argument("--hold-in-stub", action="store_true")
    a = p.parse_args()
    arm(a.kill_in_stub, a.hold_in_stub)
    if a.mode == "save":
        io = ckl.CkptstoreCheckpointIO(a.root)
        io.save_checkpoint({"global_step": a.step, "state_dict": {"w": torch.full((4,), float(a.step))}}, a.path)
        io.teardown()
    else:
        print(f"RESUME {ckl.CkptstoreCheckpointIO(a.root).resume_path()}", flush=True)
    print("DONE", flush=True)


if __name__ == "__main__":
    main()
