"""Bodies damaged in transfer vs objects damaged at rest (issue 26, item 7), against the loopback S3 server the
tests start, through tests/faultproxy.py with botocore's own response checksums off
(``response_checksum_validation="when_required"``, what non-AWS S3 gateways and older SDK settings give): a
hash mismatch or a short body is a transfer error first and is read again within the retry policy's deadline;
only the same bad bytes twice in a row make an object damaged (resume falls back to an older step, as before);
a step that cannot be read intact within the deadline makes resume raise, never start fresh."""
import time

import pytest
import torch

from ckptstore import Packing, Remote, RetryPolicy, Store, TransferError, Writing

pytestmark = pytest.mark.remote

# GETs of the steps' own objects (commit markers, manifests, packs, blobs), never listings nor the latest pointer
STEP_OBJECTS = rb"^GET /[^ ?]*/(steps|packs|objects)/[^ ?]+ "
DATA_OBJECTS = rb"^GET /[^ ?]*/(packs|objects)/[^ ?]+ "          # the packs and blobs alone
PACKS = rb"^GET /[^ ?]*/packs/[^ ?]+ "
BLOBS = rb"^GET /[^ ?]*/objects/[^ ?]+ "                          # here: "w", the same blob in every step
POLICY = RetryPolicy(deadline=4, op_timeout=2, backoff=0.05, max_backoff=0.5)
WRITING = Writing(packing=Packing(threshold=64 << 10))          # "w" a blob of its own, the rest packed


def _state(step):
    shared = torch.arange(100_000, dtype=torch.float32)        # the same chunks in every step
    return {"w": shared, "small": [shared[:1000] + i for i in range(6)],
            "lr": torch.full((64,), float(step)), "step": step}      # "lr": each step's own packed chunk


def _target():
    return {"w": torch.zeros(100_000), "small": [], "lr": torch.zeros(64), "step": 0}


def _same(target, step):
    want = _state(step)
    return (target["step"] == step and torch.equal(target["w"], want["w"]) and torch.equal(target["lr"], want["lr"])
            and len(target["small"]) == 6 and all(torch.equal(a, b) for a, b in zip(target["small"], want["small"])))


def _three_steps(tmp_path, url, opts):
    with Store(tmp_path / "writer", remote=url, storage_options=opts, writing=WRITING) as s:
        for step in (1, 2, 3):
            s.save(_state(step), step)
        s.wait_for_uploads(timeout=60)


def _reader(tmp_path, url, opts, proxy, read_only=False):
    """A store on a wiped local root, reading the remote through ``proxy`` with no checksum check by botocore."""
    popts = dict(opts, endpoint_url=proxy.endpoint,
                 config_kwargs={"response_checksum_validation": "when_required"})
    return Store(tmp_path / "wiped", remote=Remote(url, upload=False, retry=POLICY), storage_options=popts,
                 writing=WRITING, read_only=read_only)


def _proxy(opts, seed=26):
    from faultproxy import FaultProxy
    return FaultProxy(int(opts["endpoint_url"].rsplit(":", 1)[1].split("/")[0]), seed=seed)


@pytest.mark.parametrize("match,read_only", [(STEP_OBJECTS, False), (BLOBS, False), (PACKS, False),
                                             (DATA_OBJECTS, True)],
                         ids=["markers-pull", "blob-pull", "packs-pull", "data-read-in-place"])
def test_a_few_damaged_transfers_still_resume_the_newest_step(tmp_path, s3_bucket_url, match, read_only):
    """The first 6 GETs of the steps' objects come back with a flipped byte or cut short (Content-Length
    rewritten): resume still restores the newest step, bit for bit (before: a fresh start, or an older step)."""
    url, opts = s3_bucket_url
    _three_steps(tmp_path, url, opts)
    with _proxy(opts) as proxy:
        proxy.damage(6, match, kind="mixed")
        with _reader(tmp_path, url, opts, proxy, read_only) as s:
            target = _target()
            got = s.resume(target)
            where = s.resumed_from
        assert proxy.counts["damaged"] == 6
    assert got == 3, where
    assert _same(target, 3)


