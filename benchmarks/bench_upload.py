#!/usr/bin/env python
"""Upload benchmark: ckptstore's background upload vs s3fs ``put_file`` vs boto3's transfer manager, for the
same bytes, against ONE local moto S3 server (127.0.0.1), in one run.

    python benchmarks/bench_upload.py --size-mb 200 --repeat 1          # quick (~1 min)
    python benchmarks/bench_upload.py                                   # 1 GiB state, 2 repeats
    python benchmarks/bench_upload.py --size-mb 200 --workers 4,8,16 --json up.json

Contenders, alternated (see benchmarks/README.md, "bench_upload.py"):
  * ckptstore upload w=N: ``Store(remote=Remote(s3://..., workers=N)).save(state, 1)`` into an empty bucket
    (``--codecs``: ``Writing(codec=)`` of the save; ``--remote-codecs``: ``Remote(codec=)`` of the uploader);
    timed from ``save()`` returning (the step is committed locally) to ``wait_for_uploads()`` returning. The
    ``--dedup-workers`` store then measures "ckptstore dedup step 2": half of the tensors change (bit-flipped
    in place), ``save(state, 2)``; bytes uploaded (``TransferStats.bytes_copied``) vs state bytes.
  * s3fs put_file: ``s3fs.S3FileSystem.put_file`` of the same bytes as one local file (written once).
  * boto3 upload_file (the anchor): ``client.upload_file`` with ``TransferConfig(max_concurrency=8,
    multipart_chunksize=64 MiB)``.

Every measurement gets a fresh bucket, emptied and deleted afterwards, and a fresh local folder.
"""
from __future__ import annotations

import os
import sys
import threading
import time
from collections import defaultdict
from pathlib import Path
from typing import Any, Callable

import harness as H  # noqa: E402  (puts the checkout on sys.path; imports no ckptstore)
import common as C  # noqa: E402
import torch  # noqa: E402

MiB = C.MiB
BOTO, DEDUP = "boto3 upload_file", "ckptstore dedup step 2"


def parse_args(argv: list[str] | None = None):
    p = H.parser(__doc__, repeat=2)
    p.add_argument("--size-mb", type=int, default=1024, help="state size in MiB (default 1024)")
    p.add_argument("--workers", default="4,8", help="ckptstore Remote(workers=) values, comma-separated")
    p.add_argument("--chunk-mb", type=int, default=64, help="ckptstore Writing(chunk_size=) in MiB (default 64)")
    p.add_argument("--codecs", default="raw",
                   help="ckptstore Writing(codec=) values, comma-separated (raw, zstd, auto; default raw): one "
                        "ckptstore contender per codec and worker count (issue 30: does a codec pay on upload?)")
    p.add_argument("--remote-codecs", default="raw",
                   help="ckptstore Remote(codec=) values, comma-separated (raw, auto; default raw): one contender "
                        "per pair with --codecs; auto: the save writes as --codecs says (raw: a raw local save), the "
                        "uploader encodes float blobs on their way up (issue 30)")
    p.add_argument("--boto-concurrency", type=int, default=8, help="boto3 TransferConfig max_concurrency")
    p.add_argument("--boto-chunk-mb", type=int, default=64, help="boto3 TransferConfig multipart_chunksize")
    p.add_argument("--dedup-workers", type=int, default=None,
                   help="workers of the store that also measures step 2 (default: last --workers value)")
    p.add_argument("--no-dedup", action="store_true", help="skip the dedup (step 2) measurement")
    p.add_argument("--only", default="ckptstore,s3fs,boto3", help="subset of ckptstore,s3fs,boto3")
    p.add_argument("--nice", type=int, default=None,
                   help="CKPTSTORE_BACKGROUND_NICE for ckptstore's threads (default: the library's, 10); "
                        "the baselines' threads are never niced")
    p.add_argument("--no-breakdown", action="store_true",
                   help="do not wrap ckptstore's hashing / storage calls with timers")
    args = p.parse_args(argv)
    args.workers = [int(w) for w in str(args.workers).split(",") if w.strip()]
    args.only = [m.strip() for m in args.only.split(",") if m.strip()]
    args.codecs = [c.strip() for c in str(args.codecs).split(",") if c.strip()]
    args.remote_codecs = [c.strip() for c in str(args.remote_codecs).split(",") if c.strip()]
    if set(args.remote_codecs) - {"raw", "auto"}:
        p.error(f"--remote-codecs: unknown {sorted(set(args.remote_codecs) - {'raw', 'auto'})}")
    if set(args.codecs) - {"raw", "zstd", "auto"}:
        p.error(f"--codecs: unknown {sorted(set(args.codecs) - {'raw', 'zstd', 'auto'})}")
    if set(args.only) - {"ckptstore", "s3fs", "boto3"}:
        p.error(f"--only: unknown {sorted(set(args.only) - {'ckptstore', 's3fs', 'boto3'})}")
    if args.dedup_workers is None:
        args.dedup_workers = args.workers[-1] if args.workers else 8
    if args.size_mb < 8:
        p.error("--size-mb must be >= 8")
    return args


