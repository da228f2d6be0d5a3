"""Building a pipeline: what a run is built from (a model directory or a bundle) and the one
entry point that turns a run's plan (:class:`~lantern_rt.settings.RunPlan`) into a
:class:`~lantern_rt.assembly.Pipeline` on its backend, exporting a model directory into the cache
first for a backend that runs bundles."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from pathlib import Path

from lantern_rt.assembly import Pipeline
from lantern_rt.bundle import Bundle
from lantern_rt.export_cache import cached_bundle
from lantern_rt.families.loading import bundle_info, open_bundle, open_model_dir
from lantern_rt.models.model_dir import ModelDir
from lantern_rt.settings import RunPlan


def open_source(model: Path | None, bundle: Path | None) -> tuple[ModelDir, ModelDir | Bundle]:
    """(model info, what pipelines are built from): the bundle at ``bundle``, opened, or else the
    model directory ``model`` (the built-in demo when None)."""
    if bundle is None:
        md = open_model_dir(model)
        return md, md
    opened = open_bundle(bundle)
    return bundle_info(opened), opened


def exported(plan: RunPlan, batch_sizes: Sequence[int] = ()) -> RunPlan:
    """``plan`` over what its backend runs: a model directory that a backend of bundles runs is
    exported into the cache first (once; for ``batch_sizes`` when given, else the plan's), the
    rest is itself."""
    if not plan.exports:
        return plan
    in_place = plan.record.exports_in_place(plan.device)
    path = cached_bundle(plan.source, plan.method, plan.shape, batch_sizes, in_place=in_place)  # type: ignore[arg-type]
    return dataclasses.replace(plan, source=open_bundle(path))


def build_pipeline(plan: RunPlan) -> Pipeline:
    """The pipeline of ``plan``, on its backend: a model directory exported into the cache first
    for a backend that runs bundles (:func:`exported`)."""
    plan = exported(plan)
    return plan.record.build(plan.source, plan.method, plan.shape, plan.engine)
