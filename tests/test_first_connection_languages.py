"""A worker's first connection judges a server's refusal by its SQLSTATE, not by its words.

first_connection matched the server's English messages ("too many connections for", "FATAL:"):
under a server whose lc_messages is another language, a refusal time mends (a role at its
connection limit) was taken for one it cannot (German keeps the severity FATAL: the worker
exited), and where the severity is translated too (Russian: ВАЖНО), a refusal waiting cannot
mend (a database that does not exist) was taken for no answer at all (the worker waited for
ever). A proxy in front of the test server speaks as such a server: each ErrorResponse's
severity and text in another language, its SQLSTATE and non-localized severity kept, as
PostgreSQL sends them (seen from servers set to de_DE.UTF-8 and ru_RU.UTF-8).
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest
from psycopg import sql
from psycopg.conninfo import conninfo_to_dict, make_conninfo

import flowly
from tests.support import connect_to, running_worker, server_address, wait_for

# (severity as the server's language says FATAL, a message in that language)
LANGUAGES = {
    "de": ("FATAL", "Meldung in einer anderen Sprache"),
    "ru": ("ВАЖНО", "сообщение на другом языке"),
}


def _localized(message: bytes, language: str) -> bytes:
    """An ErrorResponse (type, length, fields) with its severity (S) and text (M) in
    ``language``; the other fields (V, C...) as they were."""
    severity, text = (word.encode() for word in LANGUAGES[language])
    fields, at = [], 5
    while message[at] != 0:
        end = message.index(b"\0", at + 1)
        code, value = message[at:at + 1], message[at + 1:end]
        if code == b"S":
            value = severity if value == b"FATAL" else value
        elif code == b"M":
            value = text
        fields.append(code + value + b"\0")
        at = end + 1
    body = b"".join(fields) + b"\0"
    return b"E" + (len(body) + 4).to_bytes(4, "big") + body


class LocalizingProxy:
    """A TCP proxy to the test server whose ErrorResponses reach the client in ``language``.
    Its DSN asks for neither SSL nor GSS encryption, so the server's bytes are protocol
    messages from the first (type, then length)."""

    def __init__(self, dsn: str, language: str) -> None:
        params = conninfo_to_dict(dsn)
        self._upstream = server_address(str(params.get("host", "127.0.0.1")),
                                        int(params.get("port", 5432)))
        self._language = language
        self._listener = socket.create_server(("127.0.0.1", 0))
        self._sockets: list[socket.socket] = [self._listener]
        for key in ("host", "hostaddr", "port"):
            params.pop(key, None)
        self.dsn = make_conninfo(**params, host="127.0.0.1", sslmode="disable",
                                 gssencmode="disable",
                                 port=str(self._listener.getsockname()[1]))
        threading.Thread(target=self._accept, daemon=True).start()

    def close(self) -> None:
        for sock in self._sockets:
            with contextlib.suppress(OSError):
                sock.close()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:  # closed
                return
            try:
                server = connect_to(self._upstream)
            except OSError:  # the client sees its connection end, rather than hang
                client.close()
                raise
            self._sockets += [client, server]
            threading.Thread(target=self._pump, args=(client, server), daemon=True).start()
            threading.Thread(target=self._pump_localized, args=(server, client),
                             daemon=True).start()

    @staticmethod
    def _pump(source: socket.socket, sink: socket.socket) -> None:
        with contextlib.suppress(OSError):
            while data := source.recv(65536):
                sink.sendall(data)
        with contextlib.suppress(OSError):
            sink.shutdown(socket.SHUT_WR)

    def _pump_localized(self, source: socket.socket, sink: socket.socket) -> None:
        pending = b""
        with contextlib.suppress(OSError):
            while data := source.recv(65536):
                pending += data
                out = []
                while len(pending) >= 5 and len(pending) >= 1 + int.from_bytes(pending[1:5],
                                                                                 "big"):
                    size = 1 + int.from_bytes(pending[1:5], "big")
                    message, pending = pending[:size], pending[size:]
                    out.append(_localized(message, self._language)
                               if message[:1] == b"E" else message)
                sink.sendall(b"".join(out))
        with contextlib.suppress(OSError):
            sink.shutdown(socket.SHUT_WR)


@contextlib.contextmanager
def localizing_proxy(dsn: str, language: str) -> Iterator[LocalizingProxy]:
    proxy = LocalizingProxy(dsn, language)
    try:
        yield proxy
    finally:
        proxy.close()


@pytest.mark.parametrize("language", sorted(LANGUAGES))
def test_the_proxy_speaks_another_language_and_keeps_the_sqlstate(
        dsn: str, language: str) -> None:
    missing = make_conninfo(dsn, dbname="flowly_no_such_database")
    with localizing_proxy(missing, language) as proxy, \
            pytest.raises(psycopg.OperationalError) as raised:
        psycopg.connect(proxy.dsn)
    assert LANGUAGES[language][1] in str(raised.value), raised.value
    assert "does not exist" not in str(raised.value), raised.value


@pytest.mark.parametrize("language", sorted(LANGUAGES))
def test_a_role_at_its_connection_limit_in_another_language_is_waited_out(
        roles: tuple[str, str], db: psycopg.Connection[Any],
        caplog: pytest.LogCaptureFixture, language: str) -> None:
    """53300 (too_many_connections), in any language: the worker waits and serves once its
    role may connect again."""
    import tests.workflows  # noqa: F401  (registers "quick")

    login = conninfo_to_dict(roles[0])["user"]
    db.execute(sql.SQL("alter role {} connection limit 0").format(sql.Identifier(login)))
    try:
        with localizing_proxy(roles[0], language) as proxy, \
                flowly.Client(db.info.dsn) as client, \
                running_worker(proxy.dsn, install_schema=False):
            run_id = client.start("quick", "limited")
            wait_for(lambda: "cannot reach the database yet (try 2:" in caplog.text,
                     what="the worker trying again")
            assert LANGUAGES[language][1] in caplog.text, caplog.text
            assert client.get(run_id).status == "pending"
            db.execute(sql.SQL("alter role {} connection limit -1").format(
                sql.Identifier(login)))
            assert client.wait(run_id, timeout=30).status == "completed"
    finally:
        db.execute(sql.SQL("alter role {} connection limit -1").format(sql.Identifier(login)))


@pytest.mark.parametrize("language", sorted(LANGUAGES))
def test_a_missing_database_in_another_language_ends_the_worker_at_once(
        dsn: str, caplog: pytest.LogCaptureFixture, language: str) -> None:
    """3D000 (invalid_catalog_name), in any language: waiting cannot mend it, so the worker
    fails at once with the server's words instead of trying for ever."""
    import tests.workflows  # noqa: F401  (registers "quick")

    missing = make_conninfo(dsn, dbname="flowly_no_such_database")
    with localizing_proxy(missing, language) as proxy:
        worker = flowly.Worker(proxy.dsn, ["quick"])
        started = time.monotonic()
        with pytest.raises(psycopg.OperationalError) as raised:
            asyncio.run(asyncio.wait_for(worker.run(), 15))
        took = time.monotonic() - started
    assert LANGUAGES[language][1] in str(raised.value), raised.value
    assert took < 5, f"the worker took {took:.1f}s to give up"
    assert "cannot reach the database yet" not in caplog.text, caplog.text
