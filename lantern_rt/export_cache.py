"""The export cache: a model directory's bundle, exported on first use for the backends that run
bundles, kept under ``$LANTERN_CACHE`` by a fingerprint of its content, written under a file
lock so that concurrent first runs export once. The one importer of :mod:`lantern_rt.export`
besides the command line."""

from __future__ import annotations

import functools
import hashlib
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from lantern_rt.bundle import BUNDLE_VERSION, MANIFEST
from lantern_rt.cache_paths import cache_folder, made_once, model_fingerprint
from lantern_rt.models.model_dir import ModelDir
from lantern_rt.runtime.drafting import MAX_DRAFT_WIDTH
from lantern_rt.runtime.run_shape import RunShape, check_batch_sizes
from lantern_rt.runtime.tree import StaticTree, load_tree, tree_to_json
from lantern_rt.version import package_version

if TYPE_CHECKING:
    from lantern_rt.settings import MethodConfig


def cache_root() -> Path:
    """Where exported bundles are cached: ``bundles/`` of the cache folder (:func:`cache_folder`)."""
    return cache_folder() / "bundles"


def cached_bundle(
    md: ModelDir,
    method: MethodConfig,
    shape: RunShape = RunShape(),
    batch_sizes: Sequence[int] = (),
    dtype: str = "fp32",
    in_place: bool = False,
    trees: Sequence[StaticTree] | None = None,
) -> Path:
    """The bundle of ``md`` for ``method``'s tree and a run ``shape``: its rows per image (two
    CFG rows or one: ``export_bundle``'s ``guided``), its cache windows and its batch size, or
    each of ``batch_sizes`` when given, exported on first use into the cache. Every method shares it: AR runs on the
    one-token step graph every bundle holds. ``in_place``: its target's steps write their K/V
    into the cache (``export_bundle``'s ``in_place``, onnxruntime on the CPU). The model is loaded and checked first: a model its
    loaders refuse writes nothing (no lock, no folder). The export holds a lock
    (``.NAME-KEY.lock``): concurrent first runs export once, the others wait and reuse it;
    :class:`WriteError` when the cache cannot be written. ``trees``: the trees to export instead of
    ``method``'s (``lantern tune``'s candidates)."""
    from lantern_rt.export.exporter import export_bundle, load_export_models

    if trees is None:
        trees = [load_tree(method.tree, MAX_DRAFT_WIDTH)] if "drafter" in md.files or method.jacobi else []
    sizes = check_batch_sizes(list(batch_sizes or [shape.batch_size]))
    guided, windows = shape.guided, shape.cache_windows
    key = hashlib.sha256(
        json.dumps(
            {
                "model": model_fingerprint(md),
                "trees": [tree_to_json(t) for t in trees],
                "dtype": dtype,
                "batch_sizes": sizes,
                "guided": guided,
                "cache_windows": windows,
                "in_place": in_place,
                "version": package_version(),
                "bundle_version": BUNDLE_VERSION,
            },
            sort_keys=True,
        ).encode()
    ).hexdigest()[:16]
    out = cache_root() / f"{md.name}-{key}"
    if (out / MANIFEST).is_file():
        return out
    models = load_export_models(md)
    export = functools.partial(  # staged_bundle removes the .tmp folders of killed runs
        export_bundle,
        md,
        out,
        trees=trees,
        dtype=dtype,
        overwrite=True,
        progress=True,
        batch_sizes=sizes,
        windows=windows,
        guided=guided,
        models=models,
        in_place=in_place,
        on_start=functools.partial(
            print, f"exporting {md.name} to {out} (once; later runs reuse it)", file=sys.stderr
        ),
    )
    return made_once(out, MANIFEST, export, f"exporting {md.name}", "export")
