"""The HTTP app of ``lantern serve``: OpenAI's ``POST /v1/images/generations`` (with lantern's
sampling fields and acceptance statistics), ``GET /v1/models``, ``/health``, ``/health/ready``
and ``/metrics``. Handlers only check, queue and wait: the engine's thread decodes
(:mod:`lantern_rt.serve.engine`). Every error is a JSON body in OpenAI's shape, never a
traceback, and quotes at most :data:`QUOTED_CHARS` characters of what the client sent."""

from __future__ import annotations

import asyncio
import base64
import io
import json
import re
import secrets
import time
import uuid
from contextlib import asynccontextmanager
from dataclasses import dataclass

import torch
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import BaseModel, ConfigDict, Field, ValidationError, create_model, field_validator
from pydantic_core import PydanticCustomError
from starlette.exceptions import HTTPException as StarletteHTTPException

from lantern_rt.errors import LanternError, first_line, flag
from lantern_rt.images import pil_image
from lantern_rt.models.sampling_config import setting_types
from lantern_rt.run_options import option_types
from lantern_rt.runtime.sampling import SamplingConfig
from lantern_rt.serve.engine import (
    SAMPLING_FIELDS,
    BadSetting,
    Closed,
    EngineClient,
    ImageRequest,
    QueueFull,
    TooManyImages,
)
from lantern_rt.serve.limits import READ_TIMEOUT
from lantern_rt.settings import MAX_SEED

MAX_IMAGES_PER_REQUEST = 10  # OpenAI's limit on n
MAX_BODY_BYTES = 64 * 1024
MAX_JSON_DEPTH = 16  # a body nests arrays and objects at most this deep (a valid one: 1)
QUOTED_CHARS = 100  # of a value an error message quotes
MAX_MESSAGE_CHARS = 1000  # of an error message
GENERATIONS = "/v1/images/generations"
REQUEST_ID = b"x-request-id"


