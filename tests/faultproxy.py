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
* ``damage(n, match, kind)`` (independent of ``faults``, connections opened after it): the next ``n`` answers
  (``None``: every one) to GETs whose request line matches the regex ``match`` come back damaged in transfer:
  ``kind="flip"`` flips one byte at a seeded random position, ``"truncate"`` cuts the body at a seeded random
  length and rewrites ``Content-Length`` to it (the client sees a well-formed, shorter answer), ``"mixed"`` draws
  one of the two per answer. Two damaged answers in a row to the same request line never carry the same bad
  bytes (a fault of the network, not of the object);
* ``ok``: forwarded; while faults are on, closed after a random lifetime drawn from ``ok_lifetime`` seconds
  (maybe mid-request), so keep-alive clients keep meeting new fates;
* ``blackhole = True`` (independent of ``faults``): the server stops answering: every connection, new or open,
  still accepts bytes, and nothing more crosses in either direction (a server that accepts requests and never
  answers, issue 26 item 6); set it back to False and open connections carry bytes again.
* ``refuse = True`` (independent of ``faults``; set it with :meth:`refuse_all`, which also resets every open
  connection): every connection is reset before anything is forwarded (a node cut off from the store, failing
  fast); set it back to False to let new connections through.
Only 127.0.0.1 is ever listened on or connected to. ``counts`` tells how many connections met each fate.
"""
from __future__ import annotations

import asyncio
import random
import re
from collections import Counter
from typing import Optional

from proxybase import LoopbackProxy, pipe


class FaultProxy(LoopbackProxy):
    FATES = ("reset", "slowdown", "lost", "stall", "ok")
    name = "faultproxy"

    def __init__(self, upstream_port: int, *, seed: int = 0, weights=(2, 2, 2, 1, 6), stall_seconds: float = 3.0,
                 slowdown_status: int = 503, ok_lifetime=(0.3, 2.0)):
        super().__init__(upstream_port)
        self.slowdown_status = slowdown_status
        self.rng = random.Random(seed)
        self.weights = weights
        self.stall_seconds = stall_seconds
        self.ok_lifetime = ok_lifetime
        self.faults = False
        self.corrupt_bodies = 0                 # answers whose body gets one byte flipped (see _pipe_down)
        self.corrupt_match = b""
        self.damage_left: Optional[int] = 0     # damage(): answers still to damage (None: every matching one)
        self.damage_match: Optional[re.Pattern] = None
        self.damage_kind = "flip"
        self._damage_rng = random.Random(seed + 1)
        self._damage_last: dict = {}            # request line -> the last damage done to its answer
        self.blackhole = False                  # see the module docstring
        self.refuse = False                     # see the module docstring and refuse_all()
        self._open: set = set()                 # the client side of every connection being forwarded
        self.counts: Counter = Counter()

    def damage(self, n: Optional[int], match: bytes, kind: str = "mixed") -> None:
        """Damage the next ``n`` (``None``: every) answers to GETs whose request line matches ``match`` (a
        bytes regex); see the module docstring. Applies to connections opened from now on."""
        if kind not in ("flip", "truncate", "mixed"):
            raise ValueError(kind)
        self.damage_left, self.damage_match, self.damage_kind = n, re.compile(match), kind

    def _take_damage(self, request_line: bytes, length: int):
        """``None`` (leave the answer alone), ``("flip", position)`` or ``("truncate", new length)``."""
        if (self.damage_match is None or self.damage_left == 0 or length < 2 or not request_line.startswith(b"GET ")
                or not self.damage_match.search(request_line)):
            return None
        kind = self.damage_kind if self.damage_kind != "mixed" else self._damage_rng.choice(("flip", "truncate"))
        while True:
            fate = (kind, self._damage_rng.randrange(length))
            if fate != self._damage_last.get(request_line):
                break
        self._damage_last[request_line] = fate
        if self.damage_left is not None:
            self.damage_left -= 1
        self.counts["damaged"] += 1
        return fate

    def _upstream(self, data: bytes, seen: list) -> Optional[bytes]:
        """Client -> server, read by read (:func:`proxybase.pipe`): nothing crosses while ``blackhole`` is on; a
        read that starts a request adds its request line to ``seen``."""
        if self.blackhole:
            return None
        if data[:8].split(b" ")[0] in (b"GET", b"PUT", b"POST", b"HEAD", b"DELETE"):
            seen.append(data.split(b"\r\n", 1)[0])
        return data

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

    async def _pipe_damaging(self, r: asyncio.StreamReader, w: asyncio.StreamWriter, seen) -> None:
        """Server -> client, answer by answer (each matched to its request in ``seen``), damaging the answers
        :meth:`_take_damage` picks. An answer whose body length it cannot tell (chunked) ends the tracking: the
        rest of the connection passes as it is."""
        answered = 0
        while True:
            try:
                head = await r.readuntil(b"\r\n\r\n")
            except asyncio.IncompleteReadError as e:
                if e.partial:
                    w.write(e.partial)
                    await w.drain()
                return
            status = head.split(b" ", 2)[1] if head.count(b" ") >= 2 else b""
            interim = status.startswith(b"1")            # 100 Continue: the final answer follows
            request = seen[answered] if answered < len(seen) else b""
            if not interim:
                answered += 1
            length = re.search(rb"(?i)\r\ncontent-length:\s*(\d+)", head)
            if interim or request.startswith(b"HEAD ") or status in (b"204", b"304"):
                body_len = 0
            elif length is None or re.search(rb"(?i)\r\ntransfer-encoding:", head):
                w.write(head)
                await pipe(r, w)
                return
            else:
                body_len = int(length.group(1))
            try:
                body = bytearray(await r.readexactly(body_len))
            except asyncio.IncompleteReadError as e:     # the server closed mid-body: pass on what came
                w.write(head + e.partial)
                await w.drain()
                return
            fate = self._take_damage(request, body_len) if status in (b"200", b"206") else None
            if fate is not None and fate[0] == "flip":
                body[fate[1]] ^= 0xFF
            elif fate is not None:                       # a shorter answer, well formed; the connection ends
                head = re.sub(rb"(?i)\r\ncontent-length:\s*\d+", b"\r\nContent-Length: %d" % fate[1], head)
                head = re.sub(rb"(?i)\r\nconnection:[^\r]*", b"", head)
                head = head[:-4] + b"\r\nConnection: close\r\n\r\n"
                w.write(head + bytes(body[:fate[1]]))
                await w.drain()
                w.close()
                return
            w.write(head + bytes(body))
            await w.drain()

    def refuse_all(self) -> None:
        """From now on reset every new connection, and reset the open ones (keep-alive connections included)."""
        self.refuse = True

        def reset_open():
            for w in list(self._open):
                _reset(w)
        self._loop.call_soon_threadsafe(reset_open)

    async def _handle(self, cr: asyncio.StreamReader, cw: asyncio.StreamWriter) -> None:
        if self.refuse:
            self.counts["refused"] += 1
            return _reset(cw)
        self._open.add(cw)
        try:
            await self._forward(cr, cw)
        finally:
            self._open.discard(cw)

    async def _forward(self, cr: asyncio.StreamReader, cw: asyncio.StreamWriter) -> None:
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
            ur, uw = await self.connect_upstream()
            lifetime = self.rng.uniform(*self.ok_lifetime)
            seen = []                              # request lines sent on this connection, newest last
            up = asyncio.ensure_future(pipe(cr, uw, lambda data: self._upstream(data, seen)))
            if fate == "lost":
                await ur.read(65536)                  # the server answered: it applied the request
                up.cancel()
                uw.close()
                return _reset(cw)
            answers = self._pipe_damaging if self.damage_match is not None else self._pipe_down
            down = asyncio.ensure_future(answers(ur, cw, seen))
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
