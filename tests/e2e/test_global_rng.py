"""ckptstore never moves the caller's global random generators (issue 26 item 1; README "Randomness"): Python's
``random``, NumPy's global generator and torch's CPU generator hold the same state before and after every
call, with a remote, under network faults (retries run in the uploader's threads, at moments the network
sets), and in a fresh process, where the first remote store imports the client libraries (s3fs -> httpx ->
rich, whose import draws). Against the loopback S3 / GCS servers the tests start, through tests/faultproxy.py."""
import json
import random
import shutil
import subprocess
import sys
import time

import numpy as np
import pytest
import torch

from ckptstore import Remote, RetryPolicy, Store, UploadError
from faultproxy import FaultProxy

pytestmark = pytest.mark.remote


def generators():
    """The three global generators' states, comparable with ``==``."""
    np_state = np.random.get_state()
    out = (random.getstate(), np_state[1].tobytes(), np_state[2:], torch.get_rng_state().numpy().tobytes())
    if torch.cuda.is_available():
        out += (torch.cuda.get_rng_state().numpy().tobytes(),)
    return out


def seed_all(seed: int):
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    return generators()


def _state(step, g):
    return {"w": torch.randn(200_000, generator=g), "small": [torch.randn(64, generator=g) for _ in range(4)],
            "step": step}


def _through(proxy, opts):
    return dict(opts, endpoint_url=proxy.endpoint)


@pytest.mark.parametrize("kind", ["s3", "gcs"])
def test_no_call_and_no_background_retry_moves_the_global_generators(tmp_path, request, kind):
    target = request.getfixturevalue(f"{kind}_bucket_url")
    url, opts = target
    upstream = int(opts["endpoint_url"].rsplit(":", 1)[1].split("/")[0])
    retry = RetryPolicy(deadline=20, op_timeout=4, backoff=0.05, max_backoff=0.5)
    g = torch.Generator().manual_seed(0)              # the test's own data: never the global generators
    seeded = seed_all(1234)

    def unmoved(what):
        assert generators() == seeded, f"{what} moved a global random generator"

    def injected():
        return sum(n for fate, n in proxy.counts.items() if fate != "ok")

    def uploaded():                                   # uploads retried under faults, in the uploader's threads
        deadline = time.monotonic() + 120
        while True:
            try:
                return s.wait_for_uploads(timeout=60)
            except UploadError:
                unmoved("a failed upload")
                assert time.monotonic() < deadline, "uploads never got through the faults"

    # GCS clients keep one connection alive and a save's uploads cross it in well under a second: fewer healthy
    # connections, each short-lived, so that enough requests meet a fault however fast the uploads go
    weights = (2, 2, 2, 0, 6) if kind == "s3" else (3, 3, 2, 0, 3)
    lifetime = (0.3, 2.0) if kind == "s3" else (0.05, 0.3)
    with FaultProxy(upstream, seed=26, weights=weights, slowdown_status=503 if kind == "s3" else 429,
                    ok_lifetime=lifetime) as proxy:
        root = tmp_path / "run"
        s = Store(root, remote=Remote(url, retry=retry), storage_options=_through(proxy, opts))
        unmoved("Store(remote=...)")
        proxy.faults = True              # every connection from now on: resets, 503 / 429 answers, lost answers
        assert s.resume({"w": torch.zeros(200_000), "small": [], "step": 0}) is None
        unmoved("resume")
        s.save(_state(1, g), 1)
        unmoved("a blocking save")
        newest = 1
        for step in range(2, 80):                     # until the proxy has injected a few faults
            try:
                s.save(_state(step, g), step, blocking=False)
                newest = step
            except UploadError:                       # an upload's failure, raised once; nothing saved
                pass
            unmoved("a non-blocking save")
            if step % 3 == 0:
                uploaded()
            if step >= 6 and injected() >= 4:
                break
        uploaded()
        unmoved("uploads retried under faults")
        proxy.faults = False
        s.close()
        unmoved("close")
        assert injected() >= 4, f"too few faults injected to prove anything: {dict(proxy.counts)}"

        shutil.rmtree(root)                           # the node is gone: resume from the remote
        s = Store(root, remote=Remote(url, retry=retry), storage_options=_through(proxy, opts))
        target_state = {"w": torch.zeros(200_000), "small": [], "step": 0}
        assert s.resume(target_state) == newest and target_state["step"] == newest
        unmoved("a resume from the remote into a wiped root")
        s.close()
        unmoved("close")


FIRST_STORES = """
import json, random, sys
import numpy as np, torch
targets, root = json.loads(sys.argv[1]), sys.argv[2]
random.seed(7); np.random.seed(7); torch.manual_seed(7)
def generators():
    return (random.getstate(), np.random.get_state()[1].tobytes(), torch.get_rng_state().numpy().tobytes())
seeded, moved = generators(), []
from ckptstore import Store
for i, (url, opts) in enumerate(targets):
    with Store(f"{root}/{i}", remote=url, storage_options=opts) as s:
        if generators() != seeded: moved.append(f"Store(remote={url})")
        s.save({"w": torch.ones(1000)}, 1)
        s.wait_for_uploads(timeout=60)
        if generators() != seeded: moved.append(f"save / upload to {url}")
    if generators() != seeded: moved.append(f"close of {url}")
print(json.dumps(moved))
"""


def test_the_first_remote_stores_of_a_process_move_no_global_generator(tmp_path, s3_bucket_url, gcs_bucket_url):
    """In a fresh interpreter the first ``Store(remote=...)`` of each kind imports its client libraries; their
    import-time draws (rich's ``getrandbits(24)`` under s3fs) must not reach the caller's generators."""
    targets = [list(s3_bucket_url), list(gcs_bucket_url)]
    out = subprocess.run([sys.executable, "-c", FIRST_STORES, json.dumps(targets), str(tmp_path)],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert json.loads(out.stdout.strip().splitlines()[-1]) == [], out.stdout
