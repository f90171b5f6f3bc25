"""A TCP proxy in front of a server, injecting transport faults between a client and it.

`hold()` stops moving bytes (connections stay open and nothing answers, HTTP/2 pings included: a stopped
or wedged process), `release()` moves them again, `close()` resets every connection and refuses new ones
(a dead process). Runs on an asyncio loop of its own (`LoopThread`), so a server whose own loop is
blocked does not stop the proxy.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import struct

from tests.gateway_fakes import LoopThread


class TcpProxy:
    """Forwards 127.0.0.1:`port` to `target` ("host:port")."""

    def __init__(self, target: str) -> None:
        self.target_host, target_port = target.rsplit(":", 1)
        self.target_port = int(target_port)
        self.loop = LoopThread()
        self.port = 0
        self._server: asyncio.base_events.Server | None = None
        self._flowing: asyncio.Event | None = None
        self._writers: list[asyncio.StreamWriter] = []
        self.loop.run(self._start())

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    async def _start(self) -> None:
        self._flowing = asyncio.Event()
        self._flowing.set()
        self._server = await asyncio.start_server(self._accept, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]

    async def _accept(self, client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        try:
            server_r, server_w = await asyncio.open_connection(self.target_host, self.target_port)
        except OSError:
            self._reset(client_w)
            return
        self._writers += [client_w, server_w]
        await asyncio.gather(self._pipe(client_r, server_w), self._pipe(server_r, client_w))

    async def _pipe(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(OSError, ConnectionError):
            while data := await reader.read(65536):
                await self._flowing.wait()
                writer.write(data)
                await writer.drain()
        self._reset(writer)

    @staticmethod
    def _reset(writer: asyncio.StreamWriter) -> None:
        """Close with a TCP reset (SO_LINGER 0), as the kernel does for a process that died."""
        sock = writer.get_extra_info("socket")
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        writer.transport.abort()

    def hold(self) -> None:
        self.loop.loop.call_soon_threadsafe(self._flowing.clear)

    def release(self) -> None:
        self.loop.loop.call_soon_threadsafe(self._flowing.set)

    def close(self) -> None:
        """Reset every connection and stop listening: new connections are refused."""

        async def close() -> None:
            self._server.close()
            for writer in self._writers:
                self._reset(writer)
            self._writers.clear()

        self.loop.run(close())

    def stop(self) -> None:
        with contextlib.suppress(Exception):
            self.close()
        self.loop.close()