class ApiError(Exception):
    """An error response: ``status``, OpenAI's error body, extra headers."""

    def __init__(self, status: int, message: str, param: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.headers = status, message, param, headers or {}


def clip(text: str, limit: int = QUOTED_CHARS) -> str:
    """``text``, cut to ``limit`` characters (the last an ellipsis) when longer."""
    return text if len(text) <= limit else text[: limit - 1] + "\u2026"


def quoted(value: object) -> str:
    """``value`` as an error message quotes it: its repr, clipped."""
    return clip(repr(value))


def new_request_id() -> bytes:
    """An ``X-Request-Id`` value: a uuid4."""
    return str(uuid.uuid4()).encode()


def error_body(message: str, status: int, param: str | None = None) -> dict:
    """OpenAI's error body (the message clipped to :data:`MAX_MESSAGE_CHARS`)."""
    kind = "invalid_request_error" if status < 500 else "server_error"
    message = clip(message, MAX_MESSAGE_CHARS)
    return {"error": {"message": message, "type": kind, "param": param, "code": status}}


class _OpenAIBody(BaseModel):
    """``POST /v1/images/generations``: OpenAI's fields, strictly typed (a JSON ``true`` is not a
    class id, a number is not a string); any other field is an error but OpenAI's that do not
    change what this server makes, which are accepted and ignored."""

    model_config = ConfigDict(extra="forbid", strict=True)

    prompt: str | int
    n: int = Field(1, ge=1, le=MAX_IMAGES_PER_REQUEST)
    size: str | None = None
    response_format: str | None = "b64_json"
    seed: int | None = Field(None, ge=0, le=MAX_SEED)
    model: str | None = None
    # OpenAI's, accepted and ignored
    quality: str | None = None
    style: str | None = None
    user: str | None = None
    moderation: str | None = None

    @field_validator("prompt", mode="before")
    @classmethod
    def _text_or_class_id(cls, value: object) -> object:
        if isinstance(value, bool) or not isinstance(value, str | int):
            raise PydanticCustomError("prompt_type", "must be a string or an integer (a class id)")
        return value


# OpenAI's fields and each sampling setting (None or absent: the server's)
GenerationBody = create_model(
    "GenerationBody",
    __base__=_OpenAIBody,
    **{name: (kind | None, None) for name, kind in setting_types().items()},  # type: ignore[call-overload]
)


@dataclass(frozen=True)
class ServeSettings:
    """What the app needs besides its engine: the model's name, the request deadline, and the
    seconds a request's body may take to arrive."""

    model: str
    request_timeout: float
    read_timeout: float = READ_TIMEOUT


class RequestIds:
    """ASGI middleware: a uuid4 ``X-Request-Id`` on every response, the generation requests
    counted by status and timed, and any error that escaped the handlers a JSON 500 (no
    traceback). Plain ASGI, so that a handler still sees its client disconnect."""

    def __init__(self, app, metrics) -> None:
        self.app, self.metrics = app, metrics

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        request_id = new_request_id()
        t0 = time.monotonic()
        status = [500]
        started = [False]

        async def send_with_id(message) -> None:
            if message["type"] == "http.response.start":
                started[0] = True
                status[0] = message["status"]
                message = {**message, "headers": [*message.get("headers", []), (b"x-request-id", request_id)]}
            await send(message)

        try:
            await self.app(scope, receive, send_with_id)
        except Exception as exc:  # no traceback leaves the server
            if started[0]:
                raise
            response = JSONResponse(error_body(f"internal error: {first_line(exc)}", 500), 500)
            await response(scope, receive, send_with_id)
        if scope["path"] == GENERATIONS:
            self.metrics.requests.labels(status=str(status[0])).inc()
            self.metrics.request_seconds.observe(time.monotonic() - t0)


def create_app(engine: EngineClient, settings: ServeSettings) -> FastAPI:
    """The app over ``engine`` (started with the app, closed when it stops: the requests in
    flight finish first, as uvicorn waits for them); it speaks to the engine through
    :class:`~lantern_rt.serve.engine.EngineClient` alone."""
    metrics = engine.metrics

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        engine.start()
        yield
        await asyncio.to_thread(engine.close)

    app = FastAPI(title="lantern-rt", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)

    app.add_middleware(RequestIds, metrics=metrics)

    @app.exception_handler(ApiError)
    async def api_error(request: Request, exc: ApiError):
        return JSONResponse(error_body(exc.message, exc.status, exc.param), exc.status, headers=exc.headers)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException):
        return JSONResponse(error_body(str(exc.detail), exc.status_code), exc.status_code)

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    @app.get("/health/ready")
    async def ready():
        if engine.failed:
            raise ApiError(503, engine.failed)
        if not engine.ready.is_set():
            raise ApiError(503, "loading: exporting or warming up the model")
        return {"status": "ready"}

    @app.get("/metrics")
    async def prometheus():
        return Response(metrics.exposition(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models():
        return {
            "object": "list",
            "data": [{"id": settings.model, "object": "model", "created": 0, "owned_by": "lantern-rt"}],
        }

    @app.post(GENERATIONS)
    async def generations(request: Request):
        arrived = time.monotonic()
        body = await _parse(request, settings.read_timeout)
        if not engine.ready.is_set():
            raise ApiError(
                503, engine.failed or "loading: exporting or warming up the model (GET /health/ready)"
            )
        labels, seed, sampling = _request(engine, settings, body)
        loop = asyncio.get_running_loop()
        finished = loop.create_future()

        def on_done() -> None:
            loop.call_soon_threadsafe(lambda: finished.done() or finished.set_result(None))

        job = ImageRequest(labels, seed, sampling, on_done, arrived=arrived)
        try:
            engine.submit(job)
        except TooManyImages as exc:
            raise ApiError(400, str(exc), "n") from None
        except QueueFull as exc:
            raise ApiError(429, str(exc), headers={"Retry-After": str(exc.retry_after)}) from None
        except Closed as exc:
            raise ApiError(503, str(exc)) from None
        deadline = arrived + settings.request_timeout
        while not finished.done():
            left = deadline - time.monotonic()
            if left <= 0:
                engine.cancel(job)
                raise ApiError(504, f"the request took over --request-timeout {settings.request_timeout:g} s")
            await asyncio.wait({finished}, timeout=min(0.25, left))
            if not finished.done() and await request.is_disconnected():
                engine.cancel(job)  # its slots free at the next step
                return Response(status_code=499)
        if job.error is not None:
            raise ApiError(500, job.error)
        served = engine.served
        data = await asyncio.to_thread(_png_data, engine, job.tokens)  # off the decode loop's thread
        return {
            "created": int(time.time()),
            "data": data,
            "lantern": {
                "method": served.method,
                "tree": served.tree,
                "seed": seed,
                "queue_seconds": job.started - arrived,
                "seconds": time.monotonic() - arrived,
                "images": [
                    {
                        "target_calls": 1 + len(r.accepted),
                        "tokens_per_call": sum(r.accepted) / max(1, len(r.accepted)),
                    }
                    for r in (job.results[i] for i in range(job.n))
                ],
            },
        }

    return app


async def _parse(request: Request, read_timeout: float) -> GenerationBody:
    """The body: arrived within ``read_timeout`` seconds (408), at most :data:`MAX_BODY_BYTES`
    (413), JSON nested at most :data:`MAX_JSON_DEPTH` deep (400), of known fields (400) of the
    right types and values (422)."""
    length = request.headers.get("content-length")
    if length is not None and length.isdigit() and int(length) > MAX_BODY_BYTES:
        raise ApiError(413, f"the body is over {MAX_BODY_BYTES} bytes")
    try:
        raw = await asyncio.wait_for(_read_body(request), read_timeout)
    except asyncio.TimeoutError:
        message = f"the body did not arrive within --read-timeout {read_timeout:g} s"
        raise ApiError(408, message, headers={"Connection": "close"}) from None
    try:
        text = raw.decode(json.detect_encoding(raw), "surrogatepass")
    except UnicodeDecodeError as exc:
        raise ApiError(400, f"the body is not JSON: {exc}") from None
    if _nests_deeper(text, MAX_JSON_DEPTH):
        raise ApiError(400, f"the body nests JSON arrays and objects over {MAX_JSON_DEPTH} deep")
    try:
        data = json.loads(text)
    except ValueError as exc:
        raise ApiError(400, f"the body is not JSON: {exc}") from None
    if not isinstance(data, dict):
        raise ApiError(400, "the body must be a JSON object")
    try:
        return GenerationBody.model_validate(data)
    except ValidationError as exc:
        first = exc.errors()[0]
        param = clip(str(first["loc"][0])) if first["loc"] else None
        if first["type"] == "extra_forbidden":
            raise ApiError(400, _unrecognized(str(first["loc"][0])), param) from None
        raise ApiError(422, f"{param}: {first['msg']}", param) from None


async def _read_body(request: Request) -> bytes:
    """The body, at most :data:`MAX_BODY_BYTES` (413)."""
    raw = bytearray()
    async for chunk in request.stream():
        raw += chunk
        if len(raw) > MAX_BODY_BYTES:
            raise ApiError(413, f"the body is over {MAX_BODY_BYTES} bytes")
    return bytes(raw)


_JSON_SPECIAL = re.compile(r'[\[\]{}"\\]')


def _nests_deeper(text: str, limit: int) -> bool:
    """Whether the JSON ``text`` opens over ``limit`` arrays or objects inside one another
    (counted outside its strings, in one pass over its brackets, quotes and backslashes: the
    parser itself recurses)."""
    depth, in_string, escaped = 0, False, -1  # escaped: the position a backslash escapes
    for special in _JSON_SPECIAL.finditer(text):
        char, at = special.group(), special.start()
        if at == escaped:
            continue
        if in_string:
            if char == "\\":
                escaped = at + 1
            elif char == '"':
                in_string = False
        elif char == '"':
            in_string = True
        elif char in "[{":
            depth += 1
            if depth > limit:
                return True
        elif char in "]}":
            depth -= 1
    return False


def _unrecognized(name: str) -> str:
    """The 400's message for a body field this server does not know."""
    message = f"unrecognized request argument supplied: {clip(name)}"
    if name in option_types():
        return f"{message}: the running decode fixes it; start lantern serve with {flag(name)}"
    if name == "lantern":
        return f"{message}: the running decode fixes lantern's settings; start lantern serve with its flags"
    return message


def _request(
    engine: EngineClient, settings: ServeSettings, body: GenerationBody
) -> tuple[list[int | str], int, SamplingConfig]:
    """The request's image conditions (``n`` of its one class or prompt), seed (a random one
    when not given) and sampling (the server's for the fields not given); :class:`ApiError` 400
    for what this server cannot make, naming the field."""
    served = engine.served
    if body.model not in (None, settings.model):
        raise ApiError(400, f"this server runs model {settings.model!r}, not {quoted(body.model)}", "model")
    if body.response_format not in (None, "b64_json"):
        raise ApiError(
            400, "response_format must be b64_json (PNG): this server keeps no image URLs", "response_format"
        )
    size = f"{served.image_size}x{served.image_size}"
    if body.size not in (None, "auto", size):
        raise ApiError(400, f"size must be {size} (the model's), not {quoted(body.size)}", "size")
    try:
        sampling = engine.sampling({name: getattr(body, name) for name in SAMPLING_FIELDS})
    except BadSetting as exc:
        raise ApiError(400, f"{exc.field}: {exc}", exc.field) from None
    prompt = str(body.prompt)
    if not served.takes_prompts and (not prompt.strip() or "," in prompt):
        raise ApiError(400, "prompt names one class: its id or its name", "prompt")
    try:
        (condition,) = engine.conditions(prompt)
    except LanternError as exc:  # it may quote the prompt: clipped
        text = prompt.strip()
        raise ApiError(400, first_line(exc).replace(repr(text), quoted(text)), "prompt") from None
    seed = secrets.randbelow(MAX_SEED + 1) if body.seed is None else body.seed
    return [condition] * body.n, seed, sampling


def _png_data(engine: EngineClient, tokens: torch.Tensor) -> list[dict]:
    """OpenAI's ``data``: the images of ``tokens`` [n, T] (the VQ decoder), each a base64 PNG."""
    data = []
    for array in engine.to_uint8(tokens):
        buffer = io.BytesIO()
        pil_image(array).save(buffer, format="PNG")
        data.append({"b64_json": base64.b64encode(buffer.getvalue()).decode()})
    return data
