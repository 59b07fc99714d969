"""Remote stores against real servers on 127.0.0.1 (moto S3, fake-gcs-server) and memory://."""
import json
import logging
import os
import random
import shutil
import subprocess
import sys
import textwrap
import threading
import time

import fsspec
import pytest
import torch

from backends.pytest_plugin import require_restart
from ckptstore import CorruptCheckpointError, Store, UploadError, Remote, Writing
from ckptstore.format.layout import LATEST
from ckptstore.format.pointers import advance_latest, decode_pointer
from ckptstore.util.retry import RetryPolicy
from ckptstore.storage import open_storage
from helpers import chunks_of_key, data_files


def state_at(step, n=50_000, frozen=None):
    g = torch.Generator().manual_seed(step)
    s = {"w": torch.randn(n, generator=g), "progress": {"step": step}}
    if frozen is not None:
        s["frozen"] = frozen
    return s


def save_and_upload(store, *steps):
    """Save ``state_at(step)`` for each of ``steps``, then wait until the remote holds them all."""
    for step in steps:
        store.save(state_at(step), step)
    store.wait_for_uploads()


def remote_store(target, **kw):
    """A read-only view of the remote store itself (what another node would see)."""
    return Store(target.url, storage_options=target.storage_options, create=False, **kw)


def test_upload_then_resume_from_remote_after_local_loss(tmp_path, remote_url):
    local = tmp_path / "run"
    frozen = torch.randn(100_000)
    with Store(local, remote=remote_url.url, storage_options=remote_url.storage_options) as s:
        for step in (1, 2, 3):
            s.save(state_at(step, frozen=frozen), step, metrics={"loss": 1.0 / step})
        s.wait_for_uploads()
        stats = {u.step: u for u in s._parts.uploader.uploaded}
    assert sorted(stats) == [1, 2, 3]
    assert stats[2].bytes_copied == 50_000 * 4          # the frozen tensor went up once, with step 1
    with remote_store(remote_url) as r:
        assert r.steps() == [1, 2, 3] and r.verify() == {1: None, 2: None, 3: None}
        assert decode_pointer(r.storage.read_bytes(LATEST)) == 3
        assert r.commit_info(3).metrics == {"loss": 1.0 / 3}
    shutil.rmtree(local)                                  # the node was wiped
    state = {"w": None, "progress": None, "frozen": None}
    with Store(local, remote=remote_url.url, storage_options=remote_url.storage_options) as s:
        assert s.resume(state) == 3
        assert s.resumed_from["tier"] == "remote"
        assert s.steps() == [3]                           # pulled into the local root
    assert torch.equal(state["w"], state_at(3)["w"]) and torch.equal(state["frozen"], frozen)


def test_remote_blob_with_flipped_byte_is_detected_and_resume_falls_back(tmp_path, remote_url):
    local = tmp_path / "run"
    with Store(local, remote=remote_url.url, storage_options=remote_url.storage_options) as s:
        save_and_upload(s, 1, 2)
        _, offset, _, ref = chunks_of_key(s, 2, ("w",))[0]
    blob_id = ref.pack or ref.blob_id                    # the object a pull verifies as a whole
    fs, root = fsspec.core.url_to_fs(remote_url.url, **remote_url.storage_options)
    path = (f"{root}/packs/{blob_id[:2]}/{blob_id}.pack" if ref.pack else f"{root}/objects/{blob_id[:2]}/{blob_id}")
    data = bytearray(fs.cat_file(path))
    data[offset + 17] ^= 0x40
    fs.pipe_file(path, bytes(data))
    fs.invalidate_cache()
    shutil.rmtree(local)
    with Store(local, remote=Remote(remote_url.url, upload=False), storage_options=remote_url.storage_options) as s:
        with pytest.raises(CorruptCheckpointError, match=blob_id):
            s.pull(2)
        assert s.steps() == []                            # nothing half-pulled is visible
        state = {"w": None, "progress": None}
        assert s.resume(state) == 1
    assert state["progress"] == {"step": 1}


