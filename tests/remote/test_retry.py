"""Which failures the uploader retries: transient transport errors, never damage found in a checkpoint."""
import pytest

from ckptstore import CorruptCheckpointError, UploadError
from ckptstore.util.retry import RetryPolicy, is_transient

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


class _Flaky:
    """A real local storage whose first ``fails`` calls of each read raise a connection reset."""

    def __init__(self, inner, fails: int):
        self.inner, self.fails, self.calls = inner, fails, []

    def __getattr__(self, name):
        attr = getattr(self.inner, name)
        if not callable(attr):
            return attr

        def call(*a, **kw):
            self.calls.append(name)
            if self.calls.count(name) <= self.fails and name != "write_atomic":
                raise ConnectionResetError(f"{name}: reset by peer")
            return attr(*a, **kw)
        return call


def test_a_remote_storage_retries_every_call_and_passes_the_rest_through(tmp_path):
    """What every remote call gets (resume reading straight from a remote, uploads, leases, deletions): a dropped
    connection is retried, a missing object is raised at once, past the deadline the call is named."""
    import torch
    from ckptstore.storage import open_storage
    from ckptstore.storage.retrying import RetryingStorage
    local = open_storage(str(tmp_path))
    local.write_atomic("a/b", b"payload")
    flaky = _Flaky(local, fails=2)
    remote = RetryingStorage(flaky, RetryPolicy(deadline=30, backoff=0.01))
    assert remote.read_bytes("a/b") == b"payload" and flaky.calls.count("read_bytes") == 3
    out = torch.zeros(3, dtype=torch.uint8)
    assert remote.read_range_into("a/b", 2, memoryview(out.numpy())) == 3 and bytes(out.numpy()) == b"ylo"
    assert remote.write_new("a/c", b"x") and flaky.calls.count("write_new") == 3
    flaky.fails = 100
    with pytest.raises(UploadError, match="read_bytes a/b"):           # past the deadline: named
        RetryingStorage(flaky, RetryPolicy(deadline=0.2, backoff=0.01)).read_bytes("a/b")
    flaky.fails, flaky.calls = 0, []
    with pytest.raises(FileNotFoundError):
        remote.read_bytes("missing")
    assert flaky.calls == ["read_bytes"]                                # not retried
    remote.write_atomic("a/c", b"y")
    assert local.read_bytes("a/c") == b"y" and remote.url == local.url


def test_a_dropped_connection_under_the_catalog_is_retried_not_taken_for_damage(tmp_path):
    """The catalog reads any failed read of a commit marker or manifest as damage (resume would then fall back
    to an older step); beneath it, the reads of a remote step being pulled or read are retried."""
    import torch
    from ckptstore import CheckpointError, Store
    from ckptstore.format.catalog import Catalog
    from ckptstore.storage import open_storage
    from ckptstore.storage.retrying import RetryingStorage
    with Store(tmp_path / "s") as s:
        s.save({"w": torch.arange(10.0)}, 1)
    with pytest.raises(CheckpointError, match="unreadable"):
        Catalog(_Flaky(open_storage(str(tmp_path / "s")), fails=1)).read_commit(1)
    catalog = Catalog(RetryingStorage(_Flaky(open_storage(str(tmp_path / "s")), fails=1),
                                      RetryPolicy(deadline=30, backoff=0.01)))
    commit = catalog.read_commit(1)
    assert catalog.read_manifest(commit, 0).step == 1
