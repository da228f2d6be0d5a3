"""The HTTP app of ``lantern serve``: OpenAI's ``POST /v1/images/generations`` (with lantern's
sampling fields and acceptance statistics), ``GET /v1/models``, ``/health``, ``/health/ready``
and ``/metrics``. Handlers only check, queue and wait: the engine's thread decodes
(:mod:`lantern_rt.serve.engine`). Every error is a JSON body in OpenAI's shape, never a
traceback."""

from __future__ import annotations

import asyncio
import base64
import io
import json
import math
import secrets
import time
import uuid
from contextlib import asynccontextmanager
from dataclasses import dataclass

import torch
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from lantern_rt.api import Generator
from lantern_rt.errors import LanternError, first_line
from lantern_rt.images import pil_image
from lantern_rt.serve.engine import Closed, Engine, ImageRequest, QueueFull
from lantern_rt.settings import MAX_SEED

MAX_IMAGES_PER_REQUEST = 10  # OpenAI's limit on n
MAX_BODY_BYTES = 64 * 1024
GENERATIONS = "/v1/images/generations"
# the request fields the running decode fixes, and the server flag that sets each
SAMPLING_FLAGS = {
    "cfg_scale": "--cfg-scale",
    "temperature": "--temperature",
    "top_k": "--top-k",
    "top_p": "--top-p",
}


class ApiError(Exception):
    """An error response: ``status``, OpenAI's error body, extra headers."""

    def __init__(self, status: int, message: str, param: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.headers = status, message, param, headers or {}


def error_body(message: str, status: int, param: str | None = None) -> dict:
    kind = "invalid_request_error" if status < 500 else "server_error"
    return {"error": {"message": message, "type": kind, "param": param, "code": status}}


class GenerationBody(BaseModel):
    """``POST /v1/images/generations``: OpenAI's fields, lantern's sampling fields; others are
    ignored (as OpenAI's ``quality`` or ``style``)."""

    model_config = ConfigDict(extra="ignore")

    prompt: str | int
    n: int = Field(1, ge=1, le=MAX_IMAGES_PER_REQUEST)
    size: str | None = None
    response_format: str | None = "b64_json"
    seed: int | None = Field(None, ge=0, le=MAX_SEED)
    model: str | None = None
    cfg_scale: float | None = None
    temperature: float | None = None
    top_k: int | None = None
    top_p: float | None = None


@dataclass(frozen=True)
class ServeSettings:
    """What the app needs besides its engine: the model's name and the request deadline."""

    model: str
    request_timeout: float


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
        request_id = str(uuid.uuid4()).encode()
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


def create_app(engine: Engine, settings: ServeSettings) -> FastAPI:
    """The app over ``engine`` (started with the app, closed when it stops: the requests in
    flight finish first, as uvicorn waits for them)."""
    metrics = engine.metrics

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        engine.start()
        yield
        await asyncio.to_thread(engine.close)

    app = FastAPI(title="lantern-rt", lifespan=lifespan, docs_url=None, redoc_url=None)

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
        body = await _parse(request)
        if not engine.ready.is_set():
            raise ApiError(
                503, engine.failed or "loading: exporting or warming up the model (GET /health/ready)"
            )
        labels, seed = _labels(engine, settings, body)
        loop = asyncio.get_running_loop()
        finished = loop.create_future()

        def on_done() -> None:
            loop.call_soon_threadsafe(lambda: finished.done() or finished.set_result(None))

        job = ImageRequest(labels, seed, on_done, arrived=arrived)
        try:
            engine.submit(job)
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
        gen = engine.generator
        data = await asyncio.to_thread(_png_data, gen, job.tokens)  # off the decode loop's thread
        return {
            "created": int(time.time()),
            "data": data,
            "lantern": {
                "method": gen.method.method,
                "tree": gen.tree,
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


async def _parse(request: Request) -> GenerationBody:
    """The body, at most :data:`MAX_BODY_BYTES` (413), JSON (400), of the right fields (422)."""
    length = request.headers.get("content-length")
    if length is not None and length.isdigit() and int(length) > MAX_BODY_BYTES:
        raise ApiError(413, f"the body is over {MAX_BODY_BYTES} bytes")
    raw = bytearray()
    async for chunk in request.stream():
        raw += chunk
        if len(raw) > MAX_BODY_BYTES:
            raise ApiError(413, f"the body is over {MAX_BODY_BYTES} bytes")
    try:
        data = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        raise ApiError(400, f"the body is not JSON: {exc}") from None
    if not isinstance(data, dict):
        raise ApiError(400, "the body must be a JSON object")
    try:
        return GenerationBody.model_validate(data)
    except ValidationError as exc:
        first = exc.errors()[0]
        param = ".".join(str(p) for p in first["loc"]) or None
        raise ApiError(422, f"{param}: {first['msg']}", param) from None


def _labels(engine: Engine, settings: ServeSettings, body: GenerationBody) -> tuple[list[int | str], int]:
    """The request's image conditions (``n`` of its one class or prompt) and seed (a random one
    when not given); :class:`ApiError` 400 for what this server cannot make."""
    gen = engine.generator
    info = gen.info
    if body.model not in (None, settings.model):
        raise ApiError(400, f"this server runs model {settings.model!r}, not {body.model!r}", "model")
    if body.response_format not in (None, "b64_json"):
        raise ApiError(
            400, "response_format must be b64_json (PNG): this server keeps no image URLs", "response_format"
        )
    size = f"{info.image_size}x{info.image_size}"
    if body.size not in (None, "auto", size):
        raise ApiError(400, f"size must be {size} (the model's), not {body.size!r}", "size")
    running = gen.sampling
    for name, flag in SAMPLING_FLAGS.items():
        asked, runs = getattr(body, name), getattr(running, name)
        if asked is not None and not math.isclose(asked, runs, rel_tol=1e-9, abs_tol=1e-12):
            raise ApiError(
                400,
                f"{name} {asked:g} differs from the running decode's {runs:g}: "
                f"start lantern serve with {flag} {asked:g}",
                name,
            )
    prompt = str(body.prompt)
    if not info.gpt.takes_prompts and (not prompt.strip() or "," in prompt):
        raise ApiError(400, "prompt names one class: its id or its name", "prompt")
    try:
        (condition,) = gen.conditions(prompt)
    except LanternError as exc:
        raise ApiError(400, first_line(exc), "prompt") from None
    seed = secrets.randbelow(MAX_SEED + 1) if body.seed is None else body.seed
    return [condition] * body.n, seed


def _png_data(generator: Generator, tokens: torch.Tensor) -> list[dict]:
    """OpenAI's ``data``: the images of ``tokens`` [n, T] (the VQ decoder), each a base64 PNG."""
    data = []
    for array in generator.to_uint8(tokens):
        buffer = io.BytesIO()
        pil_image(array).save(buffer, format="PNG")
        data.append({"b64_json": base64.b64encode(buffer.getvalue()).decode()})
    return data