# --------------------------------------------------------------------------- state


def build_state(size_bytes: int, seed: int) -> tuple[dict[str, Any], list[tuple[str, torch.Tensor]], int]:
    """A GPT-like fp32 model (4 blocks, untied embedding / head with vocab = 32 * d_model) plus AdamW's
    exp_avg and exp_avg_sq for every parameter, random values (no duplicate chunks, incompressible).
    d_model is the largest multiple of 8 that fits; a 1-D ``model.pad`` buffer tops it up to exactly
    ``size_bytes``. Returns (state, [(path, tensor)], d_model)."""
    def shapes(d: int) -> list[tuple[str, tuple[int, ...]]]:
        v = 32 * d
        out = [("wte.weight", (v, d))]
        for i in range(4):
            b = f"blocks.{i}."
            out += [(b + "ln1.weight", (d,)), (b + "ln1.bias", (d,)), (b + "qkv.weight", (3 * d, d)),
                    (b + "qkv.bias", (3 * d,)), (b + "proj.weight", (d, d)), (b + "proj.bias", (d,)),
                    (b + "ln2.weight", (d,)), (b + "ln2.bias", (d,)), (b + "fc.weight", (4 * d, d)),
                    (b + "fc.bias", (4 * d,)), (b + "fc2.weight", (d, 4 * d)), (b + "fc2.bias", (d,))]
        return out + [("ln_f.weight", (d,)), ("ln_f.bias", (d,)), ("head.weight", (v, d))]

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
    if size_bytes - state_bytes(d):
        model["pad"] = torch.randn((size_bytes - state_bytes(d)) // 4, generator=g)
    flat = ([(f"model.{k}", t) for k, t in model.items()] + [(f"optimizer.exp_avg.{k}", t) for k, t in exp_avg.items()]
            + [(f"optimizer.exp_avg_sq.{k}", t) for k, t in exp_avg_sq.items()])
    assert sum(C.nbytes(t) for _, t in flat) == size_bytes
    return {"model": model, "optimizer": {"exp_avg": exp_avg, "exp_avg_sq": exp_avg_sq}}, flat, d


def pick_changed(flat: list[tuple[str, torch.Tensor]]) -> list[torch.Tensor]:
    """Half of the tensors, holding about half of the bytes: every other tensor in order of size (largest
    first). Weight, exp_avg and exp_avg_sq of a parameter have the same size, so the changed half mixes
    weights and moments of every layer."""
    return [t for _, t in sorted(flat, key=lambda kv: (-C.nbytes(kv[1]), kv[0]))[0::2]]


def flip(tensors: list[torch.Tensor]) -> None:
    """XOR every 32-bit word with a constant, in place: changes every byte, bumps the version counter,
    and a second call restores the exact bytes."""
    for t in tensors:
        t.view(torch.int32).bitwise_xor_(0x55555555)


# --------------------------------------------------------------------------- where the time goes


class Probe:
    """Thread-safe call counters: name -> [calls, summed seconds]; S3 API calls by operation name."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.timers: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
        self.ops: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])     # S3 op -> [calls, seconds]

    def count(self, table: dict, name: str, seconds: float) -> None:
        with self.lock:
            table[name][0] += 1
            table[name][1] += seconds

    def wrap(self, name: str, fn: Callable) -> Callable:
        def timed(*a, **kw):
            t0 = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                self.count(self.timers, name, time.perf_counter() - t0)
        return timed

    def snapshot(self) -> dict[str, Any]:
        with self.lock:
            return {k: {n: {"calls": int(v[0]), "seconds": round(v[1], 4)} for n, v in sorted(t.items())}
                    for k, t in (("timers", self.timers), ("s3_ops", self.ops))}


_PROBE: list[Probe | None] = [None]     # the probe of the measurement running now (botocore's hooks count into it)


def _before_call(context=None, **kwargs) -> None:
    if context is not None:
        context["bench_upload_t0"] = time.perf_counter()


def _after_call(model=None, context=None, **kwargs) -> None:
    # botocore and aiobotocore pass the same request context to before-call and after-call (also when the
    # answer is an HTTP error such as a 404 HEAD), so this times each call even when many share one thread.
    t0 = (context or {}).get("bench_upload_t0")
    if _PROBE[0] is not None and t0 is not None:
        _PROBE[0].count(_PROBE[0].ops, model.name if model is not None else "?", time.perf_counter() - t0)


def count_s3_ops(client) -> None:
    """Count and time the API calls of a boto3 / aiobotocore client into the current probe (once per client)."""
    ev = client.meta.events
    ev.register("before-call.s3", _before_call, unique_id="bench-upload-before")
    ev.register("after-call.s3", _after_call, unique_id="bench-upload-after")
    ev.register("after-call-error.s3", _after_call, unique_id="bench-upload-error")


def instrument(store, probe: Probe) -> Callable[[], None]:
    """Wrap ckptstore's hashing and storage calls with timers (in this process; ckptstore is not changed).
    Returns the undo."""
    import ckptstore.remote.transfer as T
    saved = {"_file_digest": T._file_digest, "digest_bytes": T.digest_bytes}
    T._file_digest = probe.wrap("hash: blake3 of a blob file (> 16 MiB, streamed)", T._file_digest)
    T.digest_bytes = probe.wrap("hash: blake3 of a blob in memory (<= 16 MiB)", T.digest_bytes)
    dst, src = store.remote_storage, store.storage
    names = {"exists": "remote: exists (HEAD [+ LIST]) per blob", "put_file": "remote: put_file (blob > 16 MiB)",
             "write_new": "remote: write_new (blob <= 16 MiB, If-None-Match)",
             "write_atomic": "remote: write_atomic (manifest, commit)",
             "read_versioned": "remote: read_versioned (latest)", "write_if_match": "remote: write_if_match (latest)"}
    for attr, label in names.items():
        setattr(dst, attr, probe.wrap(label, getattr(dst, attr)))
    src.read_bytes = probe.wrap("local: read_bytes (small blobs, manifests)", src.read_bytes)
    if getattr(dst.fs, "_s3", None) is not None:
        count_s3_ops(dst.fs._s3)

    def undo() -> None:
        T._file_digest, T.digest_bytes = saved["_file_digest"], saved["digest_bytes"]
        for attr in list(names) + ["read_bytes"]:
            for obj in (dst, src):
                obj.__dict__.pop(attr, None)
    return undo


# --------------------------------------------------------------------------- contenders


class Bench:
    def __init__(self, args):
        from backends.launcher import S3Server
        self.args, self.size = args, args.size_mb * MiB
        self.run_dir = C.fresh_dir(H.scratch_dir(args.dir), "bench-upload-")
        t0 = time.perf_counter()
        self.state, self.flat, self.d_model = build_state(self.size, args.seed)
        self.build_s = time.perf_counter() - t0
        self.changed = pick_changed(self.flat)
        self.changed_bytes = sum(C.nbytes(t) for t in self.changed)
        self.file: Path | None = None
        self.server = S3Server(workdir=self.run_dir / "moto").start()
        self.tmpdir, self.opts, self.tmp_seen = self.server.workdir / "tmp", self.server.storage_options(), (0, 0)
        try:
            with open(f"/proc/{self.server.pid}/environ", "rb") as f:
                env = dict(kv.split(b"=", 1) for kv in f.read().split(b"\0") if b"=" in kv)
            self.server_tmpdir = env.get(b"TMPDIR", b"").decode()
        except OSError:
            self.server_tmpdir = None
        if self.server_tmpdir != str(self.tmpdir):
            print(f"WARNING: moto's TMPDIR is {self.server_tmpdir!r}, expected {self.tmpdir}", file=sys.stderr)
        self.tmp_fs = C.fs_type(self.tmpdir)
        if self.tmp_fs in ("tmpfs", "ramfs"):
            print(f"WARNING: moto's TMPDIR {self.tmpdir} is on {self.tmp_fs}: objects are spooled to RAM; "
                  "pass --dir on a disk", file=sys.stderr)

    def baseline_file(self) -> Path:
        """The baselines' file: the same bytes, written once, evicted from the page cache before each upload
        (cold, like ckptstore's blobs, written with O_DIRECT)."""
        if self.file is None:
            self.file = self.run_dir / "state.bin"
            with open(self.file, "wb") as f:
                for _, t in self.flat:
                    f.write(memoryview(t.contiguous().numpy()).cast("B"))
                f.flush()
                os.fsync(f.fileno())
        C.evict(self.file)
        return self.file

    def held_tmp_files(self) -> tuple[int, int]:
        """(count, bytes) of files under moto's TMPDIR that it holds open (its spooled objects)."""
        from backends.launcher import open_files
        n = size = 0
        for entry, target in open_files(self.server.pids()):
            if target.startswith(str(self.tmpdir)):
                try:
                    size, n = size + os.stat(entry).st_size, n + 1
                except OSError:
                    pass
        return n, size

    def upload(self, res: H.Results, m_name: str, fn: Callable[[], Any], probe: Probe) -> dict:
        """Time ``fn`` (an upload) as a sample of ``m_name``, with moto's / this process's CPU and the probe."""
        _PROBE[0] = probe
        try:
            with C.cpu_seconds(self.server.pids()) as cpu, res.timed(m_name) as m:
                fn()
        finally:
            _PROBE[0] = None
        m.update(cpu, breakdown=probe.snapshot(), loadavg=os.getloadavg()[0])
        held = self.held_tmp_files()
        self.tmp_seen = max(self.tmp_seen, held, key=lambda h: h[1])
        m["moto_tmp_files"] = held
        return m

    def ckptstore(self, workers: int, dedup: bool, codec: str = "raw", remote_codec: str = "raw") -> Callable:
        def run(res: H.Results, url: str) -> None:
            from ckptstore import Remote, Store, Writing
            from ckptstore.format.catalog import Catalog
            local = C.fresh_dir(self.run_dir, "local-")
            store = Store(local, remote=Remote(url + "/ckpt", workers=workers, codec=remote_codec),
                          storage_options=self.opts,
                          writing=Writing(chunk_size=self.args.chunk_mb * MiB, codec=codec))
            undo = None
            try:
                store.wait_for_uploads()                  # the uploader has listed the (empty) remote
                for step, name in ((1, upload_row(workers, codec, remote_codec)), (2, DEDUP)):
                    if step == 2 and not dedup:
                        break
                    probe = Probe()
                    if undo is not None:
                        undo()
                    undo = None if self.args.no_breakdown else instrument(store, probe)
                    if step == 2:
                        flip(self.changed)
                    _PROBE[0] = probe                     # the uploader starts during save()
                    try:
                        r = store.save(self.state, step)
                        m = self.upload(res, name, store.wait_for_uploads, probe)
                    finally:
                        if step == 2:
                            flip(self.changed)
                    st = store._parts.uploader.uploaded[-1]
                    want = self.size if step == 1 else self.changed_bytes
                    # a codec uploads the stored bytes: at most the raw ones (a chunk is kept raw when nothing pays)
                    res.check(name, st.step == step and (st.bytes_copied == want if codec == remote_codec == "raw"
                                                         else 0 < st.bytes_copied <= want)
                              and step in Catalog(store.remote_storage).committed_steps())
                    m.update(bytes=st.bytes_copied, local_save_seconds=r.seconds, local_bytes_written=r.bytes_written,
                             blobs=st.blobs_total, blobs_copied=st.blobs_copied, uploader_seconds=st.seconds)
                    m["note"] = (f"{st.blobs_total} blobs, {st.bytes_copied / self.size:.3f} of the raw bytes; local "
                                 f"save {r.seconds:.2f} s (not counted)" if step == 1 else
                                 f"uploaded {st.bytes_copied / MiB:.0f} MiB = {st.bytes_copied / self.size:.1%} of the "
                                 f"state (changed: {self.changed_bytes / MiB:.0f} MiB), {st.blobs_copied}/"
                                 f"{st.blobs_total} blobs, w={workers}")
            finally:
                store.close()
                if undo is not None:
                    undo()
                C.rmtree(local)
        return run

    def s3fs(self, res: H.Results, url: str) -> None:
        import s3fs
        fs = s3fs.S3FileSystem(skip_instance_cache=True, **self.opts)
        bucket = url.split("://", 1)[1]
        fs.ls(bucket)                                 # connect (not timed)
        count_s3_ops(fs.s3)
        path = self.baseline_file()
        m = self.upload(res, "s3fs put_file", lambda: fs.put_file(str(path), f"{bucket}/state.bin"), Probe())
        res.check("s3fs put_file", int(fs.info(f"{bucket}/state.bin", refresh=True)["size"]) == self.size)
        m.update(bytes=self.size, note="default chunksize (50 MiB) / max_concurrency (10)")

    def boto3(self, res: H.Results, url: str) -> None:
        from boto3.s3.transfer import TransferConfig
        a, bucket = self.args, url.split("://", 1)[1]
        client = C.boto3_client(self.server, a.boto_concurrency)
        try:
            client.head_bucket(Bucket=bucket)         # connect (not timed)
            cfg = TransferConfig(max_concurrency=a.boto_concurrency, multipart_chunksize=a.boto_chunk_mb * MiB)
            count_s3_ops(client)
            path = self.baseline_file()
            m = self.upload(res, BOTO, lambda: client.upload_file(str(path), bucket, "state.bin", Config=cfg), Probe())
            res.check(BOTO, client.head_object(Bucket=bucket, Key="state.bin")["ContentLength"] == self.size)
            m.update(bytes=self.size, note=f"TransferConfig(max_concurrency={a.boto_concurrency}, "
                                           f"multipart_chunksize={a.boto_chunk_mb} MiB)")
        finally:
            client.close()

    def cleanup(self, url: str) -> None:
        self.server.cleanup(url)
        held = self.held_tmp_files()
        if held[1] > 64 * MiB:
            print(f"  note: moto still holds {held[0]} temp files ({held[1] / MiB:.0f} MiB) after cleanup; "
                  "resetting it", file=sys.stderr)
            self.server.reset()

    def contenders(self) -> list[H.Contender]:
        a = self.args
        out = []

        def one(name, run, rows=()):
            return H.Contender(name, run, records=True, rows=rows or (name,),
                               setup=lambda: self.server.new_bucket_url("bench"), teardown=self.cleanup)
        workers = list(a.workers) if "ckptstore" in a.only else []
        if not a.no_dedup and "ckptstore" in a.only and a.dedup_workers not in workers:
            workers.append(a.dedup_workers)
        pairs = [(c, rc) for c in a.codecs for rc in a.remote_codecs]
        for codec, rc in pairs if workers else ():
            for w in workers:
                dedup = not a.no_dedup and w == a.dedup_workers and (codec, rc) == pairs[0]
                out.append(one(f"ckptstore w={w} {codec} remote={rc}", self.ckptstore(w, dedup, codec, rc),
                               (upload_row(w, codec, rc),) + ((DEDUP,) if dedup else ())))
        if "s3fs" in a.only:
            out.append(one("s3fs put_file", self.s3fs))
        if "boto3" in a.only:
            out.append(one(BOTO, self.boto3))
        return out


def upload_row(workers: int, codec: str, remote_codec: str = "raw") -> str:
    return (f"ckptstore upload w={workers}" + ("" if codec == "raw" else f" codec={codec}")
            + ("" if remote_codec == "raw" else f" remote codec={remote_codec}"))


def render_breakdown(res: H.Results) -> str:
    out = []
    for name, row in res.rows.items():
        if not row.samples or "breakdown" not in row.samples[0]:
            continue
        s = min(row.samples, key=lambda s: s["seconds"])       # the fastest repeat
        parts = [f"{name} (fastest repeat, {s['seconds']:.2f} s wall):"]
        items = [(label, rec, "thread-s") for label, rec in s["breakdown"]["timers"].items()]
        items.sort(key=lambda x: -x[1]["seconds"])
        items += [("S3 " + op, rec, "request-s") for op, rec in s["breakdown"]["s3_ops"].items()]
        for label, rec, unit in items:
            avg = rec["seconds"] / rec["calls"] * 1e3 if rec["calls"] else 0.0
            parts.append(f"    {label:<52} {rec['calls']:5d} calls {rec['seconds']:8.2f} {unit} ({avg:7.1f} ms/call)")
        out.append("\n".join(parts))
    return "\n".join(out)


def main() -> int:
    args = parse_args()
    if args.nice is not None:
        os.environ["CKPTSTORE_BACKGROUND_NICE"] = str(args.nice)   # read when ckptstore.util.threads is imported
    import moto
    from ckptstore.util.threads import BACKGROUND_NICE
    b = Bench(args)
    print(f"state: {b.size / MiB:.0f} MiB in {len(b.flat)} fp32 tensors (d_model {b.d_model}; largest "
          f"{max(C.nbytes(t) for _, t in b.flat) / MiB:.1f} MiB, {sum(C.nbytes(t) > 16 * MiB for _, t in b.flat)} "
          f"> 16 MiB, {sum(C.nbytes(t) < MiB for _, t in b.flat)} < 1 MiB), built in {b.build_s:.1f} s; "
          f"dedup changes {len(b.changed)} tensors, {b.changed_bytes / MiB:.0f} MiB ({b.changed_bytes / b.size:.1%})",
          file=sys.stderr)
    print(f"moto {moto.__version__} at {b.server.endpoint}, TMPDIR {b.server_tmpdir} ({b.tmp_fs}); ckptstore "
          f"background nice {BACKGROUND_NICE}; scratch {b.run_dir} ({C.fs_type(b.run_dir)})", file=sys.stderr)
    try:
        res = H.compare(b.contenders(), args.repeat)
    finally:
        b.server.stop()
        C.rmtree(b.run_dir)
    ratios = {"x boto3": BOTO}
    cols = [("MiB/s", lambda r: f"{r.median('bytes') / MiB / r.median():.1f}" if r.values("bytes") else "n/a"),
            ("local save s", lambda r: f"{r.median('local_save_seconds'):.2f}" if r.values("local_save_seconds")
             else ""),
            ("moto cpu", lambda r: f"{r.median('moto_cpu'):.1f}"), ("client cpu", lambda r: f"{r.median('client_cpu'):.1f}")]
    print(f"\n{H.banner()}\nUpload of a {b.size / MiB:.0f} MiB fp32 state ({len(b.flat)} tensors) to moto S3 on "
          f"127.0.0.1, median of {args.repeat}. MiB/s = bytes uploaded / median seconds; x boto3 = median / boto3's "
          "median (>1 = slower); cpu = CPU seconds (user+sys) of the moto process / of this process during the "
          "timed part.")
    print(res.table(ratios=ratios, columns=cols, head="row", fmt="{:.2f}"))
    if not args.no_breakdown:
        print("\nWhere the time goes: ckptstore's calls (thread-seconds, summed over parallel workers) and S3 "
              "requests (request-seconds: sent to answer parsed, summed over concurrent requests):")
        print(render_breakdown(res))
    print(f"\nmoto spooled objects to {b.tmpdir} on {b.tmp_fs}: up to {b.tmp_seen[0]} open temp files, "
          f"{b.tmp_seen[1] / MiB:.0f} MiB, seen after an upload")
    H.write_json(args.json, args, state_bytes=b.size, n_tensors=len(b.flat), d_model=b.d_model,
                 changed_bytes=b.changed_bytes, moto=moto.__version__, moto_tmpdir=b.server_tmpdir,
                 moto_tmp_fs=b.tmp_fs, background_nice=BACKGROUND_NICE, rows=res.to_json(ratios))
    return 0


if __name__ == "__main__":
    sys.exit(main())
