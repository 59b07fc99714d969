"""What the test proxies share (tests/countproxy.py, tests/faultproxy.py, benchmarks/bench_memory_tier.py's
``ByteProxy``): an asyncio TCP server on 127.0.0.1 (an ephemeral port) run in a daemon thread of its own, in
front of an upstream server on 127.0.0.1 (moto, fake-gcs-server), used as a context manager.

A subclass writes ``_handle(client_reader, client_writer)``, the coroutine that serves one client connection
(it opens its upstream connection with :meth:`LoopbackProxy.connect_upstream`); :func:`pipe` copies one
direction of a connection as it comes. Only 127.0.0.1 is ever listened on or connected to."""
from __future__ import annotations

import asyncio
import threading
from typing import Callable, Optional, Tuple


class LoopbackProxy:
    """``with Proxy(upstream_port) as proxy:`` clients use ``proxy.endpoint`` (``http://127.0.0.1:<port>``)."""

    name = "proxy"                                  # the thread's name

    def __init__(self, upstream_port: int):
        self.upstream_port = upstream_port
        self.port: Optional[int] = None
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, name=self.name, daemon=True)

    def __enter__(self):
        self._thread.start()
        if not self._ready.wait(10):
            raise RuntimeError(f"{self.name} did not start within 10 s")
        return self

    def __exit__(self, *exc) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def connect_upstream(self) -> "asyncio.Future[Tuple[asyncio.StreamReader, asyncio.StreamWriter]]":
        return asyncio.open_connection("127.0.0.1", self.upstream_port)

    async def _handle(self, cr: asyncio.StreamReader, cw: asyncio.StreamWriter) -> None:
        raise NotImplementedError

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        server = self._loop.run_until_complete(asyncio.start_server(self._handle, "127.0.0.1", 0))
        self.port = server.sockets[0].getsockname()[1]
        self._ready.set()
        self._loop.run_forever()


async def pipe(r: asyncio.StreamReader, w: asyncio.StreamWriter,
               each: Optional[Callable[[bytes], Optional[bytes]]] = None) -> None:
    """Copy ``r`` to ``w`` until ``r`` ends. ``each(data)``, when given, sees every read first and returns what
    to pass on (``None``: drop it)."""
    while True:
        data = await r.read(65536)
        if not data:
            break
        if each is not None:
            data = each(data)
            if data is None:
                continue
        w.write(data)
        await w.drain()
