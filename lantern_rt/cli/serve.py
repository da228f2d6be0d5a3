"""``lantern serve``: the image-generation HTTP service (:mod:`lantern_rt.serve`)."""

from __future__ import annotations

import signal
import sys

import click

from lantern_rt.cli.options import RUN, model_option, open_run_source, run_bundle_option, run_options
from lantern_rt.errors import EXIT_BAD_INPUT, UserError, reports_errors
from lantern_rt.run_options import RunOptions
from lantern_rt.serve.limits import MAX_CONNECTIONS, READ_TIMEOUT


@click.command("serve")
@model_option
@run_options(*RUN)  # the run a server holds
@run_bundle_option
@click.option(
    "--host", default="127.0.0.1", show_default=True, help="Address to listen on (0.0.0.0: every interface)."
)
@click.option("--port", type=click.IntRange(0, 65535), default=8000, show_default=True, help="TCP port.")
@click.option(
    "--max-queue-images",
    type=click.IntRange(min=1),
    default=64,
    show_default=True,
    help="Images waiting for a decode slot, at most; a request that does not fit gets 429 with Retry-After.",
)
@click.option(
    "--request-timeout",
    type=click.FloatRange(min=0, min_open=True),
    default=300.0,
    show_default=True,
    help="Seconds a request may take; past it, 504 and its images are cancelled.",
)
@click.option(
    "--read-timeout",
    type=click.FloatRange(min=0, min_open=True),
    default=READ_TIMEOUT,
    show_default=True,
    help="Seconds a request's head may take to arrive, and then its body; past either, 408 and the connection closes.",
)
@click.option(
    "--max-connections",
    type=click.IntRange(min=1),
    default=MAX_CONNECTIONS,
    show_default=True,
    help="Open connections, at most; a request on one past them gets 503 and its connection closes.",
)
@click.option(
    "--ray",
    "use_ray",
    is_flag=True,
    help="Run as a Ray Serve deployment on a local Ray (or the cluster RAY_ADDRESS names): one replica "
    "per GPU, or --replicas on CPUs; needs the ray extra.",
)
@click.option(
    "--replicas",
    type=click.IntRange(min=1),
    default=None,
    help="With --ray: replicas to run (default: one per GPU, or one on a CPU); CPU replicas share the "
    "CPUs evenly (give each its share with --threads).",
)
@reports_errors
def serve_cmd(
    model_path,
    bundle,
    host,
    port,
    max_queue_images,
    request_timeout,
    read_timeout,
    max_connections,
    use_ray,
    replicas,
    **options,
):
    """Serve POST /v1/images/generations (OpenAI's shape), /v1/models, /health, /health/ready and
    /metrics, decoding every request's images in one continuously batched decode loop."""
    if replicas is not None and not use_ray:
        raise UserError("--replicas needs --ray (one process serves without Ray)")
    if use_ray:
        from lantern_rt.serve.ray_serve import import_ray_serve

        import_ray_serve()  # before any work: the install hint, not a traceback
    try:
        import uvicorn  # noqa: F401
        from fastapi import FastAPI  # noqa: F401
        from prometheus_client import Counter  # noqa: F401
    except ImportError as exc:
        raise UserError(f"lantern serve needs {exc.name}: pip install 'lantern-rt[serve]'") from None
    from lantern_rt.settings import resolve

    md, source = open_run_source(model_path, bundle)
    plan = resolve(source, RunOptions(**options))  # bad options: one line and exit 2 before the server starts

    def load():
        from lantern_rt.api import Generator

        return Generator(plan)

    if use_ray:
        from lantern_rt.serve.ray_serve import run_on_ray

        run_on_ray(
            load,
            md.name,
            max_queue_images,
            request_timeout,
            host,
            port,
            read_timeout=read_timeout,
            replicas=replicas,
            gpu=plan.runs_on_gpu,
        )
        return
    sys.exit(
        _run_server(
            load, md.name, max_queue_images, request_timeout, read_timeout, max_connections, host, port
        )
    )


def _run_server(
    load,
    model: str,
    max_queue_images: int,
    request_timeout: float,
    read_timeout: float,
    max_connections: int,
    host: str,
    port: int,
) -> int:
    """Run uvicorn until SIGTERM or SIGINT (the requests in flight finish first): exit code 0, or
    2 when the model fails to load."""
    import uvicorn

    from lantern_rt.serve.app import ServeSettings, create_app
    from lantern_rt.serve.engine import Engine
    from lantern_rt.serve.metrics import Metrics
    from lantern_rt.serve.transport import ServerConfig

    failure: list[str] = []

    def on_failure(message: str) -> None:
        failure.append(message)
        server.should_exit = True

    engine = Engine(load, max_queue_images, Metrics(), on_failure)
    app = create_app(engine, ServeSettings(model, request_timeout, read_timeout))
    server = uvicorn.Server(ServerConfig(app, host, port, read_timeout, max_connections))
    # uvicorn re-raises the signal that stopped it once it has drained; a stop asked for is a clean exit
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: None)
    click.echo(
        f"lantern serve: {model} on http://{host}:{port} (ready once GET /health/ready is 200)", err=True
    )
    server.run()
    if failure:
        click.echo(f"error: {failure[0]}", err=True)
        return EXIT_BAD_INPUT
    return 0
