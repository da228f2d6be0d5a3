"""The HTTP/1.1 server under ``lantern serve``'s app: uvicorn's h11 protocol with guards of its
own, each answered as the app answers (OpenAI's JSON error body, an ``X-Request-Id``):

- a request's head (request line and headers) must arrive within ``read_timeout`` seconds of
  the connection opening or of the previous response: past it, 408 when part of it came, and the
  connection closed (the app bounds the time its body takes: :func:`lantern_rt.serve.app._parse`);
- the rest of a body the app answered without reading must arrive within ``read_timeout``
  seconds of the answer, or the connection is closed;
- a connection past ``max_connections`` open ones gets 503 to its request, then is closed;
- a request h11 cannot parse (a bad request line, header or ``Content-Length``) gets 400.
"""

from __future__ import annotations

import asyncio
import json
from http import HTTPStatus
from typing import Any

import h11
import uvicorn
from starlette.responses import JSONResponse
from uvicorn.protocols.http.h11_impl import H11Protocol

from lantern_rt.serve.app import REQUEST_ID, error_body, new_request_id


class ServerConfig(uvicorn.Config):
    """uvicorn's settings for ``app`` on ``host``:``port`` (the guarded h11 protocol, no
    WebSocket upgrades, warnings only, no access log) and the guards' own."""

    def __init__(self, app: Any, host: str, port: int, read_timeout: float, max_connections: int) -> None:
        super().__init__(
            app,
            host=host,
            port=port,
            http=GuardedH11Protocol,
            ws="none",
            log_level="warning",
            access_log=False,
        )
        self.read_timeout = read_timeout
        self.max_connections = max_connections


class GuardedH11Protocol(H11Protocol):
    """One connection: uvicorn's h11 protocol with the read deadline, the connection limit and
    JSON 400s (the module's docstring). Its config is a :class:`ServerConfig`."""

    def __init__(self, config: ServerConfig, *args: Any, **kwargs: Any) -> None:
        super().__init__(config, *args, **kwargs)
        self.read_timeout = config.read_timeout
        self.max_connections = config.max_connections
        self._deadline: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        if len(self.connections) > self.max_connections:
            self.app = _too_many_connections
        self._watch()

    def connection_lost(self, exc: Exception | None) -> None:
        super().connection_lost(exc)
        if self._deadline is not None:
            self._deadline.cancel()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        self._watch()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._watch()

    def send_400_response(self, msg: str) -> None:
        if self.conn.our_state is h11.IDLE:  # no response of the app's begun on this connection
            self._answer(400, "malformed HTTP request: its request line, a header or its length is invalid")
        else:
            self.transport.close()

    def _watch(self) -> None:
        """Arm the read deadline while the connection waits for a request's head (or for the
        rest of a body already answered), disarm it while the app holds the request."""
        waiting = (
            not self.transport.is_closing()
            and self.conn.our_state is not h11.SEND_RESPONSE
            and self.conn.their_state in (h11.IDLE, h11.SEND_BODY)
        )
        if waiting and self._deadline is None:
            self._deadline = self.loop.call_later(self.read_timeout, self._read_timed_out)
        elif not waiting and self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def _read_timed_out(self) -> None:
        self._deadline = None
        if self.transport.is_closing():
            return
        started = self.conn.their_state is h11.IDLE and self.conn.trailing_data[0]
        if started and self.conn.our_state is h11.IDLE:
            self._answer(
                408, f"the request's head did not arrive within --read-timeout {self.read_timeout:g} s"
            )
        else:  # nothing of a request came, or its answer is sent
            self.transport.close()

    def _answer(self, status: int, message: str) -> None:
        """Send the JSON error response ``status`` (outside h11, whose state may be an error)
        and close the connection."""
        body = json.dumps(error_body(message, status)).encode()
        headers = [
            *self.server_state.default_headers,
            (b"content-type", b"application/json"),
            (b"content-length", str(len(body)).encode()),
            (b"connection", b"close"),
            (REQUEST_ID, new_request_id()),
        ]
        head = [f"HTTP/1.1 {status} {HTTPStatus(status).phrase}".encode()]
        head += [name + b": " + value for name, value in headers]
        self.transport.write(b"\r\n".join(head) + b"\r\n\r\n" + body)
        self.transport.close()


async def _too_many_connections(scope: dict, receive: Any, send: Any) -> None:
    """The app of a connection past the limit: 503, and the connection closes."""
    status = 503
    message = "the server holds its --max-connections open connections: retry later"
    headers = {"connection": "close", "retry-after": "1", REQUEST_ID.decode(): new_request_id().decode()}
    await JSONResponse(error_body(message, status), status, headers=headers)(scope, receive, send)
