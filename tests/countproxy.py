"""A request-counting HTTP proxy on 127.0.0.1 in front of the loopback S3 server (moto), for the request-budget
tests and ``benchmarks/bench_requests.py`` (issue 19).

Every HTTP request a client sends through it is parsed (request line, headers, and the body by its
Content-Length or chunked encoding, so keep-alive connections are followed request by request), counted by kind
and forwarded unchanged; answers are piped back unchanged. Kinds, as S3 bills them:

* ``LIST``: a GET on the bucket itself (ListObjects / ListObjectsV2, ``?list-type=2``, ``?prefix=``);
* ``GET`` / ``HEAD``: object reads and lookups;
* ``PUT``: object writes, multipart parts, and the POSTs that start and complete a multipart upload;
* ``DELETE``: object deletes and batch deletes (``POST ?delete``).

``GET /__mark__/<name>`` is answered by the proxy itself (never forwarded, never counted): it records the
counts so far under ``name``, so processes under test can say when a phase ended (a save uploaded, a resume
done) and a test can take the difference between two marks. Only 127.0.0.1 is listened on or connected to.
"""
from __future__ import annotations

import asyncio
import threading
import urllib.parse
from collections import Counter
from typing import Dict, List, Optional, Tuple

from proxybase import LoopbackProxy, pipe

KINDS = ("GET", "HEAD", "LIST", "PUT", "DELETE")


def classify(method: str, target: str) -> str:
    """The S3 request kind of one HTTP request (``target``: its path and query, path-style addressing)."""
    path, _, query = target.partition("?")
    params = urllib.parse.parse_qs(query, keep_blank_values=True)
    key = path.strip("/").partition("/")[2]
    if method == "GET":
        return "LIST" if not key else "GET"
    if method == "HEAD":
        return "HEAD"
    if method == "DELETE" or (method == "POST" and "delete" in params):
        return "DELETE"
    if method in ("PUT", "POST"):
        return "PUT"
    return method