def test_damaged_local_step_is_repaired_from_remote(tmp_path, remote_url):
    local = tmp_path / "run"
    with Store(local, remote=remote_url.url, storage_options=remote_url.storage_options) as s:
        save_and_upload(s, 1)
    for blob in data_files(local):
        blob.write_bytes(b"garbage")
    with Store(local, remote=remote_url.url, storage_options=remote_url.storage_options) as s:
        state = {"w": None, "progress": None}
        assert s.resume(state) == 1 and s.resumed_from["tier"] == "remote"
    assert torch.equal(state["w"], state_at(1)["w"])


@pytest.mark.parametrize("kind", ["local", "s3", "gcs"])
def test_remote_latest_pointer_never_moves_backwards(tmp_path, request, kind):
    if kind == "local":
        storage = open_storage(tmp_path)
    else:
        target = request.getfixturevalue(f"{kind}_bucket_url")
        storage = open_storage(target.url, target.storage_options)
    assert storage.conditional_writes
    steps = list(range(1, 41))
    random.Random(0).shuffle(steps)
    seen, stop = [], threading.Event()

    def watch():
        while not stop.is_set():
            try:
                seen.append(decode_pointer(storage.read_bytes(LATEST)))
            except FileNotFoundError:
                pass

    errors = []

    def writer(mine):
        try:
            for s in mine:
                advance_latest(storage, s)
        except BaseException as e:
            errors.append(e)

    w = threading.Thread(target=watch)
    w.start()
    writers = [threading.Thread(target=writer, args=(steps[i::2],)) for i in range(2)]
    for t in writers:
        t.start()
    for t in writers:
        t.join()
    stop.set()
    w.join()
    assert not errors, errors
    assert decode_pointer(storage.read_bytes(LATEST)) == 40
    assert seen == sorted(seen), "the pointer moved backwards"


@pytest.mark.parametrize("kind", ["local", "s3", "gcs"])
def test_conditional_write_refuses_a_stale_version(tmp_path, request, kind):
    """The compare-and-swap under the pointer: a write conditioned on an outdated version is refused, and of
    many writers holding the same version exactly one wins."""
    if kind == "local":
        storage = open_storage(tmp_path)
    else:
        target = request.getfixturevalue(f"{kind}_bucket_url")
        storage = open_storage(target.url, target.storage_options)
    assert storage.write_if_match("p", b"1", None)
    assert not storage.write_if_match("p", b"again", None)          # create-only
    _, v1 = storage.read_versioned("p")
    assert storage.write_if_match("p", b"2", v1)
    assert not storage.write_if_match("p", b"stale", v1)
    assert storage.read_bytes("p") == b"2"
    _, v2 = storage.read_versioned("p")
    wins = []

    def write(i):
        if storage.write_if_match("p", f"w{i}".encode(), v2):
            wins.append(i)
    threads = [threading.Thread(target=write, args=(i,)) for i in range(8)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert len(wins) == 1 and storage.read_bytes("p") == f"w{wins[0]}".encode()


@pytest.mark.parametrize("kind", ["local", "s3", "gcs"])
def test_bounded_read_returns_at_most_the_limit(tmp_path, request, kind):
    """``read_bytes(path, limit)``: the first ``limit`` bytes (one ranged GET on object stores), the whole file
    when shorter, ``b""`` for an empty object (which S3 and GCS answer 416 for any range)."""
    if kind == "local":
        storage = open_storage(tmp_path)
    else:
        target = request.getfixturevalue(f"{kind}_bucket_url")
        storage = open_storage(target.url, target.storage_options)
    storage.write_atomic("empty", b"")
    storage.write_atomic("small", b"0123456789")
    assert storage.read_bytes("empty", limit=5) == b""
    assert storage.read_bytes("small", limit=4) == b"0123"
    assert storage.read_bytes("small", limit=11) == b"0123456789"
    assert storage.read_bytes("small") == b"0123456789"
    with pytest.raises(FileNotFoundError):
        storage.read_bytes("missing", limit=4)


def test_leftover_uploads_start_after_resume_and_complete(tmp_path, s3_bucket_url):
    """Steps committed locally but never uploaded (the job died first) are uploaded by the next run, after its
    resume: the resume is the restart's critical path and gets the network and the interpreter to itself."""
    local, target = tmp_path / "run", s3_bucket_url
    with Store(local, remote=Remote(target.url, upload=False), storage_options=target.storage_options) as s:
        s.save(state_at(1), 1)
        s.save(state_at(2), 2)
    with Store(local, remote=target.url, storage_options=target.storage_options) as s:
        time.sleep(1.0)                                    # an uploader started at open would be busy by now
        with remote_store(target) as r:
            assert r.steps() == []
        state = {"w": None, "progress": None}
        assert s.resume(state) == 2 and s.resumed_from["tier"] == "local"
        s.wait_for_uploads()
    with remote_store(target) as r:
        assert r.steps() == [1, 2] and r.verify() == {1: None, 2: None}
        assert decode_pointer(r.storage.read_bytes(LATEST)) == 2


def test_load_path_components_then_own_checkpoints_win(tmp_path, remote_url):
    pre = tmp_path / "pretrain"
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 8)
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 8)).sum().backward()
    opt.step()
    with Store(pre, remote=remote_url.url, storage_options=remote_url.storage_options) as s:
        s.save({"model": model, "optimizer": opt, "progress": {"step": 1000}}, 1000)
        s.wait_for_uploads()
    shutil.rmtree(pre)

    def fresh():
        m = torch.nn.Linear(8, 8)
        return {"model": m, "optimizer": torch.optim.AdamW(m.parameters()), "progress": {"step": 0}}

    run = tmp_path / "finetune"
    state = fresh()
    with Store(run, load_path=remote_url.url, load_components=("model",),
               storage_options=remote_url.storage_options) as s:
        assert s.resume(state) is None                    # the run itself starts at its own step 0
        assert s.resumed_from == {"tier": "load_path", "step": 1000, "url": s.resumed_from["url"],
                                  "components": ["model"]}
        assert torch.equal(state["model"].weight, model.weight)
        assert state["optimizer"].state_dict()["state"] == {}       # not taken from load_path
        assert state["progress"] == {"step": 0}
        with torch.no_grad():
            state["model"].weight.add_(1)
        s.save(state, 5)
    state = fresh()
    with Store(run, load_path=f"{remote_url.url}/steps/000000001000", load_components=("model",),
               storage_options=remote_url.storage_options) as s:
        assert s.resume(state) == 5 and s.resumed_from["tier"] == "local"
    assert torch.equal(state["model"].weight, model.weight + 1)


