"""Object-store storage over fsspec (S3 via s3fs, GCS via gcsfs, ``memory://``, ``file://``, ...).

One PUT is atomic on object stores, so ``write_atomic`` is a plain ``pipe_file``. ``write_new`` asks the
backend for a create-only write (``mode="create"``: S3 ``If-None-Match: *``, GCS ``ifGenerationMatch=0`` on
one-shot uploads); where the backend cannot, it falls back to check-then-write, which is racy between two
writers but harmless for content-addressed blobs (both write the same bytes).

The caller's random generators (issue 26, README "Randomness"): the client libraries draw from Python's global
``random``, at import (s3fs -> httpx -> rich: ``rich/style.py`` takes ``getrandbits(24)``) and in their retry
jitter, which would run in the I/O threads at moments set by the network. So botocore's own retries are turned
off (``retries={"total_max_attempts": 1}``: the store's :class:`~ckptstore.util.retry.RetryPolicy` retries, with a
generator of its own; s3fs's own retries wait fixed times), the remaining libraries' module-level jitter is
given a private generator (:data:`PRIVATE_JITTER`), and the first import of a backend runs under
:func:`_backend_imported`, which puts ``random``'s state back afterwards. Known remainder: gcsfs's batch delete
(``GCSFileSystem._rm_files``, real GCS only) imports ``random`` inside the function and jitters a retry of the
objects a batch failed to delete with it.
"""
from __future__ import annotations

import functools
import importlib
import logging
import posixpath
import random
import threading
from typing import List, Optional

import fsspec

from ..util.redact import redact, register_secrets, split_userinfo
from .base import Buffer, BytesReads, Storage
from .retrying import CALLS


def _redact(url: str) -> str:
    # never let credentials embedded in a URL reach logs or error messages (see ckptstore.util.redact)
    return redact(url)


def _is_precondition_failure(e: BaseException) -> bool:
    if isinstance(e, FileExistsError) or getattr(e, "code", None) == 412 or getattr(e, "status", None) == 412:
        return True
    text = f"{type(e).__name__} {e}".lower().replace("-", "")
    return "412" in text or "precondition" in text or "conditionnotmet" in text


LANDED_MAX = 1 << 20      # bytes: conditional writes read back after a failed precondition (metadata, not data)
log = logging.getLogger("ckptstore")

#: per fsspec protocol, the client-library modules whose jitter draws from the module-level ``random`` they
#: imported: each gets a private ``random.Random()`` instead (same methods, not the caller's generator).
#: aiohttp.connector: ``random.shuffle`` of the hosts waiting for a pooled connection; botocore.utils: the
#: jitter of an instance-metadata credential refresh; gcsfs.retry: every retried request;
#: google.auth._exponential_backoff: retried credential requests.
PRIVATE_JITTER = {
    "s3": ("aiohttp.connector", "botocore.utils"),
    "gs": ("aiohttp.connector", "gcsfs.retry", "google.auth._exponential_backoff"),
}
PRIVATE_JITTER.update(s3a=PRIVATE_JITTER["s3"], gcs=PRIVATE_JITTER["gs"])
_loaded: set = set()
#: protocols whose client is set up lazily by the first request (see _first_request_alone)
_SESSION_RACES = ("s3", "s3a", "gs", "gcs")
FIRST_CALL_WAIT = 2.0       # seconds a call waits for a storage's first call to answer (see _first_request_alone)
_loading = threading.Lock()


def _backend_imported(protocol: str) -> None:
    """Import the fsspec backend of ``protocol`` and its client libraries, once per process, giving their
    jitter a private generator (:data:`PRIVATE_JITTER`), with Python's ``random`` state put back afterwards
    (import-time draws, e.g. rich's). The only place ckptstore saves and restores a global generator for
    another library's sake: an import happens once, in the thread that opens the store (issue 26)."""
    with _loading:
        if protocol in _loaded:
            return
        state = random.getstate()
        try:
            try:
                fsspec.get_filesystem_class(protocol)
            except (ImportError, ValueError):
                return                                # url_to_fs says what is missing
            for name in PRIVATE_JITTER.get(protocol, ()):
                try:
                    module = importlib.import_module(name)
                except ImportError:
                    continue
                if getattr(module, "random", None) is random:
                    module.random = random.Random()
            _loaded.add(protocol)
        finally:
            random.setstate(state)


