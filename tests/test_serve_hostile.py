"""``lantern serve`` against hostile or careless clients (issue 57): deep JSON, slow or cut-off
requests, too many connections, malformed HTTP, loosely typed or unknown fields, a request
larger than the queue, echoed values. Every answer is a JSON error with an ``X-Request-Id``.

A real engine runs a tiny random model (AR on torch: an image in milliseconds). What the app
decides is checked in-process (Starlette's TestClient); what the HTTP layer decides over raw
sockets against uvicorn with the server's own config (:class:`ServerConfig`) in a thread, and
once through ``lantern serve`` itself.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

pytest.importorskip("fastapi")
uvicorn = pytest.importorskip("uvicorn")
testclient = pytest.importorskip("starlette.testclient")  # needs httpx (or httpx2)

from lantern_rt.api import load  # noqa: E402
from lantern_rt.cli.serve import serve_cmd  # noqa: E402
from lantern_rt.errors import flag  # noqa: E402
from lantern_rt.run_options import option_types  # noqa: E402
from lantern_rt.serve.app import MAX_JSON_DEPTH, QUOTED_CHARS, ServeSettings, create_app  # noqa: E402
from lantern_rt.serve.engine import Engine  # noqa: E402
from lantern_rt.serve.metrics import Metrics  # noqa: E402
from lantern_rt.serve.transport import ServerConfig  # noqa: E402
from tests.conftest import free_port, tiny_gpt, tiny_vq, write_model_dir  # noqa: E402

GEN = "/v1/images/generations"
MAX_QUEUE_IMAGES = 8
READ_TIMEOUT = 1.0  # the servers' --read-timeout
MAX_CONNECTIONS = 4
SLACK = 2.0  # seconds a loaded machine may add to a deadline


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_model_dir(tmp_path_factory.mktemp("serve-hostile") / "tiny", tiny_gpt(), tiny_vq())


def tiny_app(model: Path):
    """The app over a fresh engine on ``model``."""
    engine = Engine(lambda: load(model, backend="torch", method="ar"), MAX_QUEUE_IMAGES, Metrics())
    return create_app(engine, ServeSettings("tiny", 30.0, READ_TIMEOUT)), engine


@pytest.fixture(scope="module")
def client(tiny_dir: Path) -> Iterator:
    app, engine = tiny_app(tiny_dir)
    with testclient.TestClient(app) as c:
        assert engine.ready.wait(60), engine.failed
        yield c


@pytest.fixture(scope="module")
def port(tiny_dir: Path) -> Iterator[int]:
    """The port of uvicorn serving the app with ``lantern serve``'s config, in a thread."""
    app, engine = tiny_app(tiny_dir)
    server = uvicorn.Server(ServerConfig(app, "127.0.0.1", 0, READ_TIMEOUT, MAX_CONNECTIONS))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not (server.started and engine.ready.is_set()):
        assert time.monotonic() < deadline and thread.is_alive(), engine.failed
        time.sleep(0.05)
    yield server.servers[0].sockets[0].getsockname()[1]
    server.should_exit = True
    thread.join(30)


def assert_json_error(status: int, headers: dict, body: bytes, expected: int) -> str:
    """The error's message, once the response is ``expected`` with OpenAI's error body and an id."""
    assert status == expected, body
    assert headers["content-type"].startswith("application/json")
    assert uuid.UUID(headers["x-request-id"]).version == 4
    error = json.loads(body)["error"]
    assert error["code"] == expected and error["message"]
    return error["message"]


def post(client, body) -> tuple[int, dict, bytes]:
    response = client.post(GEN, content=body if isinstance(body, str) else json.dumps(body))
    return response.status_code, response.headers, response.content


# --- the app ------------------------------------------------------------------------------------


def test_deeply_nested_json_is_400(client) -> None:
    nested = '{"prompt": ' + "[" * 20_000 + "]" * 20_000 + "}"  # 40 KB
    message = assert_json_error(*post(client, nested), 400)
    assert f"over {MAX_JSON_DEPTH} deep" in message


@pytest.mark.parametrize("prompt", ["[" * 40, '\\"' + "{" * 40, "\\\\" + "[" * 40])
def test_brackets_inside_strings_do_not_count(client, prompt: str) -> None:
    message = assert_json_error(*post(client, {"prompt": prompt}), 400)
    assert message.startswith("unknown class")


@pytest.mark.parametrize(
    "body, param",
    [
        ({"prompt": True}, "prompt"),
        ({"prompt": None}, "prompt"),
        ({"prompt": "1", "n": True}, "n"),
        ({"prompt": "1", "n": 2.0}, "n"),
        ({"prompt": "1", "seed": "7"}, "seed"),
        ({"prompt": "1", "cfg_scale": True}, "cfg_scale"),
        ({"prompt": "1", "size": 32}, "size"),
        ({"prompt": "1", "user": 5}, "user"),
    ],
)
def test_loose_types_are_422(client, body: dict, param: str) -> None:
    status, headers, content = post(client, body)
    assert_json_error(status, headers, content, 422)
    assert json.loads(content)["error"]["param"] == param


