"""An object store that accepts requests and never answers (issue 26 item 6): every remote call runs under the
retry policy's deadline (ckptstore/storage/retrying.py), so ``close()`` returns or raises within about
``deadline + 2 x op_timeout`` seconds, and opening a store and resuming from local steps are bounded too.
The silence comes from tests/faultproxy.py's ``blackhole`` mode in front of the loopback servers. Each call
runs in a thread joined with a timeout: a regression fails the test instead of hanging it."""
import shutil
import threading
import time

import pytest
import torch

from ckptstore import Remote, RetryPolicy, Store, TransferError, UploadError
from ckptstore.format.layout import LATEST
from ckptstore.storage import open_storage
from faultproxy import FaultProxy

pytestmark = pytest.mark.remote

DEADLINE, OP_TIMEOUT = 4.0, 1.5
BOUND = DEADLINE + 2 * OP_TIMEOUT + 10.0          # the rule's bound, plus room for a loaded test machine
#: while the server answers (a client's first request builds it: seconds on a loaded machine)
HEALTHY = RetryPolicy(deadline=60, op_timeout=30)


def policy():
    return RetryPolicy(deadline=DEADLINE, op_timeout=OP_TIMEOUT, backoff=0.05, max_backoff=0.5)


def bounded(fn, limit=BOUND):
    """``(seconds, result or the exception raised)`` of ``fn()``; fails the test if it runs past ``limit``."""
    out = {}

    def run():
        try:
            out["value"] = fn()
        except BaseException as e:  # noqa: B902 - handed to the test
            out["value"] = e
    t0 = time.monotonic()
    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(limit)
    took = time.monotonic() - t0
    assert not thread.is_alive(), f"still waiting after {took:.0f} s (bound {limit:.0f} s)"
    return took, out["value"]


def _through(proxy, opts):
    return dict(opts, endpoint_url=proxy.endpoint)


def _upstream(opts):
    return int(opts["endpoint_url"].rsplit(":", 1)[1].split("/")[0])


def _state(step):
    g = torch.Generator().manual_seed(step)
    return {"w": torch.randn(1_000_000, generator=g), "small": [torch.randn(256, generator=g) for _ in range(8)],
            "step": step}


@pytest.mark.parametrize("kind", ["s3", "gcs"])
def test_close_returns_within_the_deadline_when_the_store_stops_answering(tmp_path, request, kind, monkeypatch):
    import ckptstore.lifecycle.lease
    monkeypatch.setattr(ckptstore.lifecycle.lease, "TTL", 3.0)    # the writer lease close() could not release goes stale
    url, opts = request.getfixturevalue(f"{kind}_bucket_url")
    with FaultProxy(_upstream(opts)) as proxy:
        with Store(tmp_path / "run", remote=Remote(url, retry=HEALTHY), storage_options=_through(proxy, opts)) as s:
            s.save(_state(1), 1)
        s = Store(tmp_path / "run", remote=Remote(url, retry=policy()), storage_options=_through(proxy, opts))
        assert s.resume(_state(0)) == 1
        for step in (2, 3):
            s.save(_state(step), step, blocking=False)
        proxy.blackhole = True                    # uploads in flight: the server stops answering
        s.save(_state(4), 4)
        took, raised = bounded(s.close)
        assert isinstance(raised, UploadError), raised
        assert ("upload of step" in str(raised) or "upload start-up" in str(raised)) and url in str(raised)
        print(f"close() against a silent {kind} endpoint: {took:.1f} s (deadline {DEADLINE} s, op_timeout "
              f"{OP_TIMEOUT} s)")
        proxy.blackhole = False
    with Store(tmp_path / "run", remote=Remote(url, retry=HEALTHY), storage_options=opts) as s:
        s.wait_for_uploads(timeout=60)            # nothing lost: the next open finishes the uploads
        assert s.steps()[-1] == 4
    with Store(url, storage_options=opts, create=False) as r:
        assert r.steps()[-1] == 4


def test_opening_a_store_and_resuming_from_local_steps_are_bounded_by_a_silent_remote(tmp_path, s3_bucket_url):
    url, opts = s3_bucket_url
    with FaultProxy(_upstream(opts)) as proxy:
        popts = _through(proxy, opts)
        with Store(tmp_path / "run", remote=Remote(url, retry=HEALTHY), storage_options=popts) as s:
            s.save(_state(1), 1)
        proxy.blackhole = True
        took_open, s = bounded(lambda: Store(tmp_path / "run", remote=Remote(url, retry=policy()),
                                             storage_options=popts))
        assert isinstance(s, Store), s
        target = {"w": torch.zeros(1_000_000), "small": [], "step": 0}
        took_resume, step = bounded(lambda: s.resume(target))
        assert step == 1 and target["step"] == 1          # the local step: the remote's listing gave up
        took_close, raised = bounded(s.close)
        assert raised is None or isinstance(raised, UploadError), raised
        # one remote call, straight through the storage API
        storage = open_storage(url, popts, retry=policy())
        took_read, raised = bounded(lambda: storage.read_bytes(LATEST))
        assert isinstance(raised, UploadError) and f"read_bytes {LATEST}" in str(raised), raised
        print(f"silent S3 endpoint: Store() {took_open:.1f} s, resume {took_resume:.1f} s, close {took_close:.1f} s, "
              f"one read {took_read:.1f} s")


@pytest.mark.parametrize("lost", ["root", "chunks"])
def test_resume_never_starts_fresh_while_a_silent_remote_may_hold_the_steps(tmp_path, s3_bucket_url, lost):
    """The local root is lost (``root``: a new machine) or holds only steps that no longer load (``chunks``: its
    objects and packs gone) while the remote stops answering: resume retries the remote's listing for the
    retry policy's deadline, then raises TransferError naming the remote, touching nothing; it once returned
    None (a fresh start, whose saves would then race the remote's newer steps). Once the remote answers again,
    the same call resumes the newest step from it."""
    url, opts = s3_bucket_url
    with FaultProxy(_upstream(opts)) as proxy:
        popts = _through(proxy, opts)
        with Store(tmp_path / "run", remote=Remote(url, retry=HEALTHY), storage_options=popts) as s:
            for step in (1, 2):
                s.save(_state(step), step)
            s.wait_for_uploads(timeout=60)
        if lost == "root":
            shutil.rmtree(tmp_path / "run")
        else:
            for d in ("objects", "packs"):
                shutil.rmtree(tmp_path / "run" / d, ignore_errors=True)
        proxy.blackhole = True
        took_open, s = bounded(lambda: Store(tmp_path / "run", remote=Remote(url, retry=policy()),
                                             storage_options=popts))
        assert isinstance(s, Store), s
        target = {"w": torch.zeros(1_000_000), "small": [torch.zeros(256) for _ in range(8)], "step": 0}
        took, raised = bounded(lambda: s.resume(target))
        assert isinstance(raised, TransferError), raised
        assert "resume does not start the run fresh" in str(raised) and url in str(raised), raised
        assert target["step"] == 0 and not target["w"].any()
        proxy.blackhole = False
        took_again, step = bounded(lambda: s.resume(target), limit=120)
        assert step == 2 and s.resumed_from["tier"] == "remote", (step, s.resumed_from)
        assert torch.equal(target["w"], _state(2)["w"]) and target["step"] == 2
        bounded(s.close, limit=120)
        print(f"silent S3 endpoint, local {lost} lost: resume raised after {took:.1f} s (deadline {DEADLINE} s, "
              f"op_timeout {OP_TIMEOUT} s)")