def _without_client_retries(options: dict) -> dict:
    """s3fs options with botocore's own retries off: its backoff draws from Python's global ``random``
    (``botocore/retries/standard.py``, ``ExponentialBackoff(random=random.random)``; legacy mode's
    ``delay_exponential`` likewise), in the I/O threads. The store's RetryPolicy retries instead."""
    config = dict(options.get("config_kwargs") or {})
    asked = dict(config.get("retries") or {})
    if max(asked.get("total_max_attempts", 1), asked.get("max_attempts", 0) + 1) > 1:
        log.info("botocore retries %s replaced by the store's RetryPolicy (botocore's backoff draws from "
                 "Python's global random)", asked)
    asked.pop("max_attempts", None)
    config["retries"] = dict(asked, total_max_attempts=1)
    return dict(options, config_kwargs=config)


class FsspecStorage(BytesReads, Storage):
    """Ranged reads and reads into a buffer: one GET each, its body copied into the buffer (:class:`BytesReads`)."""
    coalesce_gap = 4 << 20              # one request costs ~ms; 4 MiB at ~100-400 MB/s costs about as much
    def __init__(self, url: str, storage_options: Optional[dict] = None):
        options = dict(storage_options or {})
        register_secrets(options)
        bare, userinfo = split_userinfo(url)
        if userinfo is not None:
            register_secrets(None, userinfo)
            if bare.split("://", 1)[0] in ("s3", "s3a"):
                # s3fs does not read credentials from a URL: it would take "KEY:SECRET@bucket" for the bucket
                # name and print it in every error. Use them as the credentials they are, and drop them from
                # the URL so that no path built from it can carry them.
                user, _, password = userinfo.partition(":")
                options.setdefault("key", user)
                if password:
                    options.setdefault("secret", password)
                url = bare
        self.url = _redact(url)
        protocol = fsspec.core.split_protocol(url)[0] or "file"
        _backend_imported(protocol)
        if protocol in ("s3", "s3a"):
            options = _without_client_retries(options)
        try:
            self.fs, root = fsspec.core.url_to_fs(url, **options)
        except Exception as e:                      # the library's message may quote the URL or the options
            raise ValueError(f"cannot open {self.url}: {type(e).__name__}: {redact(e)}") from None
        self.root = root.rstrip("/")
        self._create_ok = True
        self._connected = protocol not in _SESSION_RACES

    def _p(self, path: str) -> str:
        if path.startswith("/") or ".." in path.split("/"):
            raise ValueError(f"refusing path outside the store root: {path!r}")
        return posixpath.join(self.root, path) if path else self.root

    def read_bytes(self, path: str, limit: Optional[int] = None) -> bytes:
        """Without ``limit``: s3fs looks the size up (HEAD) and fetches a large object in parallel ranges.
        With ``limit``: one GET with ``Range: bytes=0-(limit-1)``; an empty object (which object stores answer
        416 for any range) is told apart by its size."""
        if limit is None:
            return self.fs.cat_file(self._p(path))
        if limit <= 0:
            return b""
        try:
            return self.fs.cat_file(self._p(path), start=0, end=limit)
        except FileNotFoundError:
            raise
        except Exception as e:                  # s3fs: OSError; gcsfs: its HttpError (not an OSError)
            if self._unsatisfiable(e) and self.size(path) == 0:
                return b""
            raise

    @staticmethod
    def _unsatisfiable(e: BaseException) -> bool:
        if getattr(e, "code", None) == 416 or getattr(e, "status", None) == 416:
            return True
        text = f"{type(e).__name__} {e}".lower()
        return "416" in text.replace(",", " ").split() or "invalidrange" in text or "not satisfiable" in text

    def read_range_bytes(self, path: str, offset: int, length: int) -> bytes:
        """One ranged GET (``Range: bytes=offset-(offset+length-1)``)."""
        return self.fs.cat_file(self._p(path), start=offset, end=offset + length) if length > 0 else b""

    def size(self, path: str) -> Optional[int]:
        """One metadata request: S3 HeadObject / GCS object GET (``fs.info`` would also LIST the key as a
        "directory" when it is missing, doubling the cost of every miss)."""
        full = self._p(path)
        try:
            if self._protocol in ("s3", "s3a"):
                bucket, key, _ = self.fs.split_path(full)
                return int(self.fs.call_s3("head_object", Bucket=bucket, Key=key)["ContentLength"])
            if self._protocol in ("gs", "gcs"):
                bucket, key, _ = self.fs.split_path(full)
                return int(self.fs.call("GET", "b/{}/o/{}", bucket, key, json_out=True)["size"])
            return int(self.fs.info(full)["size"])
        except FileNotFoundError:
            return None

    def mtime(self, path: str) -> Optional[float]:
        try:
            info = self.fs.info(self._p(path))
        except FileNotFoundError:
            return None
        m = info.get("LastModified") or info.get("updated") or info.get("mtime") or info.get("created")
        if m is None:
            return None
        if hasattr(m, "timestamp"):
            return m.timestamp()
        if isinstance(m, (int, float)):
            return float(m)
        try:
            from datetime import datetime
            return datetime.fromisoformat(str(m).replace("Z", "+00:00")).timestamp()
        except ValueError:
            return None

    def write_atomic(self, path: str, data: Buffer) -> None:
        self.fs.pipe_file(self._p(path), bytes(data))

    def write_new(self, path: str, data: Buffer) -> bool:
        full = self._p(path)
        if self._create_ok:
            try:
                self.fs.pipe_file(full, bytes(data), mode="create")
                return True
            except FileExistsError:
                return self._landed(full, data)
            except (TypeError, NotImplementedError, ValueError):
                self._create_ok = False          # backend without create-only writes
        if self.fs.exists(full):
            return False
        self.fs.pipe_file(full, bytes(data))
        return True

    # -- conditional writes: S3 ETag / If-Match, GCS generation / ifGenerationMatch --------------------------
    @property
    def _protocol(self) -> str:
        p = self.fs.protocol
        return p[0] if isinstance(p, (tuple, list)) else p

    @property
    def conditional_writes(self) -> bool:
        return self._protocol in ("s3", "s3a", "gs", "gcs")

    def read_versioned(self, path: str):
        if not self.conditional_writes:
            return super().read_versioned(path)
        full = self._p(path)
        if self._protocol in ("s3", "s3a"):
            return self._s3_get_versioned(full)
        try:
            info = self.fs.info(full)          # token first: if the object changes before the read, the
            data = self.fs.cat_file(full)      # conditional write with this (older) token fails, as it must
        except FileNotFoundError:
            return None, None
        if self._protocol in ("s3", "s3a"):
            return data, info.get("ETag") or info.get("etag")
        return data, info.get("generation")

    def _s3_get_versioned(self, full: str):
        """One GET: the object's bytes and the ETag of exactly those bytes (issue 19: ``fs.info`` + ``cat_file``
        cost a HEAD and a GET, and ``info`` of a missing key LISTs it as a "directory" too: three requests for
        every lease, pointer and in-flight marker read, one per save and uploader)."""
        from fsspec.asyn import sync
        bucket, key, _ = self.fs.split_path(full)

        async def get():
            resp = await self.fs._call_s3("get_object", Bucket=bucket, Key=key)
            try:
                return await resp["Body"].read(), resp.get("ETag")
            finally:
                resp["Body"].close()
        try:
            return sync(self.fs.loop, get)
        except FileNotFoundError:
            return None, None

    def write_if_match(self, path: str, data: Buffer, token) -> bool:
        if token is None:
            return self.write_new(path, data)
        full = self._p(path)
        try:
            if self._protocol in ("s3", "s3a"):
                self.fs.pipe_file(full, bytes(data), IfMatch=token)
            elif self._protocol in ("gs", "gcs"):
                self._gcs_upload_if_generation(full, bytes(data), token)
            else:                                      # no conditional writes: check, then write (racy)
                return super().write_if_match(path, data, token)
            return True
        except Exception as e:                        # precondition failures surface as several types
            if _is_precondition_failure(e):
                self.fs.invalidate_cache(full)
                return self._landed(full, data)
            raise

    def _landed(self, full: str, data: Buffer) -> bool:
        """After a failed precondition of a small conditional write: whether the object now holds exactly
        ``data``. The client library retries a request whose answer was lost (a reset after the server applied
        it); the retry then fails its own precondition against the write that landed. Recognising the bytes
        makes the write idempotent (issue 17: one lost answer to a lease renewal lost the writer lease, and every
        later upload failed). Lease and marker bodies carry a unique token and time, so equal bytes are ours;
        for a pointer or a blob, equal bytes are the outcome asked for. Objects over ``LANDED_MAX`` bytes are
        not read back (False, as before)."""
        if len(data) > LANDED_MAX:
            return False
        try:
            return self.fs.cat_file(full) == bytes(data)
        except Exception:                             # cannot tell: the caller's usual path (not ours)
            return False

    def _gcs_upload_if_generation(self, full: str, data: bytes, generation) -> None:
        """One-shot multipart upload with ``ifGenerationMatch`` (the request gcsfs's own one-shot uploads use;
        fake-gcs-server 1.54 enforces the precondition on it but silently ignores it on ``uploadType=media``).
        A failed precondition raises (HTTP 412)."""
        import json
        bucket, key, _ = self.fs.split_path(full)
        boundary = "ckptstore-boundary"
        body = (f"--{boundary}\r\nContent-Type: application/json; charset=UTF-8\r\n\r\n"
                f"{json.dumps({'name': key})}\r\n--{boundary}\r\n"
                f"Content-Type: application/octet-stream\r\n\r\n").encode() + data + f"\r\n--{boundary}--".encode()
        self.fs.call("POST", f"{self.fs._location}/upload/storage/v1/b/{bucket}/o", uploadType="multipart",
                     ifGenerationMatch=str(generation), data=body,
                     headers={"Content-Type": f'multipart/related; boundary="{boundary}"'})
        self.fs.invalidate_cache(full)

    def put_file(self, path: str, local_file: str) -> None:
        self.fs.put_file(local_file, self._p(path))

    def listdir(self, path: str) -> List[str]:
        """S3: one ListObjectsV2 (a page per 1,000 names; s3fs's ``ls`` lists the parent too when a prefix is
        empty, two requests for every empty directory); other backends: ``fs.ls``."""
        try:
            if self._protocol in ("s3", "s3a"):
                return self._s3_names(path)
            entries = self.fs.ls(self._p(path), detail=False, refresh=True)
        except (FileNotFoundError, NotADirectoryError):
            return []
        base = self._p(path).rstrip("/")
        names = []
        for e in entries:
            e = e.rstrip("/")
            names.append(e[len(base) + 1:] if e.startswith(base + "/") else posixpath.basename(e))
        return sorted(n for n in names if n and "/" not in n)

    def listdir_after(self, path: str, after: str) -> List[str]:
        """S3: one ListObjectsV2 from ``StartAfter`` (a page per 1,000 names after ``after``, none for those
        before it: resume and the uploader's start find the steps newer than the latest pointer's in one
        request however many steps the store holds); other backends: :meth:`listdir`, filtered."""
        if self._protocol not in ("s3", "s3a"):
            return super().listdir_after(path, after)
        return [n for n in self._s3_names(path, after) if n > after]

    def _s3_names(self, path: str, after: Optional[str] = None) -> List[str]:
        """The names directly under ``path`` (objects and common prefixes), sorted, by ListObjectsV2 pages; with
        ``after``, from ``StartAfter=<after>~`` on."""
        bucket, key, _ = self.fs.split_path(self._p(path))
        prefix = key.rstrip("/") + "/" if key else ""
        names, kw = [], dict(Bucket=bucket, Prefix=prefix, Delimiter="/")
        if after is not None:
            kw["StartAfter"] = f"{prefix}{after}~"
        while True:
            resp = self.fs.call_s3("list_objects_v2", **kw)
            names += [c["Prefix"][len(prefix):].rstrip("/") for c in resp.get("CommonPrefixes", [])]
            names += [o["Key"][len(prefix):] for o in resp.get("Contents", [])]
            if not resp.get("IsTruncated"):
                break
            kw["ContinuationToken"] = resp["NextContinuationToken"]
            kw.pop("StartAfter", None)
        return sorted(n for n in names if n and "/" not in n)

    def list_sizes(self, path: str) -> Optional[dict]:
        """S3: ListObjectsV2 of the prefix (a page per 1,000 objects), names with their sizes."""
        if self._protocol not in ("s3", "s3a"):
            return None
        bucket, key, _ = self.fs.split_path(self._p(path))
        prefix = key.rstrip("/") + "/" if key else ""
        out, kw = {}, dict(Bucket=bucket, Prefix=prefix, Delimiter="/")
        while True:
            resp = self.fs.call_s3("list_objects_v2", **kw)
            for o in resp.get("Contents", []):
                out[o["Key"][len(prefix):]] = int(o["Size"])
            if not resp.get("IsTruncated"):
                return out
            kw["ContinuationToken"] = resp["NextContinuationToken"]

    def delete(self, path: str) -> None:
        try:
            self.fs.rm_file(self._p(path))
        except FileNotFoundError:
            pass

    def rmtree(self, path: str) -> None:
        try:
            self.fs.rm(self._p(path), recursive=True)
        except FileNotFoundError:
            pass

    def refresh(self) -> None:
        self.fs.invalidate_cache()

    def __repr__(self) -> str:
        return f"FsspecStorage({self.url!r})"


