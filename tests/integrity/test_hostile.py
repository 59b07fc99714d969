"""Hostile input (issue 7): a bad step is only ever that step's problem.

One test or more per finding, through the public API and the CLI: quarantine only for bytes that fail their
own hash (never from a manifest's claim, never in a read-only command); untrusted metadata validated before
anything is allocated or applied, with fallback to the older valid step; bounded decompression and
verification; CLI output that is text, one line per error, no traceback without --debug; errors after a
commit do not fail the save; no credential in any message, repr or log line.
"""
import errno
import json
import logging
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch

from ckptstore import (IncompatibleCheckpointError, CheckpointError, CorruptCheckpointError, Packing, Store,
                       UploadError, Remote, Retention, Writing)
from ckptstore.util.retry import RetryPolicy
from helpers import (TESTS, blobs_of_key, chunks_of_key, cli, flip_byte, rewrite_frame, rewrite_manifest, step_dir,
                     two_at_a_time)

BLOBS = Packing(threshold=0)
SHARED = torch.arange(4096, dtype=torch.float32)


def state_at(step, model=None):
    return {"shared": SHARED, "own": torch.full((100,), float(step)), "progress": {"step": step, "hist": [1, (2, 3)]},
            "np": np.arange(10, dtype="<i4")}


@pytest.fixture
def two_steps(tmp_path):
    """Steps 10 and 20 sharing the blob of "shared"; step 20 is the one damaged by each test."""
    root = tmp_path / "store"
    with Store(root, writing=Writing(packing=BLOBS)) as s:
        s.save(state_at(10), 10)
        s.save(state_at(20), 20)
    return root


def fresh():
    return {"shared": None, "own": None, "progress": None, "np": None}


def quarantined(root):
    q = Path(root) / "quarantine"
    return sorted(p.name for p in q.iterdir()) if q.exists() else []


def assert_step10_intact(root):
    with Store(root) as s:
        got = s.load(10)
        assert torch.equal(got["shared"], SHARED) and got["progress"] == {"step": 10, "hist": [1, (2, 3)]}
        assert s.verify(10) == {10: None}


def node(body, path):
    return next(n for n in body["nodes"] if n[0] == path)