def test_load_path_full_state_and_explicit_step(tmp_path, remote_url):
    src = tmp_path / "src"
    with Store(src, remote=remote_url.url, storage_options=remote_url.storage_options) as s:
        save_and_upload(s, 7, 9)
    state = {"w": None, "progress": None}
    with Store(tmp_path / "dst", load_path=f"{remote_url.url}/steps/7",
               storage_options=remote_url.storage_options) as s:
        assert s.resume(state) == 7
    assert state["progress"] == {"step": 7}


def test_upload_failure_is_raised_by_wait_save_and_close(tmp_path, s3_bucket_url, s3_server):
    require_restart(s3_server)
    fast = RetryPolicy(deadline=2.0, op_timeout=1.0, backoff=0.05, max_backoff=0.2)
    s = Store(tmp_path / "run", remote=Remote(s3_bucket_url.url, retry=fast),
              storage_options=s3_bucket_url.storage_options)
    s.save(state_at(1), 1)
    s.wait_for_uploads()
    s3_server.stop()
    try:
        t0 = time.monotonic()
        s.save(state_at(2), 2)
        with pytest.raises(UploadError, match="step 2"):
            s.wait_for_uploads()
        assert time.monotonic() - t0 < 30                 # failed loudly, by its deadline
        assert s.steps() == [1, 2]                        # nothing committed locally is lost
        assert torch.equal(s.load(2)["w"], state_at(2)["w"])
        s.save(state_at(3), 3)                            # reported once; uploads go on being tried
        with pytest.raises(UploadError):                  # ... and fail again by their deadline
            s.wait_for_uploads(timeout=60)
        raised, step = False, 4
        for step in range(4, 40):                         # an unreported failure stops the next save
            try:
                s.save(state_at(step), step)
            except UploadError:
                raised = True
                break
            time.sleep(0.5)
        assert raised and step not in s.steps()
        with pytest.raises(UploadError):                  # and close() raises it too
            s.close()
    finally:
        s3_server.start()