def _first_request_alone(fn):
    """``fn`` (a storage call), run alone while no call on this fsspec instance has answered yet: s3fs (and
    gcsfs) set their client up in the first requests, and two threads whose first requests overlap both do.
    Measured with s3fs against moto on 127.0.0.1: every request of both threads then took 0.2-0.6 s instead of
    7-20 ms for as long as both ran (a resume beside the store's background listing: 0.58 s -> 2.0 s), also
    with the session made first (``connect()``); after one answered request, overlapping requests take 10-20 ms.
    The lock is the fsspec instance's (storages of one URL and options share that instance, fsspec's instance
    cache) and re-entrant (a call may make another). A call waits for it at most ``FIRST_CALL_WAIT`` seconds,
    then goes on beside the first (a first call that stalls on a silent server must not hold the others past
    it: they have deadlines of their own)."""
    @functools.wraps(fn)
    def call(self, *args, **kw):
        if self._connected:
            return fn(self, *args, **kw)
        fs = self.fs
        first = fs.__dict__.setdefault("_ckptstore_first", threading.RLock())
        if not first.acquire(timeout=FIRST_CALL_WAIT):
            self._connected = True                 # the first call stalls: this storage stops waiting for it
            return fn(self, *args, **kw)
        try:
            if fs.__dict__.get("_ckptstore_answered"):
                self._connected = True
            else:
                try:
                    return fn(self, *args, **kw)
                finally:
                    fs._ckptstore_answered = True
                    self._connected = True
        finally:
            first.release()
        return fn(self, *args, **kw)
    return call


for _name in CALLS:                            # the storage calls, as the retrying wrapper governs them
    if _name in FsspecStorage.__dict__:
        setattr(FsspecStorage, _name, _first_request_alone(FsspecStorage.__dict__[_name]))
