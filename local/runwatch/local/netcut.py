"""``NetCut``: a loopback TCP proxy in front of a broker that can cut the network and restore it.

For outage drills: the broker advertises the proxy's address, so every client (trainer,
worker, sink) reaches it through here. ``cut()`` closes the listener and aborts every live
connection, as a dead broker host would look (new connections are refused); ``restore()``
listens again on the same port. The broker process and its in-memory topics live on.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import Coroutine
from concurrent.futures import Future
from typing import Any

from runwatch.local.broker import free_port

_CHUNK = 64 * 1024


class NetCut:
    """Forwards ``host:port`` to ``upstream`` in a background thread. Use as a context manager."""

    def __init__(self, upstream: tuple[str, int], host: str = "127.0.0.1", port: int | None = None):
        self.upstream = upstream
        self.host = host
        self.port = port or free_port(host)
        self.cuts = 0
        self.connections = 0  # accepted since start
        self.down_s = 0.0  # total time cut
        self._cut_since: float | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._server: asyncio.AbstractServer | None = None
        self._transports: set[asyncio.WriteTransport] = set()

    @property
    def bootstrap(self) -> str:
        return f"{self.host}:{self.port}"

    @property
    def is_cut(self) -> bool:
        return self._cut_since is not None

    def start(self, timeout: float = 5.0) -> NetCut:
        loop = asyncio.new_event_loop()
        self._loop = loop
        self._thread = threading.Thread(target=loop.run_forever, name="runwatch-netcut", daemon=True)
        self._thread.start()
        self._call(self._listen(), timeout)
        return self

    def cut(self, timeout: float = 5.0) -> None:
        """Refuse new connections and abort every open one."""
        if self._cut_since is None:
            self._call(self._cut(), timeout)
            self._cut_since = time.monotonic()
            self.cuts += 1

    def restore(self, timeout: float = 5.0) -> None:
        """Listen on the same port again."""
        if self._cut_since is not None:
            self._call(self._listen(), timeout)
            self.down_s += time.monotonic() - self._cut_since
            self._cut_since = None

    def stop(self, timeout: float = 5.0) -> None:
        loop, self._loop = self._loop, None
        if loop is None:
            return
        with contextlib.suppress(Exception):
            asyncio.run_coroutine_threadsafe(self._cut(), loop).result(timeout)
        loop.call_soon_threadsafe(loop.stop)
        if self._thread is not None:
            self._thread.join(timeout)
        if not loop.is_running():
            loop.close()

    def __enter__(self) -> NetCut:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- the loop's side -------------------------------------------------------------------

    def _call(self, coro: Coroutine[Any, Any, None], timeout: float) -> None:
        if self._loop is None:
            raise RuntimeError("NetCut is not started")
        future: Future[None] = asyncio.run_coroutine_threadsafe(coro, self._loop)
        future.result(timeout)

    async def _listen(self) -> None:
        # SO_REUSEADDR (asyncio's default on POSIX) lets the port be bound again at once.
        self._server = await asyncio.start_server(self._serve, self.host, self.port, reuse_address=True)

    async def _cut(self) -> None:
        server, self._server = self._server, None
        if server is not None:
            server.close()
        for transport in list(self._transports):
            transport.abort()
        self._transports.clear()

    async def _serve(self, client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            upstream_r, upstream_w = await asyncio.open_connection(*self.upstream)
        except OSError:
            client_w.transport.abort()
            return
        pair = (client_w.transport, upstream_w.transport)
        self._transports.update(pair)
        try:
            await asyncio.gather(self._pipe(client_r, upstream_w), self._pipe(upstream_r, client_w))
        finally:
            for transport in pair:
                self._transports.discard(transport)
                transport.abort()

    @staticmethod
    async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while data := await reader.read(_CHUNK):
                writer.write(data)
                await writer.drain()
        except (ConnectionError, OSError):
            pass
        finally:  # one side ended: end the other, so neither half lingers
            writer.transport.abort()
