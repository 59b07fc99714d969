"""A seeded fault-injecting TCP proxy on 127.0.0.1 for the object-store tests (issue 17, section 4).

It forwards connections to an upstream server (moto) and, while ``faults`` is on, gives each new connection one
fate drawn from a seeded generator:
* ``reset``: the connection is closed before anything is forwarded (a reset before the request);
* ``slowdown``: the request is answered ``503 SlowDown`` by the proxy itself (S3's throttling answer), or
  ``429 Too Many Requests`` with ``slowdown_status=429`` (GCS's, and some S3-compatible servers');
* ``lost``: the request reaches the server, which applies it, and the connection is reset as the answer
  starts to come back (the client never sees it and retries a write that already landed);
* ``stall``: the request is held for ``stall_seconds`` with no answer, then the connection is closed;
* ``corrupt_bodies = N`` (independent of ``faults``): the next N answers with a body have one byte flipped;
* ``ok``: forwarded; while faults are on, closed after a short random lifetime (maybe mid-request), so
  keep-alive clients keep meeting new fates;
* ``blackhole = True`` (independent of ``faults``): the server stops answering: every connection, new or open,
  still accepts bytes, and nothing more crosses in either direction (a server that accepts requests and never
  answers, issue 26 item 6); set it back to False and open connections carry bytes again.
Only 127.0.0.1 is ever listened on or connected to. ``counts`` tells how many connections met each fate.
"""
from __future__ import annotations

import asyncio
import random
import re
import threading
from collections import Counter
from typing import Optional


class FaultProxy:
    FATES = ("reset", "slowdown", "lost", "stall", "ok")

    def __init__(self, upstream_port: int, *, seed: int = 0, weights=(2, 2, 2, 1, 6), stall_seconds: float = 3.0,
                 slowdown_status: int = 503):
        self.upstream_port = upstream_port
        self.slowdown_status = slowdown_status
        self.rng = random.Random(seed)
        self.weights = weights
        self.stall_seconds = stall_seconds
        self.faults = False
        self.corrupt_bodies = 0                 # answers whose body gets one byte flipped (see _pipe_down)
        self.corrupt_match = b""
        self.blackhole = False                  # see the module docstring
        self.counts: Counter = Counter()
        self.port: Optional[int] = None
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, name="faultproxy", daemon=True)

    def __enter__(self) -> "FaultProxy":
        self._thread.start()
        self._ready.wait(10)
        return self

    def __exit__(self, *exc) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        server = self._loop.run_until_complete(asyncio.start_server(self._handle, "127.0.0.1", 0))
        self.port = server.sockets[0].getsockname()[1]
        self._ready.set()
        self._loop.run_forever()

    async def _pipe_down(self, r: asyncio.StreamReader, w: asyncio.StreamWriter, seen) -> None:
        """Server -> client; while ``corrupt_bodies`` > 0, byte 32 of the body of a 200 or 206 answer to a GET whose
        request line contains ``corrupt_match`` is flipped (a body damaged in transfer, its length intact), and the
        count goes down. The byte is found across reads: a loaded server may send the head and the body apart."""
        skip = None                 # body bytes still to pass before the one to flip (None: nothing armed)
        while True:
            data = await r.read(65536)
            if not data:
                break
            if self.blackhole:
                continue
            start = 0
            if (skip is None and self.corrupt_bodies > 0 and data[:12] in (b"HTTP/1.1 200", b"HTTP/1.1 206")
                    and seen and seen[-1].startswith(b"GET ") and self.corrupt_match in seen[-1]):
                head_end = data.find(b"\r\n\r\n")
                length = re.search(rb"(?i)\r\ncontent-length:\s*(\d+)", data[:max(head_end, 0)])
                if head_end >= 0 and length and int(length.group(1)) >= 64:
                    skip, start = 32, head_end + 4
                    self.corrupt_bodies -= 1            # taken now: two answers in flight never both flip
            if skip is not None:
                if len(data) - start > skip:
                    i = start + skip
                    data = data[:i] + bytes([data[i] ^ 0xFF]) + data[i + 1:]
                    skip = None
                    self.counts["corrupt"] += 1
                else:
                    skip -= len(data) - start
            w.write(data)
            await w.drain()

    async def _handle(self, cr: asyncio.StreamReader, cw: asyncio.StreamWriter) -> None:
        if self.blackhole:
            self.counts["blackhole"] += 1
            while await cr.read(65536):          # takes the request, never answers
                pass
            return cw.close()
        fate = self.rng.choices(self.FATES, self.weights)[0] if self.faults else "ok"
        self.counts[fate] += 1
        try:
            if fate == "reset":
                return _reset(cw)
            if fate == "slowdown":
                await cr.read(65536)
                if self.slowdown_status == 429:
                    body = (b"<Error><Code>TooManyRequests</Code><Message>Please reduce your request rate."
                            b"</Message></Error>")
                    cw.write(b"HTTP/1.1 429 Too Many Requests\r\nContent-Type: application/xml\r\n"
                             b"Content-Length: %d\r\nConnection: close\r\n\r\n%s" % (len(body), body))
                else:
                    cw.write(b"HTTP/1.1 503 Slow Down\r\nContent-Type: application/xml\r\nContent-Length: 95\r\n"
                             b"Connection: close\r\n\r\n<Error><Code>SlowDown</Code><Message>Please reduce your "
                             b"request rate.</Message></Error>")
                await cw.drain()
                return cw.close()
            if fate == "stall":
                await cr.read(65536)
                await asyncio.sleep(self.stall_seconds)
                return _reset(cw)
            ur, uw = await asyncio.open_connection("127.0.0.1", self.upstream_port)
            lifetime = self.rng.uniform(0.3, 2.0)
            seen = []                              # request lines sent on this connection, newest last
            up = asyncio.ensure_future(_pipe(cr, uw, seen, self))
            if fate == "lost":
                await ur.read(65536)                  # the server answered: it applied the request
                up.cancel()
                uw.close()
                return _reset(cw)
            down = asyncio.ensure_future(self._pipe_down(ur, cw, seen))
            # under faults a healthy connection still ends soon (possibly mid-request: one more lost answer);
            # without faults it lives until either side closes it
            await asyncio.wait([up, down], timeout=lifetime if self.faults else None,
                               return_when=asyncio.FIRST_COMPLETED)
            for t in (up, down):
                t.cancel()
            uw.close()
            cw.close()
        except (ConnectionError, OSError, asyncio.CancelledError):
            cw.close()


async def _pipe(r: asyncio.StreamReader, w: asyncio.StreamWriter, seen=None, proxy=None) -> None:
    while True:
        data = await r.read(65536)
        if not data:
            break
        if proxy is not None and proxy.blackhole:
            continue
        if seen is not None and data[:8].split(b" ")[0] in (b"GET", b"PUT", b"POST", b"HEAD", b"DELETE"):
            seen.append(data.split(b"\r\n", 1)[0])
        w.write(data)
        await w.drain()


def _reset(w: asyncio.StreamWriter) -> None:
    """Close with RST (SO_LINGER 0), as a dropped connection looks to the client."""
    import socket
    import struct
    sock = w.get_extra_info("socket")
    if sock is not None:
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        except OSError:
            pass
    w.close()
