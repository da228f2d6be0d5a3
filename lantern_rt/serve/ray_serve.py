"""``lantern serve --ray``: the same app and engine as a Ray Serve deployment behind Ray Serve's
HTTP proxy: one replica per GPU, or ``replicas`` on CPUs, each with its own engine (model, decode
loop, queue and metrics).

A replica builds its engine and app when Ray starts it and passes its first health check only
once its model is loaded and warmed up, so Ray Serve sends requests to loaded replicas only and
the deployment is up when every replica is. A replica whose model fails to load or whose decode
loop fails is unhealthy, and Ray Serve replaces it.
"""

from __future__ import annotations

import asyncio
import logging
import os
import re
import signal
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import click

from lantern_rt.api import Generator
from lantern_rt.errors import UserError, first_line

APP = "lantern"
# Ray Serve's wait for its HTTP proxy actor to answer (its own default 5 s, three tries, then the
# start fails): on a local Ray on a busy CPU the proxy takes longer to start.
PROXY_READY_SECONDS = 30


def import_ray_serve() -> Any:
    """``ray.serve``, or :class:`UserError` with the install hint."""
    try:
        from ray import serve
    except ImportError:
        raise UserError("--ray needs Ray Serve: pip install 'ray[serve]' (or drop --ray)") from None
    return serve


@dataclass(frozen=True)
class ReplicaPlan:
    """How many replicas, and the Ray resources of each."""

    replicas: int
    num_cpus: float
    num_gpus: float


def plan_replicas(replicas: int | None, gpu: bool, cluster: dict[str, float]) -> ReplicaPlan:
    """On GPUs: ``replicas`` (default: one per GPU of the ``cluster``'s resources), one GPU each.
    On CPUs: ``replicas`` (default 1) sharing the cluster's CPUs evenly, at least one each."""
    if gpu:
        return ReplicaPlan(replicas or max(1, int(cluster.get("GPU", 0))), 0, 1)
    count = replicas or 1
    return ReplicaPlan(count, max(1, int(cluster.get("CPU", 1)) // count), 0)


class ReplicaFailed(RuntimeError):
    """A replica's engine failed: its model did not load, or its decode loop stopped."""


def _deploy_error(serve: Any, exc: RuntimeError) -> str:
    """One line for a deployment that failed: a replica's :class:`ReplicaFailed` message (found in
    Ray Serve's status, which quotes the replica's traceback), else Ray Serve's own."""
    app = serve.status().applications.get(APP)
    messages = [] if app is None else [d.message for d in app.deployments.values()]
    failed = re.findall(rf"{ReplicaFailed.__name__}: (.+)", "\n".join(messages))
    if failed:
        return f"a Ray Serve replica failed: {failed[-1]}"
    return f"Ray Serve could not deploy the app: {first_line(exc)}"


class _Stop(BaseException):
    """SIGTERM or SIGINT arrived (a BaseException, so that no ``except Exception`` swallows it)."""


def _raise_stop(signum: int, frame: object) -> None:
    raise _Stop


def run_on_ray(
    load: Callable[[], Generator],
    model: str,
    max_queue_images: int,
    request_timeout: float,
    host: str,
    port: int,
    read_timeout: float | None = None,
    replicas: int | None = None,
    gpu: bool | None = None,
) -> None:
    """Deploy the app on a local Ray started for the run (or on the cluster ``RAY_ADDRESS``
    names) and serve until SIGTERM or SIGINT; then the replicas finish the requests in flight,
    the deployment is deleted and a local Ray is shut down. ``read_timeout`` (None: the app's
    default) bounds a body's arrival; ``gpu`` (default: whether this machine has a CUDA device)
    puts one replica on each GPU; see :func:`plan_replicas`."""
    import ray
    import torch

    serve = import_ray_serve()
    address = os.environ.get("RAY_ADDRESS") or None
    if address is None:  # a local Ray inherits it: a loaded CPU starts the proxy in more than 5 s
        os.environ.setdefault("RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S", str(PROXY_READY_SECONDS))
    try:  # the replicas' logs stay in Ray's session folder (/tmp/ray/session_latest/logs)
        ray.init(
            address=address or "local", include_dashboard=False, log_to_driver=False, logging_level="WARNING"
        )
    except (ConnectionError, ValueError) as exc:  # RAY_ADDRESS names no cluster
        raise UserError(f"cannot join the Ray cluster RAY_ADDRESS={address}: {first_line(exc)}") from None
    logging.getLogger("ray.serve").setLevel(logging.WARNING)
    for sig in (signal.SIGTERM, signal.SIGINT):  # after ray.init, which sets its own
        signal.signal(sig, _raise_stop)
    try:
        gpu = torch.cuda.is_available() if gpu is None else gpu
        plan = plan_replicas(replicas, gpu, ray.cluster_resources())
        deployment = _deployment(serve, load, model, max_queue_images, request_timeout, read_timeout, plan)
        try:
            serve.start(http_options={"host": host, "port": port})
        except ray.exceptions.RayError as exc:  # its proxy actor died (a port taken, memory)
            raise UserError(
                f"Ray Serve could not start its HTTP proxy on {host}:{port}: {first_line(exc)} "
                "(its log: /tmp/ray/session_latest/logs)"
            ) from None
        click.echo(
            f"lantern serve: {model} on http://{host}:{port} in {plan.replicas} Ray Serve replica(s) "
            "(deploying: loading the model in each)",
            err=True,
        )
        try:
            serve.run(deployment, name=APP, route_prefix="/")
        except RuntimeError as exc:
            raise UserError(_deploy_error(serve, exc)) from None
        click.echo("lantern serve: every replica is ready", err=True)
        while True:
            signal.pause()
    except _Stop:
        pass
    finally:
        for sig in (signal.SIGTERM, signal.SIGINT):  # ignored while the replicas drain
            signal.signal(sig, signal.SIG_IGN)
        if address:
            serve.delete(APP)
        else:
            serve.shutdown()
        ray.shutdown()


def _deployment(
    serve: Any,
    load: Callable[[], Generator],
    model: str,
    max_queue_images: int,
    request_timeout: float,
    read_timeout: float | None,
    plan: ReplicaPlan,
) -> Any:
    """The bound Ray Serve deployment: replicas each running :func:`create_app` over an engine of
    their own. A replica takes as many requests at once as its queue holds images; more wait in
    Ray Serve's proxy."""

    def build_app():
        import torch

        from lantern_rt.serve.app import ServeSettings, create_app
        from lantern_rt.serve.engine import Engine
        from lantern_rt.serve.metrics import Metrics

        if not plan.num_gpus:
            torch.set_num_threads(int(plan.num_cpus))  # its share of the CPUs (--threads sets its own)
        engine = Engine(load, max_queue_images, Metrics())
        settings = ServeSettings(model, request_timeout)
        if read_timeout is not None:
            settings = replace(settings, read_timeout=read_timeout)
        app = create_app(engine, settings)
        app.state.engine = engine
        return app

    @serve.deployment(
        num_replicas=plan.replicas,
        max_ongoing_requests=max_queue_images,
        ray_actor_options={"num_cpus": plan.num_cpus, "num_gpus": plan.num_gpus},
    )
    @serve.ingress(build_app)
    class LanternReplica:
        async def check_health(self) -> None:
            """Waits until the engine is ready (the first check: the replica is up once its model
            is loaded); raises once the engine has failed."""
            engine = self.app.state.engine
            while not engine.ready.is_set() and not engine.failed:
                await asyncio.sleep(0.1)
            if engine.failed:
                raise ReplicaFailed(engine.failed)

    return LanternReplica.bind()