# -- 1. quarantine only for bytes failing their own hash --------------------------------------------------------
@pytest.mark.parametrize("lie", ["longer", "shorter", "codec"])
def test_wrong_claim_about_a_shared_blob_fails_only_that_step(two_steps, lie, caplog):
    def mutate(body):
        n = node(body, ["shared"])
        c = n[2]["chunks"][0]
        if lie == "codec":
            c[2] = "zstd"
        else:
            c[1] += 4 if lie == "longer" else -4
            n[2]["shape"] = [c[1] // 4]
    rewrite_manifest(two_steps, 20, mutate)
    with Store(two_steps) as s:
        if lie == "codec":         # a blob's file name records its codec: the claim is not needed to read it
            assert torch.equal(s.load(20)["shared"], SHARED)
            assert quarantined(two_steps) == []
            return
        with pytest.raises(CorruptCheckpointError) as ei:
            s.load(20)
        assert ei.value.step == 20 and ei.value.key == "shared"
        assert torch.equal(s.load()["own"], torch.full((100,), 10.0))        # falls back to step 10
        res = s.verify()
        assert res[10] is None and res[20] is not None
        with caplog.at_level(logging.WARNING, logger="ckptstore"):
            state = fresh()
            assert s.resume(state) == 10
        assert state["progress"]["step"] == 10
    assert quarantined(two_steps) == []
    assert_step10_intact(two_steps)


def test_bytes_that_fail_their_hash_are_quarantined_by_load_but_not_by_verify(two_steps):
    with Store(two_steps, writing=Writing(packing=BLOBS)) as s:
        bad = blobs_of_key(s, 20, ("own",))[0]
    flip_byte(bad, 3)
    with Store(two_steps) as s:
        assert s.verify(20)[20] is not None
    p = cli("verify", str(two_steps), check=False)
    assert p.returncode == 1 and "step 20: DAMAGED" in p.stdout
    assert bad.exists() and quarantined(two_steps) == []                   # read-only: nothing moved
    with Store(two_steps) as s, pytest.raises(CorruptCheckpointError, match="quarantine"):
        s.load(20)
    assert not bad.exists() and quarantined(two_steps) == [bad.name]


# -- 2. hostile but well-formed manifests -----------------------------------------------------------------------
def _orphan(body):
    body["nodes"] = [n for n in body["nodes"] if n[0] != ["progress", "hist"]]


def _index_out_of_range(body):
    node(body, ["progress", "hist", 1])[0][-1] = 5


def _empty_path(body):
    node(body, ["progress", "step"])[0] = []


def _wrapping_shape(body):
    p = node(body, ["own"])[2]
    p["shape"] = [2 ** 32, 2 ** 32, 0]          # 0 bytes, but 2**64 elements before the zero: wraps in int64


def _unknown_np_dtype(body):
    node(body, ["np"])[2]["dtype"] = "<b4"


def _unhashable_dtype(body):
    body["nodes"].append([["progress", "dt"], "dtype", ["float32"]])


def _non_str_top_key(body):
    for n in body["nodes"]:
        if n[0][:1] == ["progress"]:
            n[0][0] = 7


def _huge_list(body):
    body["nodes"].append([["progress", "big"], "list", 2 ** 32])
    body["nodes"].append([["progress", "big", 0], "value", 1])


def _missing_parent(body):
    body["nodes"].append([["nope", "x"], "value", 1])


def _child_of_value(body):
    body["nodes"].append([["progress", "step", "x"], "value", 1])


@pytest.mark.parametrize("mutate", [_orphan, _index_out_of_range, _empty_path, _wrapping_shape, _unknown_np_dtype,
                                    _unhashable_dtype, _non_str_top_key, _huge_list, _missing_parent,
                                    _child_of_value], ids=lambda f: f.__name__.strip("_"))
def test_hostile_manifest_is_a_corrupt_step_and_resume_falls_back(two_steps, mutate):
    rewrite_manifest(two_steps, 20, mutate)
    with Store(two_steps) as s:
        with pytest.raises(CorruptCheckpointError) as ei:
            s.load(20)
        assert ei.value.step == 20 and "manifest-rank00000" in str(ei.value)
        assert s.load()["progress"]["step"] == 10
        assert s.verify()[20] is not None
        state = fresh()
        assert s.resume(state) == 10 and state["progress"]["step"] == 10
        assert s.steps() == [10]                  # the run goes on from 10: step 20 was set aside (issue 26)
    assert_step10_intact(two_steps)


def test_oversized_commit_marker_and_manifest_are_refused_without_reading_them_whole(two_steps):
    """A commit marker past MAX_COMMIT_BYTES, or a manifest longer than its marker records, is a corrupt step
    (read with a bound: one byte past the limit is all it takes), and resume falls back."""
    from ckptstore.format.manifest import MAX_COMMIT_BYTES
    commit = step_dir(two_steps, 20) / "COMMIT"
    good = commit.read_bytes()
    commit.write_bytes(good + b"\0" * (MAX_COMMIT_BYTES + 1 - len(good)))
    with Store(two_steps, read_only=True) as s:                   # (a writer's resume would set step 20 aside)
        with pytest.raises(CorruptCheckpointError, match="larger than") as ei:
            s.load(20)
        assert ei.value.step == 20
        state = fresh()
        assert s.resume(state) == 10 and state["progress"]["step"] == 10
    commit.write_bytes(good)
    manifest = step_dir(two_steps, 20) / "manifest-rank00000.msgpack"
    with open(manifest, "ab") as f:
        f.write(b"\0")
    with Store(two_steps) as s:
        with pytest.raises(CorruptCheckpointError, match="does not match its commit marker"):
            s.load(20)
        assert s.load()["progress"]["step"] == 10
    assert_step10_intact(two_steps)


def test_failed_restore_applies_nothing_to_plain_entries(tmp_path):
    lin = torch.nn.Linear(3, 4)
    with Store(tmp_path) as s:
        s.save({"model": lin, "progress": {"step": 1}}, 1)

    def transpose(body):                                           # consistent bytes, wrong shape for the model
        node(body, ["model", "weight"])[2]["shape"] = [3, 4]
    rewrite_manifest(tmp_path, 1, transpose)
    state = {"model": torch.nn.Linear(3, 4), "progress": {"step": "untouched"}}
    with Store(tmp_path) as s, pytest.raises(IncompatibleCheckpointError, match=r"model/weight.*shape \[3, 4\]"):
        s.resume(state)
    assert state["progress"] == {"step": "untouched"}


def test_fifo_at_a_blob_path_does_not_hang(two_steps):
    with Store(two_steps, writing=Writing(packing=BLOBS)) as s:
        bad = blobs_of_key(s, 20, ("own",))[0]
    bad.unlink()
    os.mkfifo(bad)
    with Store(two_steps, read_only=True) as s:                   # (a writer's resume would set step 20 aside)
        with pytest.raises(CorruptCheckpointError, match="blob missing|regular"):
            s.load(20)
        assert s.resume(fresh()) == 10
        assert s.verify()[10] is None
    (two_steps / "latest").unlink()
    os.mkfifo(two_steps / "latest")                               # the pointer too: it is only a hint
    with Store(two_steps) as s:
        assert s.latest_step() == 20 and s.resume(fresh()) == 10


# -- 3. bounded decompression and verification ---------------------------------------------------------------
def test_zstd_header_claiming_64_gib_is_refused_before_allocating(tmp_path):
    with Store(tmp_path, writing=Writing(codec="zstd", packing=BLOBS)) as s:
        s.save({"z": torch.zeros(1 << 16)}, 1)
        s.save({"z": torch.ones(1 << 16)}, 2)
        blob = chunks_of_key(s, 2, ("z",))[0][3]
    path = tmp_path / "objects" / blob.blob_id[:2] / f"{blob.blob_id}.zst"
    assert path.exists()
    lie = (b"\x28\xb5\x2f\xfd" + bytes([0xC0, 0x58]) + (64 << 30).to_bytes(8, "little") + bytes([0b1011, 0, 0])
           + b"\x00")                                              # 18 bytes, header says 64 GiB

    def claim(body):                                               # the manifest agrees with the header
        n = node(body, ["z"])
        n[2]["chunks"][0][1] = 64 << 30
        n[2]["shape"] = [16 << 30]
    path.write_bytes(lie)
    rewrite_manifest(tmp_path, 2, claim)
    with Store(tmp_path) as s:
        with pytest.raises(CorruptCheckpointError, match="cannot hold"):
            s.load(2)
        assert s.verify()[2] is not None
        assert s.resume({"z": None}) == 1


BOUNDED = textwrap.dedent(r"""
    import resource, sys, json
    resource.setrlimit(resource.RLIMIT_AS, (3 << 30, 3 << 30))
    import blake3, torch, zstandard
    from ckptstore import CheckpointError, Packing, Store, Writing
    from ckptstore.format.manifest import frame
    sys.path.insert(0, sys.argv[2])
    from helpers import chunks_of_key, rewrite_manifest
    root, n = sys.argv[1], 4 << 30
    with Store(root, writing=Writing(codec="zstd", packing=Packing(threshold=0))) as s:
        s.save({"z": torch.zeros(1 << 16)}, 1)
        s.save({"z": torch.ones(1 << 16)}, 2)
        s.save({"z": torch.full((1 << 16,), 2.0)}, 3)
        b2 = chunks_of_key(s, 2, ("z",))[0][3].blob_id
        b3 = chunks_of_key(s, 3, ("z",))[0][3].blob_id
    # step 2: a real bomb under the name of its (small) chunk: 4 GiB of zeros, header declaring it
    # step 3: a legitimately huge chunk (4 GiB of zeros, its real id) that verify must stream
    h, piece = blake3.blake3(), bytes(16 << 20)
    path = f"{root}/objects/{b2[:2]}/{b2}.zst"
    with open(path, "wb") as f, zstandard.ZstdCompressor(level=1).stream_writer(f, size=n) as w:
        for _ in range(n // len(piece)):
            w.write(piece); h.update(piece)
    big = h.hexdigest()
    import os, shutil
    os.makedirs(f"{root}/objects/{big[:2]}", exist_ok=True)
    shutil.copyfile(path, f"{root}/objects/{big[:2]}/{big}.zst")
    def huge(body):
        for node in body["nodes"]:
            if node[0] == ["z"]:
                node[2]["chunks"] = [[big, n, "zstd"]]; node[2]["shape"] = [n // 4]
    rewrite_manifest(root, 3, huge)
    out = {}
    with Store(root) as s:
        for step in (2, 3):
            try:
                s.load(step); out[f"load{step}"] = "ok"
            except CheckpointError as e:
                out[f"load{step}"] = type(e).__name__
        out["verify"] = {k: v is None for k, v in s.verify().items()}
        out["resume"] = s.resume({"z": None})
    out["maxrss_mib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024
    print(json.dumps(out))
""")


def test_zstd_bomb_and_huge_chunk_stay_within_bounded_memory(tmp_path):
    """Under a 3 GiB address-space limit: a 4 GiB bomb is refused (not decompressed whole), verify streams a
    legitimately 4 GiB chunk (and finds it intact), load of that step fails cleanly, resume falls back."""
    p = subprocess.run([sys.executable, "-c", BOUNDED, str(tmp_path / "s"), str(TESTS)],
                       capture_output=True, text=True, timeout=280,
                       env=dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path)))
    assert p.returncode == 0, p.stderr[-3000:]
    out = json.loads(p.stdout.strip().splitlines()[-1])
    assert out["load2"] == "CorruptCheckpointError" and out["load3"] == "CorruptCheckpointError"
    assert out["verify"] == {"1": True, "2": False, "3": True}
    assert out["resume"] == 1
    assert out["maxrss_mib"] < 2048, out