class CountingProxy(LoopbackProxy):
    """``with CountingProxy(upstream_port) as proxy:`` clients use ``proxy.endpoint``; ``proxy.counts`` (a
    ``Counter`` by kind), ``proxy.requests`` ((method, target) in arrival order), ``proxy.marks`` (name ->
    counts at that mark, a copy) and :meth:`between`."""

    name = "countproxy"

    def __init__(self, upstream_port: int):
        super().__init__(upstream_port)
        self.counts: Counter = Counter()
        self.requests: List[Tuple[str, str]] = []
        self.marks: Dict[str, Counter] = {}
        self.mark_index: Dict[str, int] = {}
        self._lock = threading.Lock()

    def reset(self) -> None:
        with self._lock:
            self.counts.clear()
            self.requests.clear()
            self.marks.clear()
            self.mark_index.clear()

    def mark(self, name: str) -> None:
        with self._lock:
            self.marks[name] = Counter(self.counts)
            self.mark_index[name] = len(self.requests)

    def between(self, a: Optional[str], b: str) -> Counter:
        """Requests by kind after mark ``a`` (``None``: the start) up to mark ``b``."""
        before = self.marks[a] if a is not None else Counter()
        out = Counter(self.marks[b])
        out.subtract(before)
        return Counter({k: v for k, v in out.items() if v})

    def requests_between(self, a: Optional[str], b: str) -> List[Tuple[str, str]]:
        return self.requests[self.mark_index[a] if a is not None else 0:self.mark_index[b]]

    # -- the server ---------------------------------------------------------------------------------------------
    async def _handle(self, cr: asyncio.StreamReader, cw: asyncio.StreamWriter) -> None:
        up = down = None
        try:
            ur, uw = await self.connect_upstream()
            down = asyncio.ensure_future(pipe(ur, cw))
            up = asyncio.ensure_future(self._requests(cr, uw, cw))
            await asyncio.wait([up, down], return_when=asyncio.FIRST_COMPLETED)
        except (ConnectionError, OSError):
            pass
        finally:
            for t in (up, down):
                if t is not None:
                    t.cancel()
            cw.close()

    async def _requests(self, r: asyncio.StreamReader, w: asyncio.StreamWriter, cw: asyncio.StreamWriter) -> None:
        """Client -> server, one request at a time: count it, forward its head and body."""
        while True:
            try:
                head = await r.readuntil(b"\r\n\r\n")
            except (asyncio.IncompleteReadError, asyncio.LimitOverrunError):
                return
            line, _, rest = head.partition(b"\r\n")
            method, target = line.decode("latin-1").split(" ")[:2]
            headers = {}
            for h in rest.decode("latin-1").split("\r\n"):
                if ":" in h:
                    k, v = h.split(":", 1)
                    headers[k.strip().lower()] = v.strip()
            if target.startswith("/__mark__/"):
                self.mark(urllib.parse.unquote(target[len("/__mark__/"):]))
                cw.write(b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n")
                await cw.drain()
                continue
            with self._lock:
                self.counts[classify(method, target)] += 1
                self.requests.append((method, target))
            w.write(head)
            if "chunked" in headers.get("transfer-encoding", "").lower():
                while True:
                    size_line = await r.readuntil(b"\r\n")
                    w.write(size_line)
                    n = int(size_line.split(b";")[0].strip() or b"0", 16)
                    if n == 0:
                        while True:                     # trailers, then the empty line
                            t = await r.readuntil(b"\r\n")
                            w.write(t)
                            if t == b"\r\n":
                                break
                        break
                    w.write(await r.readexactly(n + 2))
            else:
                n = int(headers.get("content-length", "0") or 0)
                while n > 0:
                    chunk = await r.read(min(n, 1 << 20))
                    if not chunk:
                        return
                    w.write(chunk)
                    n -= len(chunk)
            await w.drain()


def object_puts(requests: List[Tuple[str, str]]) -> Counter:
    """Uploads per blob / pack object name (issue 29: PUT once per job, not once per node) among ``requests``
    ((method, target), as :attr:`CountingProxy.requests`): PUTs of a whole object, and the POSTs that start a
    multipart upload (its parts and its completion are not counted again)."""
    out: Counter = Counter()
    for method, target in requests:
        path, _, query = target.partition("?")
        if ("/objects/" in path or "/packs/" in path) and "uploadId" not in query and \
                (method == "PUT" or (method == "POST" and "uploads" in query)):
            out[path] += 1
    return out


def mark(endpoint: str, name: str) -> None:
    """From a process under test: record the proxy's counts so far under ``name`` (see the module docstring)."""
    import urllib.request
    with urllib.request.urlopen(f"{endpoint}/__mark__/{urllib.parse.quote(name)}", timeout=30) as r:
        r.read()


# -- jobs whose requests are counted (tests/remote/test_request_budget.py, benchmarks/bench_requests.py) -------------
def run_job(world: int, *args: str, timeout: float = 240) -> dict:
    """Run ``tests/request_worker.py`` as ``world`` ranks with tests/dist.py (launched like torchrun, gloo on
    127.0.0.1); fails with their output when one fails. Returns rank 0's ``RESULT`` dict."""
    from pathlib import Path
    from dist import run
    return run(world, *args, script=Path(__file__).resolve().parent / "request_worker.py", timeout=timeout)[0] or {}


def measure(proxy: CountingProxy, url: str, storage_options: dict, root: str, world: int, *, per_node: int = 4,
            shared_root: bool = False, steps: int = 2, timeout: float = 240, shared_kib: int = 64,
            state: str = "default", args: Tuple[str, ...] = ()) -> dict:
    """Counts of one save job (``steps`` saves from scratch into the empty remote ``url``) and of one resume
    job on fresh local roots (every step pulled from the remote). Returns ``{"save<k>": Counter, ...,
    "resume": Counter (job start -> every rank resumed), "resume_settled": Counter (-> uploader start-up done),
    "resumed_step": int}``. ``state``: the worker's ``--state`` (default, ddp, hsdp); ``args``: more
    worker options, for both jobs."""
    import json
    so = json.dumps(dict(storage_options, endpoint_url=proxy.endpoint))
    out = {}
    store = f"{root}/save" + ("" if shared_root else "/node{node}")
    proxy.reset()
    run_job(world, "--mode", "save", "--store", store, "--remote", url, "--so", so, "--steps", str(steps),
            "--per-node", str(per_node), "--shared-kib", str(shared_kib), "--state", state, *args,
            timeout=timeout)
    prev = None
    for k in range(1, steps + 1):
        out[f"save{k}"] = proxy.between(prev, f"save{k}")
        out[f"requests_save{k}"] = proxy.requests_between(prev, f"save{k}")
        prev = f"save{k}"
    proxy.reset()
    store = f"{root}/resume" + ("" if shared_root else "/node{node}")
    res = run_job(world, "--mode", "resume", "--store", store, "--remote", url, "--so", so,
                  "--per-node", str(per_node), "--shared-kib", str(shared_kib), "--state", state, *args,
            timeout=timeout)
    out["resume"] = proxy.between(None, "resumed")
    out["resume_settled"] = proxy.between(None, "settled")
    out["requests_resume"] = proxy.requests_between(None, "resumed")
    out["requests_resume_settled"] = proxy.requests_between("resumed", "settled")
    out["resumed_step"] = res.get("resumed")
    return out