@pytest.mark.parametrize(
    "body, param, hint",
    [
        ({"prompt": "1", "lantern": {"method": "bogus"}}, "lantern", "start lantern serve with its flags"),
        ({"prompt": "1", "method": "ar"}, "method", "start lantern serve with --method"),
        ({"prompt": "1", "tree": "chain"}, "tree", "start lantern serve with --tree"),
        (
            {"prompt": "1", "lantern_lambda": 2.0},
            "lantern_lambda",
            "start lantern serve with --lantern-lambda",
        ),
        ({"prompt": "1", "stream": True}, "stream", ""),
        ({"prompt": "1", "bogus": 1}, "bogus", ""),
    ],
)
def test_unknown_fields_are_400(client, body: dict, param: str, hint: str) -> None:
    status, headers, content = post(client, body)
    message = assert_json_error(status, headers, content, 400)
    assert message.startswith(f"unrecognized request argument supplied: {param}") and hint in message
    assert json.loads(content)["error"]["param"] == param


def test_the_flags_named_are_lantern_serve_options() -> None:
    """A request field that names a run option is refused naming the flag that sets it: every
    run option is a flag of lantern serve."""
    options = {opt for param in serve_cmd.params for opt in param.opts}
    assert {flag(name) for name in option_types()} <= options


def test_openai_fields_this_server_ignores_are_accepted(client) -> None:
    body = {"prompt": 1, "seed": 3, "cfg_scale": 2, "quality": "hd", "style": "vivid", "user": "u-1"}
    response = client.post(GEN, json={**body, "moderation": "low"})
    assert response.status_code == 200, response.text
    assert response.json()["lantern"]["seed"] == 3


def test_more_images_than_the_queue_holds_is_400(client) -> None:
    status, headers, content = post(client, {"prompt": "1", "n": MAX_QUEUE_IMAGES + 1})
    message = assert_json_error(status, headers, content, 400)
    assert "--max-queue-images" in message and str(MAX_QUEUE_IMAGES) in message
    assert "retry-after" not in headers
    assert client.post(GEN, json={"prompt": "1", "n": MAX_QUEUE_IMAGES}).status_code == 200


@pytest.mark.parametrize("path", ["/openapi.json", "/docs", "/redoc"])
def test_no_schema_or_docs_pages(client, path: str) -> None:
    response = client.get(path)
    assert_json_error(response.status_code, response.headers, response.content, 404)


@pytest.mark.parametrize(
    "body",
    [
        {"prompt": "x" * 60_000},
        {"prompt": "1", "size": "y" * 60_000},
        {"prompt": "1", "model": "z" * 60_000},
        {"prompt": "1", "w" * 60_000: 1},
    ],
)
def test_errors_quote_at_most_a_clipped_value(client, body: dict) -> None:
    status, headers, content = post(client, body)
    message = assert_json_error(status, headers, content, 400)
    assert "\u2026" in message and len(content) < 2 * QUOTED_CHARS + 400, message
    assert len(json.loads(content)["error"]["param"]) <= QUOTED_CHARS


# --- the HTTP layer -----------------------------------------------------------------------------


def connect(port: int) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port), timeout=READ_TIMEOUT + SLACK + 5)
    return sock