# -- 4. CLI robustness on legitimate data ----------------------------------------------------------------------
def test_cli_prints_user_data_as_text(tmp_path):
    root = tmp_path / "run[/x]"
    with Store(root) as s:
        s.save({"a[/x]": {"[red]k[/red]": torch.ones(2), "v": "[bold]x[/]"}}, 1, metrics={"[/x]": "[/y]"})
    show, ls = two_at_a_time(lambda: cli("show", str(root), "1"), lambda: cli("ls", str(root)))
    out = show.stdout
    assert "a[/x]/[red]k[/red]" in out and "[bold]x[/]" in out and "[/x]" in out
    out = ls.stdout
    assert "run[/x]" in out and "[/x]=[/y]" in out


def test_cli_out_of_range_metadata_and_garbled_pointer(tmp_path):
    with Store(tmp_path) as s:
        s.save({"x": 1}, 1)
        s.save({"x": 2}, 2)

    def far_future(body):
        body["created"] = 1e300
    rewrite_frame(step_dir(tmp_path, 2) / "COMMIT", far_future)
    (tmp_path / "latest").write_text("[" * 100000)
    p = cli("ls", str(tmp_path), check=False)
    assert p.returncode == 0 and "damaged" in p.stdout and "Traceback" not in p.stdout + p.stderr
    with Store(tmp_path) as s:
        r = s.save({"x": 3}, 3)                                  # the garbled pointer is only a hint
        assert r.committed and s.latest_step() == 3


