"""A loopback TCP proxy for fault tests (research H6: replaces Toxiproxy).

Modes (`set_mode`), read when a connection opens unless noted:

* `pass`: relay bytes both ways.
* `blackhole`: accept and read, never forward nor answer (client timeouts).
* `reset_now`: accept, then reset the connection at once.
* `drop_reply`: forward the request; on the server's first answer bytes, reset the
  client and keep what it never saw in `dropped` (an HTTP answer lost after commit).
* `drop_reply_to_commit` (PostgreSQL, live on open connections too): forward a
  `COMMIT`, then reset the client before relaying `CommandComplete`: the server
  committed, the client cannot know ("commit outcome unknown").
* `drop_commit` (PostgreSQL, live): reset both sides instead of forwarding the
  `COMMIT`: the server rolls back, the client sees the same error.

COMMIT is found in simple-query `Q` messages and in extended-protocol `Parse`
messages (cut at the batch's `Sync`). `times=n` reverts to `pass` after n cuts;
`skip=n` lets the first n COMMITs through. SSL and GSS encryption requests are
refused by the proxy itself ('N'), so clients with `sslmode=prefer` stay readable.

`silence_open()` (issue 14) makes every connection open at that moment go *silent*:
bytes from either side are read (so the kernel keeps acknowledging them, as a wedged
middlebox does) and dropped, no FIN, no RST; connections opened later work. A side
that closes a silent connection is not heard either: the other side stays open until
it closes too (a backend the server ends) or the proxy stops. It returns how many it
silenced.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import struct
import threading
from collections.abc import Coroutine
from dataclasses import dataclass, field
from typing import Any

MODES = ("pass", "blackhole", "reset_now", "drop_reply", "drop_reply_to_commit",
         "drop_commit")
_ENCRYPTION_REQUESTS = (80877103, 80877104)  # SSLRequest, GSSENCRequest
_COMMITS = ("COMMIT", "END", "COMMIT TRANSACTION", "COMMIT WORK", "END TRANSACTION")


def _is_commit(query: bytes) -> bool:
    text = query.split(b"\x00", 1)[0].decode(errors="replace").strip().rstrip(";").strip()
    return " ".join(text.upper().split()) in _COMMITS


def _answer_complete(buf: bytes | bytearray, *, http: bool) -> bool:
    """PostgreSQL: up to ReadyForQuery. HTTP: the head and Content-Length bytes of body."""
    if not http:
        return b"Z\x00\x00\x00\x05" in buf
    head, sep, body = buf.partition(b"\r\n\r\n")
    if not sep:
        return False
    for line in head.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            return len(body) >= int(value)
    return True


@dataclass(eq=False)  # hashed by identity: kept in a set
class _Conn:
    client: asyncio.StreamWriter
    server: asyncio.StreamWriter | None = None
    cut: bool = False
    silent: bool = False
    swallowed: bytearray = field(default_factory=bytearray)


class TcpProxy:
    """`TcpProxy(("127.0.0.1", 5432)).start()`; clients connect to `.port`.

    `upstream` is `(host, port)` or the path of a Unix socket.
    """

    def __init__(self, upstream: tuple[str, int] | str, *, pg: bool = True) -> None:
        self.upstream = upstream
        self.pg = pg
        self.port = 0
        self.mode = "pass"
        self.remaining: int | None = None  # cuts left before reverting to `pass`
        self.skip = 0
        self.cuts = 0
        self.silenced = 0
        self.connections = 0
        self.commits_seen: list[str] = []  # "Q:COMMIT" or "P:COMMIT", in order
        self.dropped: list[bytes] = []  # per cut: what the server said, unseen
        self._conns: set[_Conn] = set()
        self._handlers: set[asyncio.Task[None]] = set()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True,
                                        name="tcp-proxy")
        self._server: asyncio.Server | None = None

    # -- control (any thread) -----------------------------------------------------------

    def start(self) -> TcpProxy:
        self._thread.start()
        self._server = self._call(asyncio.start_server(self._handle, "127.0.0.1", 0))
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    def set_mode(self, mode: str, *, times: int | None = None, skip: int = 0) -> None:
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}")
        self.mode, self.remaining, self.skip = mode, times, skip

    def stop(self) -> None:
        async def close() -> None:
            if self._server is not None:
                self._server.close()
            for conn in list(self._conns):
                self._reset(conn)
            if self._handlers:  # let them see the reset and end (silent ones wait)
                await asyncio.wait(list(self._handlers), timeout=2)
        if self._thread.is_alive():
            self._call(close())
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(5)

    def silence_open(self) -> int:
        async def silence() -> int:
            for conn in self._conns:
                conn.silent = True
            self.silenced += len(self._conns)
            return len(self._conns)
        return int(self._call(silence()))

    def _call(self, coro: Coroutine[Any, Any, Any]) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(10)

    # -- relaying (the loop's thread) -----------------------------------------------------

    def _fired(self) -> None:
        self.cuts += 1
        if self.remaining is not None:
            self.remaining -= 1
            if self.remaining <= 0:
                self.mode = "pass"

    def _reset(self, conn: _Conn, *, client_only: bool = False) -> None:
        with contextlib.suppress(OSError):  # RST, not FIN: a dropped connection
            sock = conn.client.get_extra_info("socket")
            if sock is not None:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        conn.client.transport.abort()
        if conn.server is not None and not client_only:
            conn.server.transport.abort()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        conn, mode = _Conn(writer), self.mode
        self._conns.add(conn)
        me = asyncio.current_task()
        if me is not None:
            self._handlers.add(me)
            me.add_done_callback(self._handlers.discard)
        try:
            if mode == "reset_now":
                return self._reset(conn)
            if mode == "blackhole":
                while await reader.read(65536):
                    pass
                return None
            if isinstance(self.upstream, str):
                sreader, conn.server = await asyncio.open_unix_connection(self.upstream)
            else:
                sreader, conn.server = await asyncio.open_connection(*self.upstream)
            pumps = [asyncio.ensure_future(self._to_server(reader, conn)),
                     asyncio.ensure_future(self._to_client(sreader, conn, mode))]
            await asyncio.wait(pumps, return_when=asyncio.FIRST_COMPLETED)
            if conn.cut:  # the client is gone: still collect the server's answer
                await asyncio.wait(pumps[1:], timeout=2)
            if conn.silent:  # a side that hangs up is not heard either: keep the other
                await asyncio.wait(pumps)  # open until it hangs up too (or stop())
            for task in pumps:
                task.cancel()
            await asyncio.gather(*pumps, return_exceptions=True)
        except (OSError, asyncio.IncompleteReadError):
            pass
        finally:
            self._conns.discard(conn)
            if conn.swallowed:
                self.dropped.append(bytes(conn.swallowed))
            for w in (conn.client, conn.server):
                if w is not None:
                    w.close()
        return None

    async def _to_client(self, sreader: asyncio.StreamReader, conn: _Conn, mode: str) -> None:
        while data := await sreader.read(65536):
            if conn.silent:
                continue
            if mode == "drop_reply" and not conn.cut:
                conn.cut = True
                self._fired()
                self._reset(conn, client_only=True)
            if conn.cut:  # the server's answer to what the client will never hear
                conn.swallowed += data
                if _answer_complete(conn.swallowed, http=mode == "drop_reply"):
                    return
                continue
            conn.client.write(data)
            await conn.client.drain()

    async def _to_server(self, reader: asyncio.StreamReader, conn: _Conn) -> None:
        assert conn.server is not None
        if not self.pg:
            while data := await reader.read(65536):
                if conn.silent:
                    continue
                conn.server.write(data)
                await conn.server.drain()
            return
        while True:  # startup: untyped messages; refuse encryption ourselves
            length, code = struct.unpack("!ii", await reader.readexactly(8))
            body = await reader.readexactly(length - 8)
            if code not in _ENCRYPTION_REQUESTS:
                conn.server.write(struct.pack("!ii", length, code) + body)
                break
            conn.client.write(b"N")
        pending_commit = False
        while True:
            head = await reader.readexactly(5)
            kind, length = head[:1], struct.unpack("!i", head[1:])[0]
            message = head + await reader.readexactly(length - 4)
            body = message[5:]
            if conn.silent:
                continue
            trigger = False
            if kind == b"Q" and _is_commit(body):
                self.commits_seen.append(f"Q:{body[:-1].decode(errors='replace')}")
                trigger = True
            elif kind == b"P":
                query = body.split(b"\x00", 2)[1]
                if _is_commit(query):
                    self.commits_seen.append(f"P:{query.decode(errors='replace')}")
                    pending_commit = True
                    if self.mode == "drop_commit" and self._take_turn():
                        return self._reset(conn)
            elif kind == b"S" and pending_commit:
                pending_commit, trigger = False, True
            if trigger and self.mode == "drop_reply_to_commit" and self._take_turn():
                conn.cut = True  # set before forwarding: no reply bytes get through
                conn.server.write(message)
                await conn.server.drain()
                self._reset(conn, client_only=True)
                continue
            if trigger and kind == b"Q" and self.mode == "drop_commit" and self._take_turn():
                return self._reset(conn)
            conn.server.write(message)
            await conn.server.drain()

    def _take_turn(self) -> bool:
        """A COMMIT in a cutting mode: cut it, unless it is one of the `skip` first."""
        if self.skip > 0:
            self.skip -= 1
            return False
        self._fired()
        return True
