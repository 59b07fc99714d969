#!/usr/bin/env python
"""Many-small-tensors benchmark: ckptstore vs torch.save vs raw O_DIRECT I/O (and, with --remote, vs boto3
against a moto S3 server on 127.0.0.1), on ONE state, in one run.

    python benchmarks/bench_packs.py --state small --repeat 3 --remote      # ~33 MB in 4000 tensors
    python benchmarks/bench_packs.py --state gpt1gb --repeat 2 --json packs_1gb.json

States (--state):
  * small:  --n-tensors (4000) fp32 tensors of random sizes in [--min-bytes, --max-bytes] (64 B - 16 KiB),
            seeded, random values, laid out like a model: {"model": {"layer{i}.w{j}": tensor}} (~33 MB).
  * gpt1gb / gpt3gb: the GPT + AdamW state of common.py (sizes "1gb" / "3gb", as bench_save.py).

Rows (median of --repeat, round-robin; see benchmarks/README.md, "bench_packs.py"):
  1. save: ckptstore ``Store(root).save(state, 1)`` into a fresh store vs ``torch.save`` + fsync vs the raw
     O_DIRECT write of the same tensor bytes (common.raw_write).
  2. load: ``Store(root).load(1)`` with a fresh Store each time and the store evicted from the page cache
     (common.evict) vs ``torch.load(weights_only=True)`` of the evicted file vs the raw O_DIRECT read.
  3. files per step: what one save leaves under objects/, packs/, steps/<step>/ (and elsewhere), with
     apparent and allocated bytes.
  4. --remote: ckptstore upload (save(), then wait_for_uploads() timed alone) vs boto3 ``upload_file`` of the
     torch.save file (one object); remote resume into an empty local root (``Store(empty, remote=...)``
     + ``resume``) vs boto3 ``download_file`` (+ torch.load). Requests are counted from moto's request log
     (per bucket: every measurement gets a fresh bucket), objects with ``list_objects_v2``.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import platform
import re
import statistics
import sys
import time
import traceback
from collections import Counter
from pathlib import Path
from typing import Any, Callable

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(REPO))  # ckptstore and backends from this checkout (before the venv's editable install)

import torch  # noqa: E402

import common as C  # noqa: E402

MiB = C.MiB
STEP = 1

SAVE_ROWS = ("raw write O_DIRECT+fsync", "torch.save+fsync", "ckptstore save")
LOAD_ROWS = ("raw read O_DIRECT", "torch.load cold", "ckptstore load cold")
# row -> (torch baseline row, raw baseline row), for common.render_table
REFS = {**{r: ("torch.save+fsync", "raw write O_DIRECT+fsync") for r in SAVE_ROWS},
        **{r: ("torch.load cold", "raw read O_DIRECT") for r in LOAD_ROWS}}
UP_ROWS = ("boto3 upload_file (1 object)", "ckptstore upload (wait_for_uploads)")
DOWN_ROWS = ("boto3 download_file (1 object)", "boto3 download_file+torch.load",
             "ckptstore resume, empty local root")


# --------------------------------------------------------------------------- states


class State:
    """The one state every method saves. ``store_state``: what Store.save gets; ``torch_obj()``: what
    torch.save gets; ``tensors``: every tensor (raw I/O, fingerprint); ``resume_like()`` / ``resumed_ok()``:
    a state to resume into and its check."""

    def __init__(self, args: argparse.Namespace):
        t0 = time.perf_counter()
        self.kind = args.state
        if args.state == "small":
            g = torch.Generator().manual_seed(args.seed)
            lo, hi = max(1, args.min_bytes // 4), max(1, args.max_bytes // 4)
            sizes = torch.randint(lo, hi + 1, (args.n_tensors,), generator=g).tolist()
            per = args.per_layer
            self.model_sd = {f"layer{k // per}.w{k % per}": torch.randn(n, generator=g)
                             for k, n in enumerate(sizes)}
            self.store_state: dict[str, Any] = {"model": self.model_sd}
            self.tensors = list(self.model_sd.values())
            self.desc = (f"{len(sizes)} fp32 tensors of {lo * 4}-{hi * 4} B (seed {args.seed}), "
                         f"{per} per layer")
        else:
            size = {"gpt1gb": "1gb", "gpt3gb": "3gb"}[args.state]
            self.model, self.opt = C.build_state(size, seed=args.seed)
            self.store_state = {"model": self.model, "optimizer": self.opt}
            self.tensors = C.state_tensors(self.model, self.opt)
            self.desc = f"GPT + AdamW (common.py size {size!r})"
        self.build_s = time.perf_counter() - t0
        self.n_tensors = len(self.tensors)
        self.nbytes = sum(C.nbytes(t) for t in self.tensors)
        self.sizes = sorted(C.nbytes(t) for t in self.tensors)
        self.ref = C.fingerprint(self.tensors)

    def torch_obj(self) -> dict[str, Any]:
        if self.kind == "small":
            return self.store_state
        return {"model": self.model.state_dict(), "optimizer": self.opt.state_dict()}

    def tree_ok(self, obj: Any) -> bool:
        return C.fingerprint(C.tree_tensors(obj)) == self.ref

    def resume_like(self) -> dict[str, Any]:
        """small: a fresh dict of empty tensors (resume replaces plain entries); gpt: the live Stateful model
        and optimizer (resume loads into them; the caller perturbs them first)."""
        if self.kind == "small":
            return {"model": {k: torch.empty_like(t) for k, t in self.model_sd.items()}}
        return {"model": self.model, "optimizer": self.opt}

    def resumed_ok(self, like: dict[str, Any]) -> bool:
        if self.kind == "small":
            return self.tree_ok(like)
        return C.fingerprint(C.state_tensors(self.model, self.opt)) == self.ref


# --------------------------------------------------------------------------- files on disk


def count_files(root: Path, step: int) -> dict[str, dict[str, int]]:
    """Files under a store root by area: objects, packs, steps/<step>, root (files directly in the root: marker,
    latest pointer), other:<dir>; per area: files, apparent bytes, allocated bytes (st_blocks), plus folders."""
    out: dict[str, dict[str, int]] = {}
    for dirpath, dirs, files in os.walk(root):
        parts = Path(dirpath).relative_to(root).parts
        if not parts:
            area = "root"
        elif parts[0] in ("objects", "packs"):
            area = parts[0]
        elif parts[0] == "steps" and (len(parts) == 1 or (parts[1].isdigit() and int(parts[1]) == step)):
            area = "steps/<step>"                     # the step's folder (and steps/ itself, on a fresh store)
        else:
            area = "other:" + "/".join(parts[:2])
        rec = out.setdefault(area, {"files": 0, "bytes": 0, "allocated": 0, "dirs": 0})
        rec["dirs"] += len(dirs)
        for n in files:
            st = os.lstat(os.path.join(dirpath, n))
            rec["files"] += 1
            rec["bytes"] += st.st_size
            rec["allocated"] += st.st_blocks * 512
    out["total"] = {k: sum(v[k] for v in out.values()) for k in ("files", "bytes", "allocated", "dirs")}
    return out


def file_stat(path: Path) -> dict[str, int]:
    st = path.stat()
    return {"files": 1, "bytes": st.st_size, "allocated": st.st_blocks * 512, "dirs": 0}


# --------------------------------------------------------------------------- bench


def _debug() -> None:
    if os.environ.get("BENCH_DEBUG"):
        traceback.print_exc()


class Bench:
    def __init__(self, args: argparse.Namespace, st: State):
        self.args, self.st = args, st
        self.base = Path(args.dir).resolve()
        self.base.mkdir(parents=True, exist_ok=True)
        self.direct = C.o_direct_supported(self.base)
        # staging buffer of the raw rows: 64 MiB as in bench_save.py, but no bigger than the state (a 64 MiB
        # buffer for a 33 MB state would time page faults on memory the write never uses)
        self.raw_block = min(args.raw_block_mib * MiB, C._round_up(st.nbytes))
        self.run_dir = C.fresh_dir(self.base, "bench-packs-")
        self.samples: dict[str, list[float]] = {}
        self.disk: dict[str, list[int]] = {}
        self.notes: dict[str, str] = {}
        self.extra: dict[str, list[dict[str, Any]]] = {}   # per-row details of each repeat (JSON)
        self.files: dict[str, Any] = {}
        self.verify_now = False
        self.server = None
        self.torch_file: Path | None = None
        self.requests_ok = True

    # -- bookkeeping
    def add(self, name: str, seconds: float, disk: int | None = None, note: str = "", **extra: Any) -> None:
        self.samples.setdefault(name, []).append(seconds)
        if disk is not None:
            self.disk.setdefault(name, []).append(disk)
        if note:
            self.notes[name] = note
        self.extra.setdefault(name, []).append(dict(seconds=seconds, **extra))

    def fail(self, names: tuple[str, ...], e: BaseException) -> None:
        for n in names:
            self.notes[n] = "n/a: " + C.fmt_note(e)
        _debug()

    def check(self, name: str, ok: bool) -> None:
        if not ok:
            self.notes[name] = (self.notes.get(name, "") + " WRONG DATA").strip()

    # -- local cases
    def case_raw(self, d: Path) -> None:
        f = d / "raw.bin"
        try:
            t0 = time.perf_counter()
            n, io_s = C.raw_write(self.st.tensors, f, block=self.raw_block, direct=self.direct)
            self.add(SAVE_ROWS[0], time.perf_counter() - t0, f.stat().st_size,
                     f"write+fsync calls {io_s:.3f} s" + ("" if self.direct else "; buffered: no O_DIRECT"))
            self.files.setdefault("raw", file_stat(f))
            if not self.direct:
                C.evict(f)
            t0 = time.perf_counter()
            out, io_s = C.raw_read(self.st.tensors, f, block=self.raw_block, direct=self.direct)
            self.add(LOAD_ROWS[0], time.perf_counter() - t0, note=f"read calls {io_s:.3f} s")
            if self.verify_now:
                self.check(LOAD_ROWS[0], self.st.tree_ok(out))
            del out
        except Exception as e:  # noqa: BLE001 - a failure is a table entry
            self.fail((SAVE_ROWS[0], LOAD_ROWS[0]), e)
        finally:
            f.unlink(missing_ok=True)

    def case_torch(self, d: Path) -> None:
        f = d / "ckpt.pt"
        try:
            t0 = time.perf_counter()
            with open(f, "wb") as fh:
                torch.save(self.st.torch_obj(), fh)
                fh.flush()
                os.fsync(fh.fileno())
            C.fsync_path(d)
            self.add(SAVE_ROWS[1], time.perf_counter() - t0, f.stat().st_size)
            self.files.setdefault("torch.save", file_stat(f))
            C.evict(f)
            t0 = time.perf_counter()
            sd = torch.load(f, weights_only=True, map_location="cpu")
            self.add(LOAD_ROWS[1], time.perf_counter() - t0)
            if self.verify_now:
                self.check(LOAD_ROWS[1], self.st.tree_ok(sd))
            del sd
        except Exception as e:  # noqa: BLE001
            self.fail((SAVE_ROWS[1], LOAD_ROWS[1]), e)
        finally:
            f.unlink(missing_ok=True)

    def case_ckptstore(self, d: Path) -> None:
        from bench_save import _close, _result_note   # one SaveResult formatter for every benchmark
        root = d / "store"
        try:
            from ckptstore import Store
            store = Store(str(root))
            try:
                t0 = time.perf_counter()
                res = store.save(self.st.store_state, STEP)
                secs = time.perf_counter() - t0
            finally:
                _close(store)
            files = count_files(root, STEP)
            self.files["ckptstore"] = files
            self.add(SAVE_ROWS[2], secs, files["total"]["bytes"],
                     f"{_result_note(res)}; {files['total']['files']} files",
                     files=files, phases=getattr(res, "phases", None))
        except Exception as e:  # noqa: BLE001
            self.fail((SAVE_ROWS[2], LOAD_ROWS[2]), e)
            return
        try:
            C.evict(root)
            t0 = time.perf_counter()
            store = Store(str(root))                  # cold: a fresh Store, as in a new process
            t_open = time.perf_counter() - t0
            try:
                out = store.load(STEP, map_location="cpu")
                secs = time.perf_counter() - t0
            finally:
                _close(store)
            self.add(LOAD_ROWS[2], secs, note=f"incl. Store() {t_open * 1e3:.0f} ms", store_open=t_open)
            if self.verify_now:
                self.check(LOAD_ROWS[2], self.st.tree_ok(out))
            del out
        except Exception as e:  # noqa: BLE001
            self.fail((LOAD_ROWS[2],), e)

    def run_local(self) -> None:
        d = C.fresh_dir(self.run_dir, "local-")
        try:
            for name, case in (("raw", self.case_raw), ("torch", self.case_torch),
                               ("ckptstore", self.case_ckptstore)):
                t0 = time.perf_counter()
                case(d)
                gc.collect()
                print(f"    {name:<10} {time.perf_counter() - t0:7.2f} s", file=sys.stderr, flush=True)
        finally:
            C.rmtree(d)

    # -- remote
    def start_server(self) -> None:
        from backends.launcher import S3Server
        self.server = S3Server(workdir=self.run_dir / "moto").start()   # 127.0.0.1, free port
        self.opts = self.server.storage_options()
        self.moto_tmp_fs = C.fs_type(self.server.workdir / "tmp")
        # the baseline object: the torch.save file of the same state, written once (not timed)
        self.torch_file = self.run_dir / "ckpt.pt"
        with open(self.torch_file, "wb") as fh:
            torch.save(self.st.torch_obj(), fh)
            fh.flush()
            os.fsync(fh.fileno())

    def stop_server(self) -> None:
        if self.server is not None:
            self.server.stop()

    def _log_offset(self) -> int:
        try:
            return self.server.log_path.stat().st_size
        except (OSError, AttributeError):
            return 0

    def requests_since(self, offset: int, bucket: str) -> dict[str, int]:
        """Requests moto logged for ``bucket`` since ``offset``, by method (+ status >= 400 as 'METHOD 404').
        werkzeug logs a request after answering it: wait until the count is stable (not timed)."""
        pat = re.compile(r'"(GET|PUT|POST|HEAD|DELETE) /' + re.escape(bucket) + r'[/? ][^"]*" (\d{3})')
        last, stable_since = None, time.perf_counter()
        deadline = time.perf_counter() + 3.0
        while True:
            try:
                with open(self.server.log_path, "rb") as f:
                    f.seek(offset)
                    text = f.read().decode("utf-8", "replace")
            except (OSError, AttributeError):
                self.requests_ok = False
                return {}
            ops: Counter[str] = Counter()
            for m in pat.finditer(text):
                ops[m.group(1)] += 1
                if int(m.group(2)) >= 400:
                    ops[f"{m.group(1)} {m.group(2)}"] += 1
            total = sum(v for k, v in ops.items() if " " not in k)
            now = time.perf_counter()
            if total != last:
                last, stable_since = total, now
            elif now - stable_since >= 0.3 or now > deadline:
                return {"total": total, **dict(sorted(ops.items()))}
            time.sleep(0.1)

    def list_remote(self, bucket: str, prefix: str) -> dict[str, Any]:
        """Objects under ``prefix/`` by first path component (objects, packs, steps, ...)."""
        c = self.server.client()
        areas: Counter[str] = Counter()
        n = size = 0
        for page in c.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix + "/"):
            for o in page.get("Contents", []):
                n += 1
                size += o["Size"]
                areas[o["Key"][len(prefix) + 1:].split("/", 1)[0]] += 1
        return {"objects": n, "bytes": size, "by_area": dict(sorted(areas.items()))}

    def _cpu(self) -> tuple[float, float]:
        from bench_upload import proc_cpu, self_cpu
        return proc_cpu(self.server.pids()), self_cpu()

    def _cpu_note(self, c0: tuple[float, float]) -> dict[str, float]:
        c1 = self._cpu()
        return {"moto_cpu": c1[0] - c0[0], "client_cpu": c1[1] - c0[1]}

    def remote_ckptstore(self) -> None:
        from bench_save import _close
        from ckptstore import Store
        url = self.server.new_bucket_url("packs")
        bucket, prefix = url.split("://", 1)[1], "ckpt"
        remote = f"{url}/{prefix}"
        local = C.fresh_dir(self.run_dir, "up-")
        empty = C.fresh_dir(self.run_dir, "resume-")
        try:
            try:
                store = Store(str(local), remote=remote, storage_options=self.opts)
                try:
                    store.wait_for_uploads()              # uploader up, remote listed (not timed)
                    off, c0 = self._log_offset(), self._cpu()
                    t0 = time.perf_counter()
                    res = store.save(self.st.store_state, STEP)
                    t1 = time.perf_counter()
                    store.wait_for_uploads()
                    t2 = time.perf_counter()
                    cpu = self._cpu_note(c0)
                finally:
                    _close(store)
                reqs = self.requests_since(off, bucket)
                listing = self.list_remote(bucket, prefix)
                self.add(UP_ROWS[1], t2 - t1, listing["bytes"],
                         f"local save {t1 - t0:.2f} s (not counted); {listing['objects']} objects, "
                         f"{reqs.get('total', '?')} requests",
                         local_save=t1 - t0, save_plus_upload=t2 - t0, requests=reqs, remote=listing,
                         bytes_written=getattr(res, "bytes_written", None), **cpu)
            except Exception as e:  # noqa: BLE001
                self.fail((UP_ROWS[1], DOWN_ROWS[2]), e)
                return
            try:
                import s3fs
                s3fs.S3FileSystem.clear_instance_cache()     # no fs (listing cache, connections) from the upload
                # a fresh client, connected but not timed, as the boto3 rows' client is (s3fs builds its
                # aiobotocore client at the first request: 0.1-0.25 s here, reported as "client set-up")
                t_client = time.perf_counter()
                fs = s3fs.S3FileSystem(**self.opts)
                fs.call_s3("head_bucket", Bucket=bucket)
                t_client = time.perf_counter() - t_client
                like = self.st.resume_like()
                with (C.perturbed(C.state_tensors(self.st.model, self.st.opt)) if self.st.kind != "small"
                      else contextlib.nullcontext()):
                    off, c0 = self._log_offset(), self._cpu()
                    t0 = time.perf_counter()
                    store = Store(str(empty), remote=remote, storage_options=self.opts)
                    try:
                        step = store.resume(like)
                        t1 = time.perf_counter()
                        cpu = self._cpu_note(c0)
                        tier = (getattr(store, "resumed_from", None) or {}).get("tier")
                    finally:
                        _close(store)
                    ok = step == STEP and (not self.verify_now or self.st.resumed_ok(like))
                reqs = self.requests_since(off, bucket)
                pulled = count_files(empty, STEP)["total"]
                self.add(DOWN_ROWS[2], t1 - t0, pulled["bytes"],
                         f"{reqs.get('total', '?')} requests; pulled {pulled['files']} files; tier {tier}; "
                         f"client set-up {t_client:.2f} s (not counted)",
                         requests=reqs, pulled=pulled, step=step, client_setup=t_client,
                         reused_client=store.remote_storage.fs is fs, **cpu)
                if not ok:
                    self.check(DOWN_ROWS[2], False)
                del like
            except Exception as e:  # noqa: BLE001
                self.fail((DOWN_ROWS[2],), e)
        finally:
            self.server.cleanup(url)
            C.rmtree(local)
            C.rmtree(empty)

    def remote_boto3(self) -> None:
        import boto3
        from boto3.s3.transfer import TransferConfig
        from botocore.config import Config
        a = self.args
        url = self.server.new_bucket_url("packs-boto")
        bucket, key = url.split("://", 1)[1], "ckpt.pt"
        dl = self.run_dir / "download.pt"
        s = self.server
        client = boto3.client("s3", endpoint_url=s.endpoint, aws_access_key_id=s.key,
                              aws_secret_access_key=s.secret, region_name=s.region,
                              config=Config(s3={"addressing_style": "path"},
                                            max_pool_connections=max(10, a.boto_concurrency)))
        cfg = TransferConfig(max_concurrency=a.boto_concurrency, multipart_chunksize=a.boto_chunk_mb * MiB)
        try:
            client.head_bucket(Bucket=bucket)             # connect (not timed)
            C.evict(self.torch_file)
            off, c0 = self._log_offset(), self._cpu()
            t0 = time.perf_counter()
            client.upload_file(str(self.torch_file), bucket, key, Config=cfg)
            secs = time.perf_counter() - t0
            cpu = self._cpu_note(c0)
            reqs = self.requests_since(off, bucket)
            size = self.torch_file.stat().st_size
            self.add(UP_ROWS[0], secs, size, f"{reqs.get('total', '?')} requests; TransferConfig("
                     f"max_concurrency={a.boto_concurrency}, multipart_chunksize={a.boto_chunk_mb} MiB)",
                     requests=reqs, **cpu)
            off, c0 = self._log_offset(), self._cpu()
            t0 = time.perf_counter()
            client.download_file(bucket, key, str(dl), Config=cfg)
            t1 = time.perf_counter()
            cpu = self._cpu_note(c0)
            t2 = time.perf_counter()
            sd = torch.load(dl, weights_only=True, map_location="cpu")
            t_load = time.perf_counter() - t2
            reqs = self.requests_since(off, bucket)
            self.add(DOWN_ROWS[0], t1 - t0, dl.stat().st_size, f"{reqs.get('total', '?')} requests; no fsync",
                     requests=reqs, **cpu)
            self.add(DOWN_ROWS[1], t1 - t0 + t_load, note=f"download, then torch.load {t_load:.3f} s "
                     "(from the page cache)", torch_load=t_load)
            if self.verify_now:
                self.check(DOWN_ROWS[1], self.st.tree_ok(sd))
            del sd
        except Exception as e:  # noqa: BLE001
            self.fail((UP_ROWS[0], *DOWN_ROWS[:2]), e)
        finally:
            dl.unlink(missing_ok=True)
            self.server.cleanup(url)
            client.close()

    def run_remote(self) -> None:
        for name, fn in (("ckptstore", self.remote_ckptstore), ("boto3", self.remote_boto3)):
            t0 = time.perf_counter()
            fn()
            gc.collect()
            print(f"    remote {name:<10} {time.perf_counter() - t0:7.2f} s", file=sys.stderr, flush=True)

    def run(self) -> None:
        a = self.args
        if a.remote:
            self.start_server()
            print(f"moto at {self.server.endpoint} (TMPDIR on {self.moto_tmp_fs})", file=sys.stderr)
        for r in range(a.repeat):          # round-robin: drift on a shared machine hits every method alike
            self.verify_now = a.verify and r == 0
            print(f"  repeat {r + 1}/{a.repeat}", file=sys.stderr, flush=True)
            self.run_local()
            if a.remote and r < a.remote_repeat:
                self.run_remote()

    def close(self) -> None:
        try:
            self.stop_server()
        finally:
            C.rmtree(self.run_dir)


# --------------------------------------------------------------------------- report


def _med(xs: list[float] | None) -> float | None:
    return statistics.median(xs) if xs else None


def rows_local(b: Bench) -> list[C.Row]:
    out = []
    for name in SAVE_ROWS + LOAD_ROWS:
        if name in b.samples or name in b.notes:
            out.append(C.Row(name, "save" if name in SAVE_ROWS else "load", b.samples.get(name, []),
                             b.disk.get(name, []), [], b.notes.get(name, "")))
    return out


def render_files(b: Bench) -> str:
    head = f"{'method':<12} {'area':<16} {'files':>6} {'dirs':>5} {'bytes':>12} {'allocated':>12}"
    lines = [head, "-" * len(head)]
    ck = b.files.get("ckptstore")
    if ck:
        for area, rec in ck.items():
            lines.append(f"{'ckptstore':<12} {area:<16} {rec['files']:6d} {rec['dirs']:5d} "
                         f"{C.fmt_bytes(rec['bytes']):>12} {C.fmt_bytes(rec['allocated']):>12}")
    for name in ("torch.save", "raw"):
        rec = b.files.get(name)
        if rec:
            lines.append(f"{name:<12} {'(one file)':<16} {rec['files']:6d} {rec['dirs']:5d} "
                         f"{C.fmt_bytes(rec['bytes']):>12} {C.fmt_bytes(rec['allocated']):>12}")
    return "\n".join(lines)


def render_remote(b: Bench) -> str:
    head = (f"{'row':<36} {'median s':>8} {'min-max s':>13} {'MiB/s':>7} {'x boto3':>7} {'requests':>8} "
            f"{'moto cpu':>8}  note")
    lines = [head, "-" * len(head)]
    for names, ref in ((UP_ROWS, UP_ROWS[0]), (DOWN_ROWS, DOWN_ROWS[0])):
        ref_med = _med(b.samples.get(ref))
        for name in names:
            secs = b.samples.get(name, [])
            med = _med(secs)
            ex = b.extra.get(name, [])
            reqs = [e["requests"].get("total") for e in ex if e.get("requests")]
            moto = [e["moto_cpu"] for e in ex if "moto_cpu" in e]
            if med is None:
                lines.append(f"{name:<36} {'n/a':>8} {'':>13} {'':>7} {'':>7} {'':>8} {'':>8}  "
                             f"{b.notes.get(name, '')}")
                continue
            ratio = f"{med / ref_med:.2f}" if ref_med else "n/a"
            note = b.notes.get(name, "")
            saves = [e["local_save"] for e in ex if "local_save" in e]
            if saves:                                 # the note is the last run's: give the median local save
                note = re.sub(r"^local save [0-9.]+ s", f"local save {_med(saves):.2f} s (median)", note)
            lines.append(f"{name:<36} {med:8.3f} {min(secs):6.3f}-{max(secs):<6.3f} "
                         f"{b.st.nbytes / MiB / med:7.1f} {ratio:>7} "
                         f"{(str(int(_med(reqs))) if reqs and None not in reqs else ''):>8} "
                         f"{(f'{_med(moto):.1f}' if moto else ''):>8}  {note}")
    return "\n".join(lines)


def to_json(b: Bench, ck: str, t_all: float) -> dict[str, Any]:
    rows = []
    for name in SAVE_ROWS + LOAD_ROWS + UP_ROWS + DOWN_ROWS:
        if name not in b.samples and name not in b.notes:
            continue
        secs = b.samples.get(name, [])
        med = _med(secs)
        if name in REFS:
            t_ref, raw_ref = REFS[name]
            ratios = {"x_torch": _ratio(med, b.samples.get(t_ref)), "x_raw": _ratio(med, b.samples.get(raw_ref))}
        else:
            ratios = {"x_boto3": _ratio(med, b.samples.get(UP_ROWS[0] if name in UP_ROWS else DOWN_ROWS[0]))}
        rows.append(dict(name=name, seconds=secs, median=med, min=min(secs) if secs else None,
                         max=max(secs) if secs else None, disk=b.disk.get(name, []), note=b.notes.get(name, ""),
                         details=b.extra.get(name, []), **ratios))
    st = b.st
    return dict(
        args=vars(b.args), ckptstore=ck, torch=torch.__version__, python=platform.python_version(),
        cpus=os.cpu_count(), platform=platform.platform(), dir=str(b.base), fs=C.fs_type(b.base),
        o_direct=b.direct, state=dict(kind=st.kind, desc=st.desc, bytes=st.nbytes, n_tensors=st.n_tensors,
                                      min_tensor=st.sizes[0], max_tensor=st.sizes[-1],
                                      median_tensor=st.sizes[len(st.sizes) // 2]),
        files=b.files, rows=rows, requests_counted=b.requests_ok, total_seconds=t_all)


def _ratio(med: float | None, ref: list[float] | None) -> float | None:
    r = _med(ref)
    return med / r if med is not None and r else None


# --------------------------------------------------------------------------- main


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--state", choices=("small", "gpt1gb", "gpt3gb"), default="small")
    ap.add_argument("--repeat", type=int, default=3, help="runs per method (table: median, min-max)")
    ap.add_argument("--remote", action="store_true", help="also measure upload / remote resume against moto S3")
    ap.add_argument("--remote-repeat", type=int, default=None,
                    help="run the remote part in the first N repeats only (default: every repeat)")
    ap.add_argument("--json", metavar="PATH", help="also write every sample and setting as JSON")
    ap.add_argument("--dir", default=str(C.default_bench_dir()),
                    help="scratch parent folder (the disk you checkpoint to; not tmpfs)")
    ap.add_argument("--n-tensors", type=int, default=4000, help="small state: number of tensors")
    ap.add_argument("--min-bytes", type=int, default=64, help="small state: smallest tensor")
    ap.add_argument("--max-bytes", type=int, default=16384, help="small state: largest tensor")
    ap.add_argument("--per-layer", type=int, default=8, help="small state: tensors per 'layer{i}'")
    ap.add_argument("--raw-block-mib", type=int, default=64,
                    help="raw rows: O_DIRECT staging buffer, MiB (capped at the state size)")
    ap.add_argument("--boto-concurrency", type=int, default=8, help="boto3 TransferConfig max_concurrency")
    ap.add_argument("--boto-chunk-mb", type=int, default=64, help="boto3 TransferConfig multipart_chunksize")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-verify", dest="verify", action="store_false",
                    help="skip the CRC check of every load (done on the first repeat, not timed)")
    args = ap.parse_args(argv)
    if args.remote_repeat is None:
        args.remote_repeat = args.repeat
    if args.repeat < 1:
        ap.error("--repeat must be >= 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    base = Path(args.dir).resolve()
    base.mkdir(parents=True, exist_ok=True)
    fs = C.fs_type(base)
    if fs in ("tmpfs", "ramfs"):
        print(f"warning: --dir {base} is on {fs}: this measures RAM, not the disk", file=sys.stderr)
    try:
        import ckptstore
        where = ckptstore.__file__ or "?"
        ck = f"ckptstore {getattr(ckptstore, '__version__', '?')} ({where})"
        if not Path(where).resolve().is_relative_to(REPO):
            print(f"WARNING: ckptstore imported from {where}, not from {REPO}", file=sys.stderr)
    except Exception as e:  # noqa: BLE001
        ck = "ckptstore n/a: " + C.fmt_note(e)
    st = State(args)
    print(f"torch {torch.__version__}, python {platform.python_version()}, {os.cpu_count()} cpus; {ck}")
    print(f"state: {args.state}: {st.desc}; {C.gb(st.nbytes)} ({st.nbytes / MiB:.1f} MiB) in {st.n_tensors} "
          f"tensors (median {st.sizes[len(st.sizes) // 2]} B, {st.sizes[0]}-{st.sizes[-1]} B), built in "
          f"{st.build_s:.1f} s")
    b = Bench(args, st)
    print(f"dir: {b.run_dir} ({fs}), O_DIRECT {'yes' if b.direct else 'NO (buffered + fsync)'}; "
          f"repeat={args.repeat}, remote={'%d repeat(s)' % args.remote_repeat if args.remote else 'off'}, "
          f"verify={'first run' if args.verify else 'off'}", flush=True)
    t_all = time.perf_counter()
    try:
        b.run()
    finally:
        b.close()
    t_all = time.perf_counter() - t_all
    sys.stderr.flush()
    print()
    print(C.render_table(rows_local(b), st.nbytes, REFS, show_peak=False))
    print(f"\nGB/s = {C.gb(st.nbytes)} of tensor bytes / median s; x torch / x raw = median / median of "
          "torch.save+fsync (torch.load cold) and raw write (raw read) (>1 = slower). Cold = evicted from the "
          "page cache (posix_fadvise; dentries/inodes stay cached). ckptstore load includes Store().")
    print("\nFiles left by one save (fresh store):")
    print(render_files(b))
    if args.remote:
        print(f"\nRemote: moto S3 on 127.0.0.1, median of {min(args.repeat, args.remote_repeat)}; MiB/s = state "
              "bytes / median s; x boto3 = median / boto3 row above it; requests = moto's log for the bucket; "
              "moto cpu = s of CPU of the moto process.")
        print(render_remote(b))
        ex = b.extra.get(UP_ROWS[1])
        if ex and ex[0].get("remote"):
            r = ex[0]["remote"]
            print(f"remote objects of one step: {r['objects']} ({C.fmt_bytes(r['bytes'])}) by area "
                  f"{r['by_area']}; requests {ex[0]['requests']}")
        ex = b.extra.get(DOWN_ROWS[2])
        if ex and ex[0].get("requests"):
            print(f"resume requests: {ex[0]['requests']}")
    print(f"\ntotal {t_all:.0f} s")
    if args.json:
        Path(args.json).write_text(json.dumps(to_json(b, ck, t_all), indent=1, default=str))
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
