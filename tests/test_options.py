"""Store's options as small objects: a plain remote URL is ``Remote(url)``, bad values fail where they are written
(naming the option and its unit), the former flat spellings are gone, and the guard of the public methods."""
import pytest
import torch

from ckptstore import CheckpointError, Packing, Remote, Retention, RetryPolicy, Store, Writing


def test_a_remote_url_is_remote_of_that_url_and_both_upload_and_resume(tmp_path):
    url = f"file://{tmp_path / 'remote'}"
    with Store(tmp_path / "a", remote=url) as s:
        assert s.remote == Remote(url)
        s.save({"w": torch.arange(10.0)}, 1)
        s.wait_for_uploads()
    retry = RetryPolicy(deadline=30, op_timeout=10)
    with Store(tmp_path / "b", remote=Remote(url, workers=2, retry=retry, upload=False)) as s:
        state = {"w": None}
        assert s.resume(state) == 1 and s.resumed_from["tier"] == "remote"
        assert torch.equal(state["w"], torch.arange(10.0))


@pytest.mark.parametrize("make, words", [
    (lambda: Writing(codec="lz4"), "Writing.codec"),
    (lambda: Writing(chunk_size=1000), "Writing.chunk_size must be an int >= 4096"),
    (lambda: Writing(workers=0), "Writing.workers"),
    (lambda: Writing(packing={"threshold": 0}), "Writing.packing"),
    (lambda: Remote(""), "Remote.url"),
    (lambda: Remote("s3://b/p", workers=0), "Remote.workers"),
    (lambda: Remote("s3://b/p", backlog=True), "Remote.backlog"),
    (lambda: Remote("s3://b/p", keep_local=-1), "Remote.keep_local"),
    (lambda: Remote("s3://b/p", retry=30), "Remote.retry"),
])
def test_bad_options_fail_where_they_are_written(make, words):
    with pytest.raises((ValueError, TypeError), match=words):
        make()


def test_store_refuses_wrong_option_types_and_the_old_flat_spellings(tmp_path):
    with pytest.raises(TypeError, match="writing must be a ckptstore.Writing"):
        Store(tmp_path, writing=Packing())
    with pytest.raises(TypeError, match="remote must be a URL string or a ckptstore.Remote"):
        Store(tmp_path, remote=123)
    with pytest.raises(TypeError, match="keep must be a ckptstore.Retention"):
        Store(tmp_path, keep=3)
    for old in ("keep_last", "keep_local", "upload_workers", "chunk_size", "commit_timeout", "packing"):
        with pytest.raises(TypeError, match=old):
            Store(tmp_path, **{old: 1})


def test_writing_options_reach_the_saves(tmp_path):
    writing = Writing(chunk_size=4096, codec="zstd", packing=Packing(threshold=0))
    with Store(tmp_path, writing=writing, keep=Retention(last=1)) as s:
        r = s.save({"z": torch.zeros(4096)}, 1)              # 16 KiB of zeros: 4 chunks of 4096 bytes, 1 id
        assert r.blobs_total == 4 and r.blobs_new == 1 and r.bytes_written < 4096
        s.save({"z": torch.ones(4096)}, 2)
        assert s.steps() == [2]                              # the retention policy ran after the commit


def test_public_methods_are_guarded_once_closed_and_read_only(tmp_path):
    with Store(tmp_path) as s:
        s.save({"x": torch.ones(3)}, 1)
    for call in (lambda: s.save({"x": 1}, 2), lambda: s.load(), lambda: s.resume({}), lambda: s.verify()):
        with pytest.raises(CheckpointError, match="is closed"):
            call()
    with Store(tmp_path, read_only=True) as r:
        assert torch.equal(r.load(1)["x"], torch.ones(3))
        for name, call in (("save", lambda: r.save({"x": 1}, 2)), ("gc", lambda: r.gc()),
                           ("pull", lambda: r.pull()), ("delete_step", lambda: r.delete_step(1))):
            with pytest.raises(CheckpointError, match=f"read_only: {name} is not allowed"):
                call()
        assert r.steps() == [1]