@pytest.mark.parametrize("match", [STEP_OBJECTS, DATA_OBJECTS], ids=["markers", "data"])
def test_transfers_damaged_until_the_deadline_make_resume_raise_naming_the_step(tmp_path, s3_bucket_url, match):
    """Every GET of the steps' objects comes back damaged, differently each time (a network fault that outlasts
    the retry deadline): resume raises TransferError naming the newest step, within about the deadline, and
    loads nothing (before: every step taken for damaged, a fresh start)."""
    url, opts = s3_bucket_url
    _three_steps(tmp_path, url, opts)
    with _proxy(opts) as proxy:
        proxy.damage(None, match, kind="mixed")
        with _reader(tmp_path, url, opts, proxy) as s:
            target = _target()
            t0 = time.monotonic()
            with pytest.raises(TransferError) as raised:
                s.resume(target)
            took = time.monotonic() - t0
            assert s.steps() == []                     # nothing pulled, nothing committed here
            if match == STEP_OBJECTS:                  # the commit marker unreadable: resolve() says so too
                with pytest.raises(TransferError, match="COMMIT"):
                    s.resolve()
        assert proxy.counts["damaged"] >= 2
    assert raised.value.step == 3 and "step 3" in str(raised.value)
    assert target["step"] == 0 and not target["w"].any()
    # one object's re-reads end once the deadline is spent; the reads themselves answer at once here
    assert took < 2 * POLICY.deadline + 2 * POLICY.op_timeout + 10, took


def test_an_object_damaged_on_the_server_still_falls_back_to_the_older_step(tmp_path, s3_bucket_url, s3_server):
    """Step 3's own pack is overwritten in the bucket with one byte flipped: the same bad bytes come back on
    every read, so it is damage, and resume falls back to step 2, as before (no TransferError)."""
    from ckptstore.format.catalog import Catalog
    from ckptstore.format.layout import pack_path
    from ckptstore.storage import open_storage

    url, opts = s3_bucket_url
    _three_steps(tmp_path, url, opts)
    catalog = Catalog(open_storage(url, opts))
    packs = {s: catalog.read_manifest(catalog.read_commit(s), 0).pack_ids() for s in (1, 2, 3)}
    own = sorted(set(packs[3]) - packs[2] - packs[1])
    assert own, packs
    bucket, _, prefix = url[len("s3://"):].partition("/")
    key = "/".join(p for p in (prefix, pack_path(own[0])) if p)
    client = s3_server.client()
    body = bytearray(client.get_object(Bucket=bucket, Key=key)["Body"].read())
    body[len(body) // 2] ^= 0xFF
    client.put_object(Bucket=bucket, Key=key, Body=bytes(body))
    with _proxy(opts) as proxy:
        proxy.damage(0, STEP_OBJECTS)                  # pass everything, through the same proxy
        with _reader(tmp_path, url, opts, proxy) as s:
            target = _target()
            got = s.resume(target)
    assert got == 2
    assert _same(target, 2)


def test_a_transfer_error_on_one_rank_raises_on_every_rank_naming_the_step():
    """Ranks agree on each candidate step (a real c10d TCPStore on 127.0.0.1, one thread per rank): rank 1
    cannot read step 3 within the deadline (the UploadError RetryPolicy raises for a read still failing then,
    a TransferError), rank 0 loaded it. Every rank raises TransferError naming step 3; none falls back to step 2
    (before: every rank took step 2)."""
    import threading
    from datetime import timedelta

    import torch.distributed as dist

    from ckptstore.distributed.collective import StoreCoordinator
    from ckptstore.util.errors import UploadError
    from ckptstore.distributed.resume import first_valid_step

    server = dist.TCPStore("127.0.0.1", 0, 2, True, timeout=timedelta(seconds=30), wait_for_workers=False)
    outcome, tried = {}, {0: [], 1: []}

    def rank(r):
        kv = server if r == 0 else dist.TCPStore("127.0.0.1", server.port, 2, False, timeout=timedelta(seconds=30))
        coord = StoreCoordinator(r, 2, kv_store=kv, instance=0)

        def attempt(step, tier):
            tried[r].append(step)
            if r == 1 and step == 3:
                raise UploadError("read_bytes steps/000000000003/manifest-rank00001.msgpack of s3://b: gave up "
                                  "after 9 attempt(s) in 4.0 s (deadline 4 s): ConnectionResetError")
            return tier
        try:
            outcome[r] = first_valid_step(lambda: [(3, "remote"), (2, "remote")], attempt, coord=coord,
                                          tag="resume", timeout=30)
        except BaseException as e:
            outcome[r] = e
    threads = [threading.Thread(target=rank, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    for r in (0, 1):
        assert isinstance(outcome[r], TransferError), (r, outcome[r])
        assert outcome[r].step == 3 and "step 3" in str(outcome[r]), outcome[r]
        assert tried[r] == [3]
