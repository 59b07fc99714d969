"""Store's options as small objects: a plain remote URL is ``Remote(url)``, bad values fail where they are written
(naming the option and its unit), the former flat spellings are gone, and the guard of the public methods."""
import pytest
import torch

from ckptstore import CheckpointError, Memory, Packing, Remote, Retention, RetryPolicy, Store, Writing


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
    (lambda: Remote("s3://b/p", every=0), "Remote.every"),
    (lambda: Memory("s3://b/p"), "Memory.root must be a local"),
    (lambda: Memory("/dev/shm/x", every=2, disk_every=3), "must be a multiple of Memory.every"),
    (lambda: Memory("/dev/shm/x", capacity=0), "Memory.capacity"),
    (lambda: Memory("/dev/shm/x", replicas=-1), "Memory.replicas"),
    (lambda: Memory("/dev/shm/x", timeout=0), "Memory.timeout"),
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


def test_memory_cadences_promote_and_upload_only_the_steps_they_name(tmp_path):
    """One process: memory every 2 steps, disk every 4th, remote every 8th; a step due for no tier is not saved
    (None); the newest memory step resumes first, the disk and remote hold only their cadences' steps."""
    url = f"file://{tmp_path / 'remote'}"
    mem = Memory(str(tmp_path / "mem"), every=2, disk_every=4, keep=2)
    with Store(tmp_path / "disk", memory=mem, remote=Remote(url, every=8)) as s:
        for step in range(1, 11):
            out = s.save({"w": torch.full((1000,), float(step))}, step)
            assert (out is None) == (step % 2 == 1)
        s.wait_for_uploads()
        assert Store(tmp_path / "disk", read_only=True).steps() == [4, 8]
        assert s.steps() == [4, 8, 10]                 # with the memory tier's steps (issue 29)
        assert s.step_tiers() == {4: ["local"], 8: ["memory", "local", "remote"], 10: ["memory"]}
        assert Store(url, read_only=True).steps() == [8]
        assert Store(tmp_path / "mem", read_only=True).steps() == [8, 10]
    with Store(tmp_path / "disk", memory=mem, remote=Remote(url, every=8)) as s:
        state = {"w": None}
        assert s.resume(state) == 10 and s.resumed_from["tier"] == "memory"
        assert torch.equal(state["w"], torch.full((1000,), 10.0))
    # the memory root lost: the disk's newest step, and memory steps newer than it are gone
    import shutil
    shutil.rmtree(tmp_path / "mem")
    with Store(tmp_path / "disk", memory=mem, remote=Remote(url, every=8)) as s:
        state = {"w": None}
        assert s.resume(state) == 8 and s.resumed_from["tier"] == "local"
        assert s.save({"w": torch.zeros(3)}, 9) is None and s.save({"w": torch.zeros(3)}, 10) is not None