def read_response(sock: socket.socket) -> tuple[int, dict, bytes]:
    """One response: its status, headers (lower-case names) and body (by its Content-Length)."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        assert chunk, f"the connection closed without an answer: {data!r}"
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    status_line, *lines = head.decode("latin-1").split("\r\n")
    headers = {name.lower(): value.strip() for name, _, value in (line.partition(":") for line in lines)}
    while len(body) < int(headers["content-length"]):
        chunk = sock.recv(65536)
        assert chunk, "the connection closed mid-body"
        body += chunk
    return int(status_line.split()[1]), headers, body


def closed_within(sock: socket.socket, seconds: float, trickle: bytes = b"") -> bool:
    """Whether the server closes ``sock`` within ``seconds`` (sending ``trickle`` every 0.2 s)."""
    deadline = time.monotonic() + seconds
    sock.settimeout(0.2)
    while time.monotonic() < deadline:
        try:
            if trickle:
                sock.sendall(trickle)
            if not sock.recv(65536):
                return True
        except TimeoutError:
            continue
        except (BrokenPipeError, ConnectionResetError):
            return True
    return False


HEAD = b"POST /v1/images/generations HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"


def test_a_trickled_head_gets_408(port: int) -> None:
    with connect(port) as sock:
        t0 = time.monotonic()
        sock.sendall(HEAD)
        sock.settimeout(0.2)
        answer = b""
        while not answer and time.monotonic() - t0 < READ_TIMEOUT + SLACK:
            sock.sendall(b"X-Slow: 1\r\n")  # a header line every 0.2 s, never the blank line
            try:
                answer = sock.recv(65536, socket.MSG_PEEK)
            except TimeoutError:
                pass
        sock.settimeout(5)
        message = assert_json_error(*read_response(sock), 408)
        assert "--read-timeout" in message and time.monotonic() - t0 < READ_TIMEOUT + SLACK
        assert closed_within(sock, SLACK)


def test_a_body_cut_off_gets_408(port: int) -> None:
    with connect(port) as sock:
        t0 = time.monotonic()
        sock.sendall(HEAD + b"Content-Length: 100\r\n\r\n" + b'{"prompt": "')  # 12 of 100 bytes
        message = assert_json_error(*read_response(sock), 408)
        assert "--read-timeout" in message and time.monotonic() - t0 < READ_TIMEOUT + SLACK
        assert closed_within(sock, SLACK)


def test_a_silent_connection_is_closed(port: int) -> None:
    with connect(port) as sock:
        assert closed_within(sock, READ_TIMEOUT + SLACK)


def test_an_answered_request_whose_body_trickles_is_closed(port: int) -> None:
    with connect(port) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n" + b"x" * 12)
        assert read_response(sock)[0] == 200
        assert closed_within(sock, READ_TIMEOUT + SLACK, trickle=b"x")


def test_a_connection_past_the_limit_gets_503(port: int) -> None:
    idle = [connect(port) for _ in range(MAX_CONNECTIONS)]
    time.sleep(0.2)  # the server has them all
    with connect(port) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        status, headers, body = read_response(sock)
        message = assert_json_error(status, headers, body, 503)
        assert "--max-connections" in message and headers["connection"] == "close"
    for s in idle:
        s.close()
    time.sleep(0.2)
    with connect(port) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        assert read_response(sock)[0] == 200


MALFORMED = [
    HEAD + b"Content-Length: -5\r\n\r\n",
    b"GET /health HTTP/1.1\r\nHost: x\r\nX-A: a\rb\r\n\r\n",  # a bare CR
    b"GET /health HTTP/1.1\r\nHost: x\r\nX-A: a\x00b\r\n\r\n",  # a NUL
    b"HELLO WORLD\r\n\r\n",
]


@pytest.mark.parametrize("request_bytes", MALFORMED, ids=["negative-length", "bare-cr", "nul", "hello-world"])
def test_malformed_http_gets_a_json_400(port: int, request_bytes: bytes) -> None:
    with connect(port) as sock:
        sock.sendall(request_bytes)
        message = assert_json_error(*read_response(sock), 400)
        assert message.startswith("malformed HTTP request")
        assert closed_within(sock, SLACK)


# --- lantern serve ------------------------------------------------------------------------------


@pytest.mark.slow  # a process of its own: importing torch and the app takes most of 10 s here
def test_lantern_serve_takes_the_limits(tiny_dir: Path, tmp_path: Path) -> None:
    """``--read-timeout`` and ``--max-connections`` reach the server ``lantern serve`` runs."""
    port = free_port()
    command = [sys.executable, "-m", "lantern_rt.cli", "serve", "--model", str(tiny_dir), "--port", str(port)]
    options = ["--backend", "torch", "--method", "ar", "--read-timeout", "1", "--max-connections", "1"]
    log = tmp_path / "log"
    env = {**os.environ, "LANTERN_CACHE": str(tmp_path / "cache")}
    process = subprocess.Popen([*command, *options], env=env, stdout=log.open("w"), stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 60
        while True:
            assert process.poll() is None and time.monotonic() < deadline, log.read_text()
            try:
                with connect(port) as sock:
                    sock.sendall(b"GET /health/ready HTTP/1.1\r\nHost: x\r\n\r\n")
                    if read_response(sock)[0] == 200:
                        break
            except OSError:
                time.sleep(0.2)
        time.sleep(0.2)  # the server has closed the polling connections
        with connect(port) as first, connect(port) as second:
            t0 = time.monotonic()
            second.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
            assert_json_error(*read_response(second), 503)
            first.sendall(HEAD + b"Content-Length: 100\r\n\r\n")
            assert_json_error(*read_response(first), 408)
            assert time.monotonic() - t0 < 1.0 + SLACK
        with connect(port) as sock:
            sock.sendall(MALFORMED[-1])
            assert_json_error(*read_response(sock), 400)
    finally:
        process.kill()
        process.wait()
