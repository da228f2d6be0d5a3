"""Finding a tuning record: where a model directory's or a bundle's lives, and the tuned tree
``--tree tuned`` names (:data:`~lantern_rt.tune.record.TUNED_TREE`)."""

from __future__ import annotations

from pathlib import Path

from lantern_rt.bundle import Bundle
from lantern_rt.export_cache import cache_root, model_fingerprint
from lantern_rt.models.model_dir import ModelDir
from lantern_rt.runtime.drafting import MAX_DRAFT_WIDTH
from lantern_rt.runtime.tree import StaticTree, load_tree
from lantern_rt.tune.record import (
    TUNED_TREE,
    RecordError,
    bundle_record_path,
    model_record_path,
    read_record,
    record_tree,
)


def record_path(source: ModelDir | Bundle) -> Path:
    """Where ``source``'s tuning record lives: beside a bundle, or in the export cache."""
    if isinstance(source, Bundle):
        return bundle_record_path(source.path)
    return model_record_path(cache_root().parent, source.name, model_fingerprint(source))


def tuned_tree(source: ModelDir | Bundle) -> StaticTree:
    """The tuned tree of ``source``'s tuning record (whichever machine measured it: the caller
    asked for it by name); :class:`RecordError` in one line without one."""
    path = record_path(source)
    if not path.is_file():
        name = source.path if isinstance(source, Bundle) else source.root
        raise RecordError(f"no tuning record for {name} (looked for {path}): run 'lantern tune {name}' first")
    return record_tree(read_record(path), path)


def named_tree(spec: str, source: ModelDir | Bundle) -> StaticTree:
    """The tree ``spec`` names for ``source``: :data:`TUNED_TREE` (its tuning record's, see
    :func:`tuned_tree`), else :func:`~lantern_rt.runtime.tree.load_tree`'s (a preset, chain-N,
    pac-K-D-N or a JSON file of paths)."""
    return tuned_tree(source) if spec == TUNED_TREE else load_tree(spec, MAX_DRAFT_WIDTH)
