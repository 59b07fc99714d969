#!/usr/bin/env python
"""Upload benchmark: ckptstore's background upload vs s3fs ``put_file`` vs boto3's transfer manager, for the
same bytes, against ONE local moto S3 server (127.0.0.1), in one run.

    python benchmarks/bench_upload.py --size-mb 200 --repeat 1          # quick (~1 min)
    python benchmarks/bench_upload.py                                   # 1 GiB state, 2 repeats
    python benchmarks/bench_upload.py --size-mb 200 --workers 4,8,16 --json up.json

Rows (see benchmarks/README.md, "bench_upload.py"):
  * ckptstore upload w=N: ``Store(remote=s3://..., upload_workers=N).save(state, 1)`` into an empty bucket;
    timed from ``save()`` returning (the step is committed locally) to ``wait_for_uploads()`` returning.
  * s3fs put_file: ``s3fs.S3FileSystem.put_file`` of the same bytes as one local file (written once).
  * boto3 upload_file: ``client.upload_file`` with ``TransferConfig(max_concurrency=8, multipart_chunksize=64 MiB)``.
  * ckptstore dedup step 2: after step 1, half of the tensors change (bit-flipped in place); ``save(state, 2)``
    into the same store and bucket; bytes uploaded (``TransferStats.bytes_copied``) vs state bytes.

Every measurement gets a fresh bucket, which is emptied and deleted afterwards, and a fresh local folder,
which is deleted afterwards. Repeats run round-robin (all methods, then all again).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import resource
import statistics
import sys
import threading
import time
import traceback
from collections import defaultdict
from pathlib import Path
from typing import Any, Callable

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(REPO))  # ckptstore and backends from the checkout

MiB = 1 << 20


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size-mb", type=int, default=1024, help="state size in MiB (default 1024)")
    p.add_argument("--repeat", type=int, default=2, help="repeats per method (default 2; table: median)")
    p.add_argument("--workers", default="4,8", help="ckptstore upload_workers values, comma-separated")
    p.add_argument("--chunk-mb", type=int, default=64, help="ckptstore chunk_size in MiB (default 64)")
    p.add_argument("--boto-concurrency", type=int, default=8, help="boto3 TransferConfig max_concurrency")
    p.add_argument("--boto-chunk-mb", type=int, default=64, help="boto3 TransferConfig multipart_chunksize")
    p.add_argument("--dedup-workers", type=int, default=None,
                   help="upload_workers of the store that also measures step 2 (default: last --workers value)")
    p.add_argument("--no-dedup", action="store_true", help="skip the dedup (step 2) measurement")
    p.add_argument("--only", default="ckptstore,s3fs,boto3", help="subset of ckptstore,s3fs,boto3")
    p.add_argument("--dir", default=None, help="scratch parent on disk (default ../bench_tmp next to the repo)")
    p.add_argument("--nice", type=int, default=None,
                   help="CKPTSTORE_BACKGROUND_NICE for ckptstore's threads (default: the library's, 10); "
                        "the baselines' threads are never niced")
    p.add_argument("--no-breakdown", action="store_true",
                   help="do not wrap ckptstore's hashing / storage calls with timers")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None, metavar="PATH", help="write all samples and settings here")
    args = p.parse_args(argv)
    args.workers = [int(w) for w in str(args.workers).split(",") if w.strip()]
    args.only = [m.strip() for m in args.only.split(",") if m.strip()]
    bad = set(args.only) - {"ckptstore", "s3fs", "boto3"}
    if bad:
        p.error(f"--only: unknown {sorted(bad)}")
    if args.dedup_workers is None:
        args.dedup_workers = args.workers[-1] if args.workers else 8
    if args.size_mb < 8:
        p.error("--size-mb must be >= 8")
    return args


ARGS = parse_args() if __name__ == "__main__" else None
if ARGS is not None and ARGS.nice is not None:
    os.environ["CKPTSTORE_BACKGROUND_NICE"] = str(ARGS.nice)   # read when ckptstore.threads is imported

import torch  # noqa: E402

import common as C  # noqa: E402
from backends.launcher import S3Server, open_files  # noqa: E402
from ckptstore import Remote, Writing

# --------------------------------------------------------------------------- state


def build_state(size_bytes: int, seed: int) -> tuple[dict[str, Any], list[tuple[str, torch.Tensor]], int]:
    """A GPT-like fp32 model (4 blocks, untied embedding / head with vocab = 32 * d_model) plus AdamW's
    exp_avg and exp_avg_sq for every parameter, random values (no duplicate chunks, incompressible).
    d_model is the largest multiple of 8 that fits; a 1-D ``model.pad`` buffer tops it up to exactly
    ``size_bytes``. Returns (state, [(path, tensor)], d_model)."""
    n_layers = 4

    def shapes(d: int) -> list[tuple[str, tuple[int, ...]]]:
        v = 32 * d
        out = [("wte.weight", (v, d))]
        for i in range(n_layers):
            b = f"blocks.{i}."
            out += [(b + "ln1.weight", (d,)), (b + "ln1.bias", (d,)),
                    (b + "qkv.weight", (3 * d, d)), (b + "qkv.bias", (3 * d,)),
                    (b + "proj.weight", (d, d)), (b + "proj.bias", (d,)),
                    (b + "ln2.weight", (d,)), (b + "ln2.bias", (d,)),
                    (b + "fc.weight", (4 * d, d)), (b + "fc.bias", (4 * d,)),
                    (b + "fc2.weight", (d, 4 * d)), (b + "fc2.bias", (d,))]
        out += [("ln_f.weight", (d,)), ("ln_f.bias", (d,)), ("head.weight", (v, d))]
        return out

    def state_bytes(d: int) -> int:
        return 12 * sum(torch.Size(s).numel() for _, s in shapes(d))   # fp32 weight + 2 moments

    d = 8
    while state_bytes(d + 8) <= size_bytes:
        d += 8
    if state_bytes(d) > size_bytes:
        raise SystemExit(f"--size-mb {size_bytes // MiB} is too small for this state")
    g = torch.Generator().manual_seed(seed)
    model, exp_avg, exp_avg_sq = {}, {}, {}
    for name, shape in shapes(d):
        model[name] = torch.randn(shape, generator=g)
        exp_avg[name] = torch.randn(shape, generator=g).mul_(1e-3)
        exp_avg_sq[name] = torch.rand(shape, generator=g).mul_(1e-6)
    pad = size_bytes - state_bytes(d)
    if pad:
        model["pad"] = torch.randn(pad // 4, generator=g)
    state = {"model": model, "optimizer": {"exp_avg": exp_avg, "exp_avg_sq": exp_avg_sq}}
    flat = ([(f"model.{k}", t) for k, t in model.items()]
            + [(f"optimizer.exp_avg.{k}", t) for k, t in exp_avg.items()]
            + [(f"optimizer.exp_avg_sq.{k}", t) for k, t in exp_avg_sq.items()])
    assert sum(C.nbytes(t) for _, t in flat) == size_bytes
    return state, flat, d


def pick_changed(flat: list[tuple[str, torch.Tensor]]) -> list[tuple[str, torch.Tensor]]:
    """Half of the tensors, holding about half of the bytes: every other tensor in order of size (largest
    first). Weight, exp_avg and exp_avg_sq of a parameter have the same size, so the changed half mixes
    weights and moments of every layer."""
    by_size = sorted(flat, key=lambda kv: (-C.nbytes(kv[1]), kv[0]))
    return by_size[0::2]


def flip(tensors: list[torch.Tensor]) -> None:
    """XOR every 32-bit word with a constant, in place: changes every byte, bumps the version counter,
    and a second call restores the exact bytes."""
    for t in tensors:
        t.view(torch.int32).bitwise_xor_(0x55555555)


def write_state_file(flat: list[tuple[str, torch.Tensor]], path: Path) -> int:
    with open(path, "wb") as f:
        for _, t in flat:
            f.write(memoryview(t.contiguous().numpy()).cast("B"))
        f.flush()
        os.fsync(f.fileno())
    return path.stat().st_size


# --------------------------------------------------------------------------- accounting


CLK_TCK = os.sysconf("SC_CLK_TCK")


def proc_cpu(pids: list[int]) -> float:
    """user+system CPU seconds of ``pids`` (all their threads)."""
    total = 0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            total += int(fields[11]) + int(fields[12])      # utime, stime
        except OSError:
            pass
    return total / CLK_TCK


def self_cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def held_tmp_files(pids: list[int], tmpdir: Path) -> tuple[int, int]:
    """(count, bytes) of files under ``tmpdir`` that the server holds open (moto's spooled objects)."""
    n = size = 0
    for entry, target in open_files(pids):
        if target.startswith(str(tmpdir)):
            try:
                size += os.stat(entry).st_size
                n += 1
            except OSError:
                pass
    return n, size


class Probe:
    """Thread-safe call counters: name -> [calls, summed seconds]; S3 API calls by operation name."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.timers: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
        self.ops: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])     # S3 op -> [calls, seconds]

    def wrap(self, name: str, fn: Callable) -> Callable:
        def timed(*a, **kw):
            t0 = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                dt = time.perf_counter() - t0
                with self.lock:
                    rec = self.timers[name]
                    rec[0] += 1
                    rec[1] += dt
        return timed

    def count_op(self, op: str, seconds: float) -> None:
        with self.lock:
            rec = self.ops[op]
            rec[0] += 1
            rec[1] += seconds

    def snapshot(self) -> dict[str, Any]:
        with self.lock:
            return {"timers": {k: {"calls": int(v[0]), "seconds": round(v[1], 4)} for k, v in self.timers.items()},
                    "s3_ops": {k: {"calls": int(v[0]), "seconds": round(v[1], 4)} for k, v in sorted(self.ops.items())}}


_CURRENT_PROBE: list[Probe | None] = [None]


def _before_call(context=None, **kwargs) -> None:
    if context is not None:
        context["bench_upload_t0"] = time.perf_counter()


def _after_call(model=None, context=None, **kwargs) -> None:
    # botocore and aiobotocore pass the same request context to before-call and after-call (also when the
    # answer is an HTTP error such as a 404 HEAD), so this times each call even when many share one thread.
    probe = _CURRENT_PROBE[0]
    t0 = (context or {}).get("bench_upload_t0")
    if probe is not None and t0 is not None:
        name = model.name if model is not None else "?"
        probe.count_op(name, time.perf_counter() - t0)


def count_s3_ops(client) -> None:
    """Count and time the API calls of a boto3 / aiobotocore client into the current probe (once per client)."""
    ev = client.meta.events
    ev.register("before-call.s3", _before_call, unique_id="bench-upload-before")
    ev.register("after-call.s3", _after_call, unique_id="bench-upload-after")
    ev.register("after-call-error.s3", _after_call, unique_id="bench-upload-error")


# --------------------------------------------------------------------------- measurements


class Bench:
    def __init__(self, args: argparse.Namespace):
        self.args = args
        self.base = Path(args.dir).resolve() if args.dir else C.default_bench_dir()
        self.base.mkdir(parents=True, exist_ok=True)
        self.run_dir = C.fresh_dir(self.base, "bench-upload-")
        self.size = args.size_mb * MiB
        t0 = time.perf_counter()
        self.state, self.flat, self.d_model = build_state(self.size, args.seed)
        self.build_s = time.perf_counter() - t0
        self.changed = pick_changed(self.flat)
        self.changed_bytes = sum(C.nbytes(t) for _, t in self.changed)
        self.server: S3Server | None = None
        self.file: Path | None = None
        self.samples: dict[str, list[dict[str, Any]]] = defaultdict(list)
        self.tmp_seen = (0, 0)

    # -- server
    def start(self) -> None:
        self.server = S3Server(workdir=self.run_dir / "moto").start()
        self.tmpdir = self.server.workdir / "tmp"
        env_tmp = None
        try:
            with open(f"/proc/{self.server.pid}/environ", "rb") as f:
                env = dict(kv.split(b"=", 1) for kv in f.read().split(b"\0") if b"=" in kv)
            env_tmp = env.get(b"TMPDIR", b"").decode()
        except OSError:
            pass
        self.tmp_fs = C.fs_type(self.tmpdir)
        self.server_tmpdir = env_tmp
        if env_tmp != str(self.tmpdir):
            print(f"WARNING: moto's TMPDIR is {env_tmp!r}, expected {self.tmpdir}", file=sys.stderr)
        if self.tmp_fs in ("tmpfs", "ramfs"):
            print(f"WARNING: moto's TMPDIR {self.tmpdir} is on {self.tmp_fs}: objects are spooled to RAM; "
                  "pass --dir on a disk", file=sys.stderr)
        self.opts = self.server.storage_options()

    def stop(self) -> None:
        if self.server is not None:
            self.server.stop()
        C.rmtree(self.run_dir)

    def _new_bucket(self) -> str:
        return self.server.new_bucket_url("bench")

    def _cleanup(self, url: str) -> None:
        self.server.cleanup(url)

    def _note_tmp(self) -> tuple[int, int]:
        held = held_tmp_files(self.server.pids(), self.tmpdir)
        if held[1] > self.tmp_seen[1]:
            self.tmp_seen = held
        return held

    def _timed(self, fn: Callable[[], Any]) -> tuple[float, float, float, Any]:
        pids = self.server.pids()
        m0, c0, t0 = proc_cpu(pids), self_cpu(), time.perf_counter()
        out = fn()
        t1 = time.perf_counter()
        return t1 - t0, proc_cpu(pids) - m0, self_cpu() - c0, out

    def ensure_file(self) -> Path:
        if self.file is None:
            self.file = self.run_dir / "state.bin"
            n = write_state_file(self.flat, self.file)
            assert n == self.size, (n, self.size)
        C.evict(self.file)      # cold, like ckptstore's blobs (written with O_DIRECT: not in the page cache)
        return self.file

    # -- ckptstore
    def _instrument(self, store, probe: Probe) -> Callable[[], None]:
        import ckptstore.transfer as T
        saved = {"_file_digest": T._file_digest, "digest_bytes": T.digest_bytes}
        T._file_digest = probe.wrap("hash: blake3 of a blob file (> 16 MiB, streamed)", T._file_digest)
        T.digest_bytes = probe.wrap("hash: blake3 of a blob in memory (<= 16 MiB)", T.digest_bytes)
        dst, src = store.remote_storage, store.storage
        names = {"exists": "remote: exists (HEAD [+ LIST]) per blob", "put_file": "remote: put_file (blob > 16 MiB)",
                 "write_new": "remote: write_new (blob <= 16 MiB, If-None-Match)",
                 "write_atomic": "remote: write_atomic (manifest, commit)",
                 "read_versioned": "remote: read_versioned (latest)",
                 "write_if_match": "remote: write_if_match (latest)"}
        for attr, label in names.items():
            setattr(dst, attr, probe.wrap(label, getattr(dst, attr)))
        src.read_bytes = probe.wrap("local: read_bytes (small blobs, manifests)", src.read_bytes)
        fs = dst.fs
        if getattr(fs, "_s3", None) is not None:
            count_s3_ops(fs._s3)

        def undo() -> None:
            T._file_digest, T.digest_bytes = saved["_file_digest"], saved["digest_bytes"]
            for attr in list(names) + ["read_bytes"]:
                for obj in (dst, src):
                    obj.__dict__.pop(attr, None)
        return undo

    def run_ckptstore(self, workers: int, dedup: bool) -> None:
        from ckptstore import Store
        from ckptstore.catalog import Catalog
        url = self._new_bucket()
        local = C.fresh_dir(self.run_dir, "local-")
        store = Store(local, remote=Remote(url + "/ckpt", workers=workers), storage_options=self.opts,
                      writing=Writing(chunk_size=self.args.chunk_mb * MiB))
        undo = None
        try:
            store.wait_for_uploads()                  # the uploader has listed the (empty) remote
            probe = Probe()
            if not self.args.no_breakdown:
                undo = self._instrument(store, probe)
            _CURRENT_PROBE[0] = probe
            res = store.save(self.state, 1)
            secs, moto_cpu, cli_cpu, _ = self._timed(store.wait_for_uploads)
            _CURRENT_PROBE[0] = None
            held = self._note_tmp()
            st = store._parts.uploader.uploaded[-1]
            ok = st.step == 1 and st.bytes_copied == self.size and 1 in Catalog(store.remote_storage).committed_steps()
            self.samples[f"ckptstore upload w={workers}"].append(dict(
                seconds=secs, moto_cpu=moto_cpu, client_cpu=cli_cpu, bytes=self.size, ok=ok,
                local_save_seconds=res.seconds, blobs=st.blobs_total, blobs_copied=st.blobs_copied,
                bytes_copied=st.bytes_copied, uploader_seconds=st.seconds, moto_tmp_files=held,
                breakdown=probe.snapshot(), loadavg=os.getloadavg()[0]))
            self._log(f"ckptstore upload w={workers}", secs, self.size, ok, f"local save {res.seconds:.2f} s")
            if dedup:
                probe2 = Probe()
                _CURRENT_PROBE[0] = probe2
                if undo is not None:        # re-point the timers at the new probe
                    undo()
                    undo = self._instrument(store, probe2)
                flip([t for _, t in self.changed])
                try:
                    res2 = store.save(self.state, 2)
                    secs2, moto2, cli2, _ = self._timed(store.wait_for_uploads)
                finally:
                    flip([t for _, t in self.changed])
                    _CURRENT_PROBE[0] = None
                st2 = store._parts.uploader.uploaded[-1]
                ok2 = st2.step == 2 and st2.bytes_copied == self.changed_bytes
                self.samples["ckptstore dedup step 2"].append(dict(
                    seconds=secs2, moto_cpu=moto2, client_cpu=cli2, bytes=st2.bytes_copied, ok=ok2,
                    changed_bytes=self.changed_bytes, state_bytes=self.size, local_save_seconds=res2.seconds,
                    local_bytes_written=res2.bytes_written, blobs=st2.blobs_total, blobs_copied=st2.blobs_copied,
                    bytes_copied=st2.bytes_copied, uploader_seconds=st2.seconds, workers=workers,
                    breakdown=probe2.snapshot(), loadavg=os.getloadavg()[0]))
                self._log("ckptstore dedup step 2", secs2, st2.bytes_copied, ok2,
                          f"uploaded {st2.bytes_copied / MiB:.0f} of {self.size / MiB:.0f} MiB")
        finally:
            _CURRENT_PROBE[0] = None
            try:
                store.close()
            finally:
                if undo is not None:
                    undo()
                self._cleanup(url)
                C.rmtree(local)

    # -- s3fs
    def run_s3fs(self) -> None:
        import s3fs
        path = self.ensure_file()
        url = self._new_bucket()
        try:
            fs = s3fs.S3FileSystem(skip_instance_cache=True, **self.opts)
            bucket = url.split("://", 1)[1]
            fs.ls(bucket)                             # connect (not timed)
            probe = Probe()
            count_s3_ops(fs.s3)
            _CURRENT_PROBE[0] = probe
            secs, moto_cpu, cli_cpu, _ = self._timed(lambda: fs.put_file(str(path), f"{bucket}/state.bin"))
            _CURRENT_PROBE[0] = None
            held = self._note_tmp()
            ok = int(fs.info(f"{bucket}/state.bin", refresh=True)["size"]) == self.size
            self.samples["s3fs put_file"].append(dict(
                seconds=secs, moto_cpu=moto_cpu, client_cpu=cli_cpu, bytes=self.size, ok=ok, moto_tmp_files=held,
                breakdown=probe.snapshot(), loadavg=os.getloadavg()[0]))
            self._log("s3fs put_file", secs, self.size, ok)
        finally:
            _CURRENT_PROBE[0] = None
            self._cleanup(url)

    # -- boto3
    def run_boto3(self) -> None:
        import boto3
        from boto3.s3.transfer import TransferConfig
        from botocore.config import Config
        path = self.ensure_file()
        url = self._new_bucket()
        bucket = url.split("://", 1)[1]
        a = self.args
        client = boto3.client("s3", endpoint_url=self.server.endpoint, aws_access_key_id=self.server.key,
                              aws_secret_access_key=self.server.secret, region_name=self.server.region,
                              config=Config(s3={"addressing_style": "path"},
                                            max_pool_connections=max(10, a.boto_concurrency)))
        try:
            client.head_bucket(Bucket=bucket)         # connect (not timed)
            cfg = TransferConfig(max_concurrency=a.boto_concurrency, multipart_chunksize=a.boto_chunk_mb * MiB)
            probe = Probe()
            count_s3_ops(client)
            _CURRENT_PROBE[0] = probe
            secs, moto_cpu, cli_cpu, _ = self._timed(
                lambda: client.upload_file(str(path), bucket, "state.bin", Config=cfg))
            _CURRENT_PROBE[0] = None
            held = self._note_tmp()
            ok = client.head_object(Bucket=bucket, Key="state.bin")["ContentLength"] == self.size
            self.samples["boto3 upload_file"].append(dict(
                seconds=secs, moto_cpu=moto_cpu, client_cpu=cli_cpu, bytes=self.size, ok=ok, moto_tmp_files=held,
                breakdown=probe.snapshot(), loadavg=os.getloadavg()[0]))
            self._log("boto3 upload_file", secs, self.size, ok)
        finally:
            _CURRENT_PROBE[0] = None
            self._cleanup(url)
            client.close()

    def _log(self, name: str, secs: float, nbytes: int, ok: bool, extra: str = "") -> None:
        print(f"  {name:<28} {secs:7.2f} s  {nbytes / MiB / secs if secs else 0:8.1f} MiB/s"
              f"{'' if ok else '  CHECK FAILED'}  {extra}", file=sys.stderr, flush=True)

    def run(self) -> None:
        a = self.args
        plan: list[tuple[str, Callable[[], None]]] = []
        workers = list(a.workers) if "ckptstore" in a.only else []
        if not a.no_dedup and "ckptstore" in a.only and a.dedup_workers not in workers:
            workers.append(a.dedup_workers)
        for w in workers:
            plan.append((f"ckptstore w={w}", lambda w=w: self.run_ckptstore(w, dedup=(not a.no_dedup
                                                                                    and w == a.dedup_workers))))
        if "s3fs" in a.only:
            plan.append(("s3fs", self.run_s3fs))
        if "boto3" in a.only:
            plan.append(("boto3", self.run_boto3))
        for r in range(a.repeat):
            print(f"repeat {r + 1}/{a.repeat}", file=sys.stderr, flush=True)
            for name, fn in plan:
                try:
                    fn()
                except Exception as e:  # noqa: BLE001 - report and go on with the other methods
                    print(f"  {name}: FAILED {type(e).__name__}: {e}", file=sys.stderr, flush=True)
                    if os.environ.get("BENCH_DEBUG"):
                        traceback.print_exc()
                    self.samples[f"failed: {name}"].append({"error": f"{type(e).__name__}: {e}"})
                gc.collect()
                after = held_tmp_files(self.server.pids(), self.tmpdir)
                if after[1] > 64 * MiB:
                    print(f"  note: moto still holds {after[0]} temp files ({after[1] / MiB:.0f} MiB) after "
                          "cleanup; resetting it", file=sys.stderr)
                    self.server.reset()


# --------------------------------------------------------------------------- report


def _med(xs: list[float]) -> float:
    return statistics.median(xs)


def render(b: Bench) -> str:
    rows = [k for k in b.samples if k.startswith("ckptstore upload")]
    rows += [k for k in ("s3fs put_file", "boto3 upload_file", "ckptstore dedup step 2") if k in b.samples]
    boto = b.samples.get("boto3 upload_file")
    boto_med = _med([s["seconds"] for s in boto]) if boto else None
    head = (f"{'row':<26} {'seconds':>8} {'min-max':>13} {'MiB/s':>7} {'x boto3':>7} {'moto cpu':>8} "
            f"{'client cpu':>10}  note")
    lines = [head, "-" * len(head)]
    for name in rows:
        ss = b.samples[name]
        secs = [s["seconds"] for s in ss]
        med = _med(secs)
        nbytes = _med([s["bytes"] for s in ss])
        ratio = f"{med / boto_med:.2f}" if boto_med else "n/a"
        note = "" if all(s["ok"] for s in ss) else "CHECK FAILED "
        if name.startswith("ckptstore upload"):
            s0 = ss[0]
            note += (f"{s0['blobs']} blobs; local save {_med([s['local_save_seconds'] for s in ss]):.2f} s "
                     "(not counted)")
        elif name == "ckptstore dedup step 2":
            s0 = ss[0]
            note += (f"uploaded {s0['bytes_copied'] / MiB:.0f} MiB = {s0['bytes_copied'] / s0['state_bytes']:.1%} "
                     f"of the state (changed: {s0['changed_bytes'] / MiB:.0f} MiB), "
                     f"{s0['blobs_copied']}/{s0['blobs']} blobs, w={s0['workers']}")
        elif name == "s3fs put_file":
            note += "default chunksize (50 MiB) / max_concurrency (10)"
        elif name == "boto3 upload_file":
            note += (f"TransferConfig(max_concurrency={b.args.boto_concurrency}, "
                     f"multipart_chunksize={b.args.boto_chunk_mb} MiB)")
        lines.append(f"{name:<26} {med:8.2f} {min(secs):6.2f}-{max(secs):<6.2f} {nbytes / MiB / med:7.1f} "
                     f"{ratio:>7} {_med([s['moto_cpu'] for s in ss]):8.1f} "
                     f"{_med([s['client_cpu'] for s in ss]):10.1f}  {note}")
    for k, v in b.samples.items():
        if k.startswith("failed: "):
            lines.append(f"{k:<26} {v[0]['error']}")
    return "\n".join(lines)


def render_breakdown(b: Bench) -> str:
    out = []
    for name, ss in b.samples.items():
        if name.startswith("failed") or not ss or "breakdown" not in ss[0]:
            continue
        s = min(ss, key=lambda s: s["seconds"])       # the fastest repeat
        bd = s["breakdown"]
        parts = [f"{name} (fastest repeat, {s['seconds']:.2f} s wall):"]
        for label, rec in sorted(bd["timers"].items(), key=lambda kv: -kv[1]["seconds"]):
            avg = rec["seconds"] / rec["calls"] * 1e3 if rec["calls"] else 0.0
            parts.append(f"    {label:<52} {rec['calls']:5d} calls {rec['seconds']:8.2f} thread-s "
                         f"({avg:7.1f} ms/call)")
        for op, rec in bd["s3_ops"].items():
            avg = rec["seconds"] / rec["calls"] * 1e3 if rec["calls"] else 0.0
            parts.append(f"    {'S3 ' + op:<52} {rec['calls']:5d} calls {rec['seconds']:8.2f} request-s "
                         f"({avg:7.1f} ms/call)")
        out.append("\n".join(parts))
    return "\n".join(out)


def main() -> int:
    args = ARGS
    b = Bench(args)
    import blake3
    import boto3
    import botocore
    import ckptstore
    import moto
    import s3fs
    from ckptstore.threads import BACKGROUND_NICE
    print(f"state: {b.size / MiB:.0f} MiB in {len(b.flat)} fp32 tensors (d_model {b.d_model}; largest "
          f"{max(C.nbytes(t) for _, t in b.flat) / MiB:.1f} MiB, {sum(C.nbytes(t) > 16 * MiB for _, t in b.flat)} "
          f"> 16 MiB, {sum(C.nbytes(t) < MiB for _, t in b.flat)} < 1 MiB), built in {b.build_s:.1f} s; "
          f"dedup changes {len(b.changed)} tensors, {b.changed_bytes / MiB:.0f} MiB "
          f"({b.changed_bytes / b.size:.1%})", file=sys.stderr)
    try:
        b.start()
        print(f"moto {moto.__version__} at {b.server.endpoint}, TMPDIR {b.server_tmpdir} ({b.tmp_fs}); "
              f"ckptstore background nice {BACKGROUND_NICE}; scratch {b.run_dir} ({C.fs_type(b.run_dir)})",
              file=sys.stderr)
        b.run()
    finally:
        b.stop()
    table = render(b)
    print()
    print(f"Upload of a {b.size / MiB:.0f} MiB fp32 state ({len(b.flat)} tensors) to moto S3 on 127.0.0.1, "
          f"median of {args.repeat}; {os.cpu_count()} CPUs. MiB/s = bytes uploaded / median seconds; "
          "x boto3 = median / boto3's median (>1 = slower); cpu = CPU seconds (user+sys) of the moto "
          "process / of this process during the timed part.")
    print(table)
    if not args.no_breakdown:
        print()
        print("Where the time goes: ckptstore's calls (thread-seconds, summed over parallel workers) and S3 requests "
              "(request-seconds: sent to answer parsed, summed over concurrent requests):")
        print(render_breakdown(b))
    print(f"\nmoto spooled objects to {b.tmpdir} on {b.tmp_fs}: up to {b.tmp_seen[0]} open temp files, "
          f"{b.tmp_seen[1] / MiB:.0f} MiB, seen after an upload")
    if args.json:
        out = dict(
            args=vars(args), state_bytes=b.size, n_tensors=len(b.flat), d_model=b.d_model,
            changed_bytes=b.changed_bytes, moto_tmpdir=b.server_tmpdir, moto_tmp_fs=b.tmp_fs,
            background_nice=BACKGROUND_NICE, cpus=os.cpu_count(), platform=platform.platform(),
            versions=dict(python=platform.python_version(), torch=torch.__version__, moto=moto.__version__,
                          s3fs=s3fs.__version__, boto3=boto3.__version__, botocore=botocore.__version__,
                          ckptstore=getattr(ckptstore, "__version__", "?"), blake3=getattr(blake3, "__version__", "?")),
            samples=b.samples)
        Path(args.json).write_text(json.dumps(out, indent=1, default=str))
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