def test_s3_outage_mid_upload_retries_and_completes(tmp_path, s3_bucket_url, s3_server):
    """The server stops answering in the middle of a step's upload, then comes back: the upload completes."""
    require_restart(s3_server)
    retry = RetryPolicy(deadline=60, op_timeout=2, backoff=0.1, max_backoff=0.5)
    with Store(tmp_path / "run", remote=Remote(s3_bucket_url.url, workers=2, retry=retry),
               storage_options=s3_bucket_url.storage_options, writing=Writing(chunk_size=1 << 20)) as s:
        s.save(state_at(1, n=4_000_000), 1)               # 16 MB in 16 blobs
        time.sleep(0.3)                                   # some blobs are up, others in flight
        s3_server.pause()
        try:
            time.sleep(3.0)
        finally:
            s3_server.resume()
        s.wait_for_uploads(timeout=60)
        assert s.steps() == [1]
    with remote_store(s3_bucket_url) as r:
        assert r.steps() == [1] and r.verify() == {1: None}


def test_s3_server_down_then_restarted(tmp_path, s3_bucket_url, s3_server):
    """The server process is gone when the upload starts and is restarted later.

    (moto keeps its objects in memory, so a restart empties it: the bucket is created again. A real S3 does
    not forget acknowledged writes; ckptstore re-checks a step's blobs only after a failure it sees.)"""
    require_restart(s3_server)
    bucket = s3_bucket_url.url[len("s3://"):].split("/")[0]
    retry = RetryPolicy(deadline=60, op_timeout=2, backoff=0.1, max_backoff=0.5)
    with Store(tmp_path / "run", remote=Remote(s3_bucket_url.url, retry=retry),
               storage_options=s3_bucket_url.storage_options) as s:
        s3_server.stop()
        try:
            s.save(state_at(1, n=1_000_000), 1)
            time.sleep(2.0)
        finally:
            s3_server.start()
            s3_server.create_bucket(bucket, exist_ok=True)
        s.wait_for_uploads(timeout=60)
        assert torch.equal(s.load(1)["w"], state_at(1, n=1_000_000)["w"])
    with remote_store(s3_bucket_url) as r:
        assert r.steps() == [1] and r.verify() == {1: None}


def test_stalled_server_fails_by_deadline_then_recovers(tmp_path, s3_bucket_url, s3_server):
    require_restart(s3_server)
    retry = RetryPolicy(deadline=3, op_timeout=1, backoff=0.05, max_backoff=0.2)
    s = Store(tmp_path / "run", remote=Remote(s3_bucket_url.url, retry=retry),
              storage_options=s3_bucket_url.storage_options)
    try:
        s.save(state_at(1), 1)
        s.wait_for_uploads()
        s3_server.pause()                                 # accepts connections, answers nothing
        t0 = time.monotonic()
        s.save(state_at(2), 2)
        with pytest.raises(UploadError, match="stalled|deadline"):
            s.wait_for_uploads(timeout=60)
        assert time.monotonic() - t0 < 20
    finally:
        s3_server.resume()
    s.wait_for_uploads(timeout=60)                        # derived again: step 2 goes up now
    s.close()
    with remote_store(s3_bucket_url) as r:
        assert r.steps() == [1, 2] and r.verify() == {1: None, 2: None}