def test_cli_bytes_metric_keys(tmp_path):
    with Store(tmp_path) as s:
        s.save({"x": 1}, 1)

    def bytes_keys(body):
        body["metrics"] = {b"loss": 1.0}
    rewrite_frame(step_dir(tmp_path, 1) / "COMMIT", bytes_keys)
    for args in (("ls", str(tmp_path)), ("ls", str(tmp_path), "--json"), ("show", str(tmp_path), "1")):
        p = cli(*args, check=False)
        assert "Traceback" not in p.stdout + p.stderr and p.returncode in (0, 2), (args, p.stderr)


UNREACHABLE = {"endpoint_url": "http://127.0.0.1:9", "key": "AKIAFUZZKEY", "secret": "sEcReT/optionvalue",
               "config_kwargs": {"retries": {"max_attempts": 1}, "connect_timeout": 1}}


def test_cli_unreachable_endpoint_is_one_line_without_secrets(tmp_path):
    opts = json.dumps(UNREACHABLE)
    p, p2 = two_at_a_time(   # independent commands, two at a time (each is mostly its start-up)
        lambda: cli("ls", "s3://URLKEY:urlSECRETvalue@bucket/run", "--storage-options", opts, check=False),
        lambda: cli("--debug", "verify", "s3://URLKEY:urlSECRETvalue@bucket/run", "--storage-options", opts,
                    check=False))
    assert p.returncode == 2 and "Traceback" not in p.stderr, p.stderr
    assert len(p.stderr.strip().splitlines()) == 1 and p.stderr.startswith("Error:")
    assert p2.returncode == 2 and "Traceback" in p2.stderr
    for out in (p.stdout + p.stderr, p2.stdout + p2.stderr):
        for secret in ("urlSECRETvalue", "sEcReT/optionvalue", "AKIAFUZZKEY"):
            assert secret not in out


