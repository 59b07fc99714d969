"""Which failures the uploader retries: transient transport errors, never damage found in a checkpoint."""
import pytest

from ckptstore import CorruptCheckpointError, UploadError
from ckptstore.retry import RetryPolicy, is_transient

BLOB = "4290500aa" + "0" * 55          # a blob id whose hex digits contain "429" and "500"


@pytest.mark.parametrize("error,transient", [
    (CorruptCheckpointError("blob content does not match its hash", step=500, blob=BLOB), False),
    (UploadError("gave up"), False),
    (FileNotFoundError(BLOB), False),
    (ValueError("bad"), False),
    (ConnectionResetError("reset by peer"), True),
    (TimeoutError(), True),
    (RuntimeError("HTTP 503 Service Unavailable"), True),
    (RuntimeError("SlowDown: please reduce your request rate"), True),
    (RuntimeError(f"no such thing as {BLOB}"), False),
])
def test_classification(error, transient):
    assert is_transient(error) is transient


def test_corrupt_checkpoint_is_raised_at_once_not_retried():
    calls = []

    def fn():
        calls.append(1)
        raise CorruptCheckpointError("manifest missing", step=500, blob=BLOB)
    with pytest.raises(CorruptCheckpointError):
        RetryPolicy(deadline=30, backoff=0.01).call(fn, "read")
    assert len(calls) == 1


def test_transient_errors_are_retried_until_success():
    calls = []

    def fn():
        calls.append(1)
        if len(calls) < 3:
            raise ConnectionResetError("reset by peer")
        return "ok"
    assert RetryPolicy(deadline=30, backoff=0.01).call(fn, "put") == "ok" and len(calls) == 3
