"""Network faults (issue 17, section 4), the parts covered so far: a conditional write whose answer was lost and
which the client library retried (the retry fails its own precondition against the write that landed) is
recognised as ours, not taken for a conflict; a body damaged or cut short in transfer is retried, never taken
for damage of the checkpoint. Against the loopback S3 server the tests start."""
import pytest

from ckptstore.util.retry import RetryPolicy, is_transient
from ckptstore.storage import open_storage
from ckptstore import Remote

pytestmark = pytest.mark.remote


def test_a_retried_conditional_write_recognises_its_own_landed_write(s3_bucket_url):
    url, opts = s3_bucket_url
    st = open_storage(url, opts)
    body = b'{"token": "abc123", "renewed": 1795487239.04}\n'
    assert st.write_new("locks/writer.json", body)
    # the answer was lost; botocore sent the create again: it finds the object, which holds our bytes
    assert st.write_new("locks/writer.json", body)
    assert not st.write_new("locks/writer.json", b'{"token": "someone else"}\n')
    _, token = st.read_versioned("locks/writer.json")
    renewed = body.replace(b"1795487239.04", b"1795487269.04")
    assert st.write_if_match("locks/writer.json", renewed, token)
    # the same renewal sent again with the token it was sent with (now stale): ours, not a takeover
    assert st.write_if_match("locks/writer.json", renewed, token)
    # a renewal that did not land, against a stale token: a real conflict
    assert not st.write_if_match("locks/writer.json", renewed.replace(b"69", b"99"), token)
    assert st.read_bytes("locks/writer.json") == renewed


def test_bodies_damaged_in_transfer_are_transient_and_retried():
    from botocore.exceptions import FlexibleChecksumError, IncompleteReadError

    damaged = [FlexibleChecksumError(error_msg="Expected checksum abc did not match calculated checksum def"),
               IncompleteReadError(actual_bytes=10, expected_bytes=100)]
    for e in damaged:
        assert is_transient(e), type(e).__name__
    calls = []

    def flaky():
        calls.append(1)
        if len(calls) < 3:
            raise damaged[len(calls) - 1]
        return b"ok"
    assert RetryPolicy(deadline=10, backoff=0.01).call(flaky, "read") == b"ok"
    assert len(calls) == 3


def _state(step):
    import torch
    return {"w": torch.full((50_000,), float(step)), "small": [torch.full((64,), float(step + i)) for i in range(6)],
            "step": step}


def test_uploads_recover_in_the_same_process_once_the_network_heals(tmp_path, s3_bucket_url, monkeypatch):
    """Training saves every step without blocking while the link to S3 resets connections, throttles, stalls
    and loses answers to requests the server applied; then the faults stop. The remote must catch up with the
    local store in the same process (no restart), every remote step verifying, and training must only ever have
    seen UploadErrors, never lost a step."""
    import time

    import torch
    from ckptstore import Store
    from ckptstore.util.errors import UploadError
    from faultproxy import FaultProxy

    import ckptstore.lifecycle.lease
    monkeypatch.setattr(ckptstore.lifecycle.lease, "TTL", 4.0)   # the remote writer lease is renewed every second, under faults
    url, opts = s3_bucket_url
    upstream = int(opts["endpoint_url"].rsplit(":", 1)[1].split("/")[0])
    with FaultProxy(upstream, seed=17) as proxy:
        popts = dict(opts, endpoint_url=proxy.endpoint,
                     config_kwargs={"retries": {"max_attempts": 3, "mode": "standard"},
                                    "connect_timeout": 2, "read_timeout": 4})
        errors = []
        retry = RetryPolicy(deadline=8, op_timeout=4, backoff=0.05, max_backoff=1)
        s = Store(tmp_path / "local", remote=Remote(url, retry=retry), storage_options=popts)
        try:
            for step in range(1, 19):
                proxy.faults = step < 16                   # steps 1-15 under faults, then the network heals
                try:
                    s.save(_state(step), step, blocking=False)
                except UploadError as e:                   # training sees an upload failure, never loses a step
                    errors.append(e)
                time.sleep(0.2 if proxy.faults else 0)
            deadline = time.monotonic() + 90
            while True:
                try:
                    s.wait_for_uploads(timeout=30)
                    break
                except UploadError as e:
                    errors.append(e)
                    assert time.monotonic() < deadline, f"uploads never recovered: {e}"
            local = s.steps()
        finally:
            s.close()
        faults = sum(v for k, v in proxy.counts.items() if k != "ok")
    assert faults >= 5, f"the proxy injected too few faults to prove anything: {dict(proxy.counts)}"
    assert local[-1] == 18
    with Store(tmp_path / "check", remote=Remote(url, upload=False), storage_options=opts) as r:
        target = {"w": torch.zeros(50_000), "small": [], "step": 0}
        assert r.resume(target) == 18, "the remote did not catch up with the local store"
        assert torch.equal(target["w"], torch.full((50_000,), 18.0))


def test_a_body_damaged_in_transfer_during_a_remote_resume_is_read_again(tmp_path, s3_bucket_url):
    """Bytes of a GET that fail their hash may have been damaged on the way: the read is repeated before the
    object counts as damaged, so resume still takes the newest step (before: an older one, or a fresh start)."""
    import torch
    from ckptstore import Store
    from faultproxy import FaultProxy

    url, opts = s3_bucket_url
    with Store(tmp_path / "a", remote=url, storage_options=opts) as s:
        for step in (1, 2):
            s.save(_state(step), step)
        s.wait_for_uploads(timeout=60)
    upstream = int(opts["endpoint_url"].rsplit(":", 1)[1].split("/")[0])
    with FaultProxy(upstream) as proxy:
        popts = dict(opts, endpoint_url=proxy.endpoint,
                     config_kwargs={"response_checksum_validation": "when_required"})
        proxy.corrupt_bodies, proxy.corrupt_match = 1, b"/packs/"      # the newest step's pack, once
        with Store(tmp_path / "b", remote=Remote(url, upload=False), storage_options=popts) as s:
            target = {"w": torch.zeros(50_000), "small": [], "step": 0}
            got = s.resume(target)
        assert proxy.counts["corrupt"] == 1
    assert got == 2
    assert torch.equal(target["w"], torch.full((50_000,), 2.0)) and target["step"] == 2