def test_cli_usage_error_exit_status(tmp_path):
    bare, missing = two_at_a_time(lambda: cli("ls", check=False),
                                  lambda: cli("ls", str(tmp_path / "missing"), check=False))
    assert bare.returncode == 2
    assert missing.returncode == 2


# -- 5. an error after the commit marker is not a failed save ----------------------------------------------------
def test_pointer_failure_after_commit_does_not_fail_the_save(tmp_path, monkeypatch, caplog):
    with Store(tmp_path) as s:
        s.save({"x": 1}, 1)
        real = s.storage.write_atomic

        def full_disk(path, data):
            if path == "latest":
                raise OSError(errno.ENOSPC, "No space left on device")
            return real(path, data)
        monkeypatch.setattr(s.storage, "write_atomic", full_disk)
        with caplog.at_level(logging.WARNING, logger="ckptstore"):
            r = s.save({"x": 2}, 2)
        assert r.committed and s.steps() == [1, 2] and s.load(2) == {"x": 2}
        assert "latest pointer" in caplog.text


def test_commit_marker_written_then_enospc_reports_committed(tmp_path, monkeypatch):
    with Store(tmp_path) as s:
        real = s.catalog.write_commit_bytes

        def landed_then_failed(step, data):
            real(step, data)
            raise OSError(errno.ENOSPC, "No space left on device")
        monkeypatch.setattr(s.catalog, "write_commit_bytes", landed_then_failed)
        assert s.save({"x": 1}, 1).committed and s.steps() == [1]

        def failed(step, data):
            raise OSError(errno.ENOSPC, "No space left on device")
        monkeypatch.setattr(s.catalog, "write_commit_bytes", failed)
        with pytest.raises(OSError):
            s.save({"x": 2}, 2)                                   # really not committed: raised
        assert s.steps() == [1]


def test_retention_failure_after_commit_is_logged(tmp_path, monkeypatch, caplog):
    with Store(tmp_path, keep=Retention(last=1)) as s:
        def boom(step, since, exclude):
            raise OSError(errno.EIO, "I/O error")
        monkeypatch.setattr(s._saver, "retain", boom)              # the hand-off to retention after a commit
        with caplog.at_level(logging.ERROR, logger="ckptstore"):
            assert s.save({"x": 1}, 1).committed
        assert "retention" in caplog.text


# -- 6. no credential in any message, repr or log line ----------------------------------------------------------
def test_credentials_never_appear(tmp_path, caplog):
    url = "s3://URLKEY:urlSECRET/with+slash@bucket/prefix"
    opts = dict(UNREACHABLE)
    with caplog.at_level(logging.INFO, logger="ckptstore"):
        retry = RetryPolicy(deadline=2.0, op_timeout=2.0, backoff=0.05, max_backoff=0.1)
        s = Store(tmp_path / "run", remote=Remote(url, retry=retry), storage_options=opts)
        texts = [repr(s), s.remote_storage.url, repr(s.remote_storage)]
        s.save({"x": torch.ones(10)}, 1)
        with pytest.raises(UploadError) as ei:
            s.wait_for_uploads(timeout=60)
        texts += [str(ei.value), repr(ei.value)]
        try:
            s.close()
        except CheckpointError as e:
            texts.append(str(e))
    texts.append(caplog.text)
    blob = "\n".join(texts)
    assert "bucket/prefix" in blob
    for secret in ("urlSECRET/with+slash", "urlSECRET", "sEcReT/optionvalue", "URLKEY", "AKIAFUZZKEY"):
        assert secret not in blob, secret