UPLOAD_WRITER = textwrap.dedent("""
    import sys, torch
    from ckptstore import Store, Writing
    local, url, opts, first = sys.argv[1], sys.argv[2], __import__("json").loads(sys.argv[3]), int(sys.argv[4])
    with Store(local, remote=url, storage_options=opts, writing=Writing(chunk_size=1 << 20)) as s:
        for step in range(first, first + 1000):
            g = torch.Generator().manual_seed(step)
            s.save({"w": torch.randn(1_000_000, generator=g), "step": step}, step)
            print("committed", step, flush=True)
""")


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["s3", "gcs"])
def test_sigkill_during_uploads_never_exposes_a_half_step(tmp_path, request, kind):
    target = request.getfixturevalue(f"{kind}_bucket_url")
    local = tmp_path / "run"
    rng = random.Random(1234)
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    first = 1
    for kill in range(6):
        p = subprocess.Popen([sys.executable, "-c", UPLOAD_WRITER, str(local), target.url,
                              json.dumps(target.storage_options), str(first)],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
        # wait for the first commit, then kill at a random moment of the uploads that follow
        line = p.stdout.readline()
        assert line.startswith("committed"), p.stderr.read()
        time.sleep(rng.uniform(0.0, 1.5))
        p.kill()
        p.wait()
        with Store(local, create=False) as s:
            first = (s.steps() or [0])[-1] + 1
        with remote_store(target) as r:
            for step, err in r.verify().items():
                assert err is None, f"kill {kill}: remote step {step} is damaged: {err}"
    # reopening the store finishes the uploads
    with Store(local, remote=target.url, storage_options=target.storage_options) as s:
        s.wait_for_uploads(timeout=120)
        newest = s.steps()[-1]
    with remote_store(target) as r:
        assert r.steps()[-1] == newest
        assert all(err is None for err in r.verify().values())


@pytest.mark.parametrize("kind", ["s3", "gcs"])
def test_training_resumes_from_remote_after_local_disk_is_lost(tmp_path, request, kind, reference):
    """A real training run uploads as it goes; it is SIGKILLed, its local root deleted (the node is gone),
    and the restarted run resumes from the remote with losses bit-identical to an uninterrupted run."""
    from training import _SAVED, N_REF, Child, check_against_reference, read_log
    target = request.getfixturevalue(f"{kind}_bucket_url")
    ref, _ = reference
    store, log = tmp_path / "store", tmp_path / "loss.jsonl"
    extra = ["--remote", target.url, "--storage-options", json.dumps(target.storage_options)]
    first = Child(store, log, N_REF, *extra)
    first.wait_line(_SAVED, nth=8)                        # step 40 committed locally
    time.sleep(1.0)                                       # its upload runs in the background
    first.kill()
    with remote_store(target) as r:
        uploaded = r.steps()
    assert uploaded, f"nothing reached the remote:\n{first.output()}"
    shutil.rmtree(store)
    second = Child(store, log, N_REF, *extra)
    second.finish()
    assert second.resumed_from() == uploaded[-1], second.output()
    check_against_reference(read_log(log), ref, N_REF)
    with remote_store(target) as r:                       # close() waited for the final uploads
        assert r.steps()[-1] == N_REF and r.verify(N_REF) == {N_REF: None}


def test_keep_local_removes_uploaded_steps_only(tmp_path, s3_bucket_url):
    local = tmp_path / "run"
    with Store(local, remote=Remote(s3_bucket_url.url, keep_local=1),
               storage_options=s3_bucket_url.storage_options) as s:
        for step in (1, 2, 3):
            s.save(state_at(step), step)
        s.wait_for_uploads()
        assert s.steps() == [3]                           # older local steps went once uploaded
        assert len(data_files(local)) == 1                # and their blobs / packs were collected
    with remote_store(s3_bucket_url) as r:
        assert r.steps() == [1, 2, 3]


def test_credentials_never_reach_files_logs_or_errors(tmp_path, s3_bucket_url, s3_server, caplog):
    require_restart(s3_server)
    opts = dict(s3_bucket_url.storage_options, secret="TOPSECRET-do-not-log-4242")
    url_with_key = s3_bucket_url.url
    with caplog.at_level(logging.DEBUG, logger="ckptstore"):
        retry = RetryPolicy(deadline=2, op_timeout=1, backoff=0.05, max_backoff=0.1)
        s = Store(tmp_path / "run", remote=Remote(url_with_key, retry=retry), storage_options=opts, config={"lr": 0.1})
        s.save(state_at(1), 1)
        s3_server.stop()
        try:
            s.save(state_at(2), 2)
            with pytest.raises(UploadError) as ei:
                s.wait_for_uploads(timeout=60)
        finally:
            s3_server.start()
        try:
            s.close()
        except UploadError:
            pass
    assert "TOPSECRET" not in str(ei.value) and "TOPSECRET" not in caplog.text
    for f in (tmp_path / "run").rglob("*"):
        if f.is_file():
            assert b"TOPSECRET" not in f.read_bytes(), f
