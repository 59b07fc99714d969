"""Network faults (issue 17, section 4), the parts covered so far: a conditional write whose answer was lost and
which the client library retried (the retry fails its own precondition against the write that landed) is
recognised as ours, not taken for a conflict; a body damaged or cut short in transfer is retried, never taken
for damage of the checkpoint. Against the loopback S3 server the tests start."""
import pytest

from ckptstore.retry import RetryPolicy, is_transient
from ckptstore.storage import open_storage

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
