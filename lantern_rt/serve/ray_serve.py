"""``lantern serve --ray``: the same app and engine as a Ray Serve deployment, one replica per
GPU (or one on a CPU), behind Ray Serve's HTTP proxy."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from lantern_rt.api import Generator
from lantern_rt.errors import UserError


def import_ray_serve() -> Any:
    """``ray.serve``, or :class:`UserError` with the install hint."""
    try:
        from ray import serve
    except ImportError:
        raise UserError("--ray needs Ray Serve: pip install 'ray[serve]' (or drop --ray)") from None
    return serve


def run_on_ray(
    load: Callable[[], Generator],
    model: str,
    max_queue_images: int,
    request_timeout: float,
    host: str,
    port: int,
) -> None:
    """Deploy the app on a local Ray (or the cluster ``RAY_ADDRESS`` names) and block."""
    import ray
    import torch

    from lantern_rt.serve.app import ServeSettings, create_app
    from lantern_rt.serve.engine import Engine
    from lantern_rt.serve.metrics import Metrics

    serve = import_ray_serve()
    engine = Engine(load, max_queue_images, Metrics())
    app = create_app(engine, ServeSettings(model, request_timeout))

    @serve.deployment(
        num_replicas=max(1, torch.cuda.device_count()),
        ray_actor_options={"num_gpus": 1 if torch.cuda.is_available() else 0},
    )
    @serve.ingress(app)
    class LanternDeployment:
        pass

    ray.init(ignore_reinit_error=True)
    serve.start(http_options={"host": host, "port": port})
    serve.run(LanternDeployment.bind(), blocking=True)
