"""The tuning record: what ``lantern tune`` measured on one machine for one model or bundle, and
what it chose per batch size, as one JSON file written atomically (a stopped tune leaves the
previous record or none, never a part). A record holds the machine it was measured on (CPU,
cores, GPU, backend and versions, :func:`this_machine`); one from another machine or version is
refused by :func:`read_record` with one line saying what differs.

Where it lives (:func:`record_path`): one file per backend, beside a bundle
(``BUNDLE/tuning.json``), or for a model directory in the cache folder's ``tuning/``, by the
model's name and fingerprint, the backend's name before ``.json`` for every backend but
onnxruntime (whose records were the only ones before); each tuned tree also in a file of its own
beside it (:func:`tree_file`). What reads it: a run that names no
method and no tree (:func:`tuned_choice`, the run's ``auto`` method), ``--tree tuned``
(:func:`tuned_tree_spec`, :func:`named_tree`) and ``lantern export`` with no ``--tree``
(:func:`export_trees`).
"""

from __future__ import annotations

import importlib
import json
import platform
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lantern_rt.bundle import Bundle
from lantern_rt.cache_paths import cache_folder, model_fingerprint
from lantern_rt.errors import LanternError, warn
from lantern_rt.fileio import write_together
from lantern_rt.models.model_dir import ModelDir
from lantern_rt.runtime.drafting import MAX_DRAFT_WIDTH
from lantern_rt.runtime.method import METHODS
from lantern_rt.runtime.run_shape import available_cores
from lantern_rt.runtime.tree import StaticTree, TreeError, build_tree, load_tree
from lantern_rt.version import package_version

FORMAT = "lantern-rt-tuning"
VERSION = 1
BUNDLE_RECORD = "tuning.json"  # beside a bundle's manifest
# The backend whose record's name holds no backend: onnxruntime's records are where they were
# before records were kept per backend
UNKEYED_BACKEND = "onnxruntime"
TUNED_TREE = "tuned"  # the name `lantern export --tree` and the record give the tuned tree
MAX_RECORD_BYTES = 16 << 20


class RecordError(LanternError, ValueError):
    """A tuning record that is corrupt, of another format, or from another machine or version."""


def record_path(source: ModelDir | Bundle, backend: str) -> Path:
    """Where ``source``'s tuning record of ``backend`` lives: ``BUNDLE/tuning.json`` beside a
    bundle's manifest, or ``tuning/NAME-FINGERPRINT16.json`` in the cache folder for a model
    directory; ``tuning.BACKEND.json`` and ``NAME-FINGERPRINT16.BACKEND.json`` for a backend
    other than :data:`UNKEYED_BACKEND` (a tune of one backend leaves another's record be)."""
    key = "" if backend == UNKEYED_BACKEND else f".{backend}"
    if isinstance(source, Bundle):
        return source.path / f"{Path(BUNDLE_RECORD).stem}{key}.json"
    return cache_folder() / "tuning" / f"{source.name}-{model_fingerprint(source)[:16]}{key}.json"


def cpu_name() -> str:
    """This machine's CPU model (``/proc/cpuinfo``'s model name where there is one)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def gpu_name() -> str | None:
    """The first CUDA device's name, None without one."""
    import torch

    return torch.cuda.get_device_name(0) if torch.cuda.is_available() else None


def backend_version(package: str) -> str:
    """The version of the Python package a backend runs on."""
    try:
        return str(getattr(importlib.import_module(package), "__version__", "unknown"))
    except ImportError:
        return "not installed"


def this_machine(backend: str, package: str) -> dict[str, Any]:
    """What a record's measurements hold for: this machine's CPU, the cores this process may
    use, its GPU, the ``backend`` measured (on Python package ``package``) and the versions."""
    import torch

    return {
        "cpu": cpu_name(),
        "cores": available_cores(),
        "gpu": gpu_name(),
        "backend": backend,
        "versions": {
            "lantern_rt": package_version(),
            package: backend_version(package),
            "torch": torch.__version__.split("+")[0],
        },
    }


def differences(recorded: dict[str, Any], here: dict[str, Any]) -> list[str]:
    """What differs between a record's machine and ``here`` (:func:`this_machine`), in words."""
    found = [
        f"{key} {recorded.get(key)!r} (here {here[key]!r})"
        for key in ("cpu", "cores", "gpu", "backend")
        if recorded.get(key) != here[key]
    ]
    versions = recorded.get("versions") if isinstance(recorded.get("versions"), dict) else {}
    found += [
        f"{name} {versions.get(name)} (here {version})"
        for name, version in here["versions"].items()
        if versions.get(name) != version
    ]
    return found


def tree_file(path: Path, name: str = TUNED_TREE) -> Path:
    """The tuned tree ``name``'s own JSON file beside the record at ``path``
    (``RECORD.NAME.json``), which ``lantern export --tree FILE`` and a run's tree read."""
    path = Path(path)
    return path.with_name(f"{path.stem}.{name}.json")


def write_record(path: Path, record: dict[str, Any]) -> None:
    """Write ``record`` (the JSON of a tune) to ``path`` and each of its ``tuned_trees`` to its
    :func:`tree_file`, together and atomically: all appear whole or none does (Ctrl-C, a full
    disk), their folder made first; the tree files of an older record that this one lacks are
    removed after."""
    path = Path(path)
    body = json.dumps({"format": FORMAT, "version": VERSION, **record}, indent=1).encode()
    writes: dict[Path, Callable[[Path], object]] = {path: lambda tmp: tmp.write_bytes(body)}
    for name, paths in (record.get("tuned_trees") or {}).items():
        text = json.dumps({"name": name, "paths": paths}).encode()
        writes[tree_file(path, name)] = lambda tmp, text=text: tmp.write_bytes(text)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_together(writes)
    for old in path.parent.glob(f"{path.stem}.{TUNED_TREE}*.json"):
        if old not in writes:
            old.unlink(missing_ok=True)


def read_record(path: Path, here: dict[str, Any] | None = None) -> dict[str, Any]:
    """The record at ``path``, checked: JSON of this format and version with a machine, and (when
    ``here`` is given, :func:`this_machine`) measured on this machine and versions;
    :class:`RecordError` in one line otherwise."""
    try:
        if Path(path).stat().st_size > MAX_RECORD_BYTES:
            raise RecordError(f"tuning record {path} is over {MAX_RECORD_BYTES >> 20} MiB: not a record")
        data = json.loads(Path(path).read_bytes().decode("utf-8"))
    except OSError as err:
        raise RecordError(f"cannot read tuning record {path}: {err.strerror or err}") from None
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError):
        raise RecordError(f"tuning record {path} is corrupt (not JSON): run lantern tune again") from None
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise RecordError(f"{path} is not a tuning record (no format {FORMAT!r})")
    if data.get("version") != VERSION:
        raise RecordError(
            f"tuning record {path} is of version {data.get('version')!r}, this lantern-rt reads "
            f"{VERSION}: run lantern tune again"
        )
    if not isinstance(data.get("machine"), dict) or not isinstance(data.get("batch_sizes"), dict):
        raise RecordError(
            f"tuning record {path} is corrupt (no machine or batch sizes): run lantern tune again"
        )
    if here is not None and (diff := differences(data["machine"], here)):
        raise RecordError(
            f"tuning record {path} was measured on another machine or version: {'; '.join(diff)}"
        )
    return data


def record_tree(record: dict[str, Any], path: Path | str, name: str = TUNED_TREE) -> StaticTree:
    """The record's tuned tree ``name``; :class:`RecordError` when it holds none."""
    trees = record.get("tuned_trees")
    raw = trees.get(name) if isinstance(trees, dict) else None
    if not isinstance(raw, list):
        raise RecordError(f"{path} holds no tuned tree {name!r}: its choice at every batch size is AR")
    try:
        return build_tree(raw, name=name)
    except TreeError as err:
        raise RecordError(f"{path}: its tuned tree {name!r} is corrupt: {err}") from None


def tuned_tree_spec(source: ModelDir | Bundle, backend: str) -> str:
    """What ``--tree tuned`` stands for in a run of ``source`` on ``backend``: the tuned tree's
    file beside that backend's record (whichever machine measured it: the tree was asked for by
    name); :class:`RecordError` in one line without a record or a tuned tree."""
    path = record_path(source, backend)
    if not path.is_file():
        name = source.path if isinstance(source, Bundle) else source.root
        raise RecordError(
            f"no {backend} tuning record for {name} (looked for {path}): run "
            f"'lantern tune {name} --backend {backend}' first"
        )
    record_tree(read_record(path), path)  # it holds one, whole
    return str(tree_file(path))


def named_tree(spec: str, source: ModelDir | Bundle, backend: str) -> StaticTree:
    """The tree ``spec`` names for ``source`` on ``backend``: :data:`TUNED_TREE` (its record's,
    see :func:`tuned_tree_spec`), else :func:`~lantern_rt.runtime.tree.load_tree`'s (a preset,
    chain-N, pac-K-D-N or a JSON file of paths)."""
    if spec == TUNED_TREE:
        return load_tree(tuned_tree_spec(source, backend), MAX_DRAFT_WIDTH)
    return load_tree(spec, MAX_DRAFT_WIDTH)


@dataclass(frozen=True)
class TunedChoice:
    """What the record of this machine chose for a batch size: the method (``ar`` included), the
    tree as a run names it (None for AR), and what was measured, for the run's one line."""

    method: str
    tree: str | None
    note: str


def _here_record(source: ModelDir | Bundle, backend: str, package: str) -> tuple[Path, dict[str, Any]] | None:
    """``source``'s record when it was measured here on ``backend``; None without one, or (with
    a one-line note) for one from another machine or version, or a corrupt one."""
    path = record_path(source, backend)
    if not path.is_file():
        return None
    try:
        record = read_record(path)
    except RecordError as err:
        warn(f"ignored: {err.message}")
        return None
    if record["machine"].get("backend") != backend:
        return None  # a tune of another backend says nothing of this one's runs
    if diff := differences(record["machine"], this_machine(backend, package)):
        warn(
            f"ignored: the tuning record {path} was measured on another machine or version: {'; '.join(diff)}"
        )
        return None
    return path, record


def tuned_choice(
    source: ModelDir | Bundle, backend: str, package: str, batch_size: int
) -> TunedChoice | None:
    """The choice of ``source``'s tuning record for ``batch_size`` images per step on ``backend``
    (its Python ``package``) on this machine: None without a record for here (a note says why
    one is ignored) or without that batch size in it (a note names those it has)."""
    found = _here_record(source, backend, package)
    if found is None:
        return None
    path, record = found
    entry = record["batch_sizes"].get(str(batch_size))
    choice = entry.get("choice") if isinstance(entry, dict) else None
    if not isinstance(choice, dict):
        tuned = ", ".join(record["batch_sizes"])
        warn(
            f"the tuning record {path} has no choice for batch size {batch_size} (tuned: {tuned}): "
            "today's defaults"
        )
        return None
    try:
        if choice.get("method") not in METHODS:
            raise RecordError(f"tuning record {path} chose an unknown method {choice.get('method')!r}")
        spec = None if choice.get("tree") is None else _run_spec(source, path, record, choice["tree"])
        if spec is not None and not isinstance(source, Bundle):
            load_tree(spec, MAX_DRAFT_WIDTH)  # loadable, before the run exports it
    except (RecordError, TreeError) as err:
        warn(f"ignored: {err.message}")
        return None
    measured = choice.get("measured_s_per_image")
    note = (
        f"the tuning record of this machine ({path}) chose {choice.get('label')} at batch size "
        f"{batch_size}" + (f" ({measured:.3g} s/image measured)" if isinstance(measured, float) else "")
    )
    return TunedChoice(choice["method"], spec, note)


def _run_spec(source: ModelDir | Bundle, path: Path, record: dict[str, Any], tree: dict[str, Any]) -> str:
    """How a run names the chosen ``tree`` ({name, paths}): a bundle's own tree by its name, a
    tuned tree by its file, a named one by its name."""
    if not isinstance(tree, dict) or not isinstance(tree.get("paths"), list):
        raise RecordError(f"tuning record {path} is corrupt (a choice's tree): run lantern tune again")
    paths = build_tree(tree["paths"]).paths
    if isinstance(source, Bundle):
        from lantern_rt.runtime.backends.bundle_graphs import bundle_trees

        named = [name for name, t in bundle_trees(source).items() if t.paths == paths]
        if not named:
            raise RecordError(f"{path} chose a tree the bundle {source.path} lacks: run lantern tune again")
        return named[0]
    name = str(tree.get("name"))
    return str(tree_file(path, name)) if name in (record.get("tuned_trees") or {}) else name


def export_trees(md: ModelDir, backend: str, package: str) -> list[StaticTree]:
    """The trees ``lantern export`` writes for ``md`` when given none, on a machine whose tuning
    record (of ``backend``) chose speculation at some batch size: those chosen trees (a note
    says so); else [] (the export's own default)."""
    found = _here_record(md, backend, package)
    if found is None:
        return []
    path, record = found
    trees: dict[tuple, StaticTree] = {}
    try:
        for size in record["batch_sizes"].values():
            choice = size.get("choice") if isinstance(size, dict) else None
            tree = choice.get("tree") if isinstance(choice, dict) else None
            if tree is not None:
                loaded = load_tree(_run_spec(md, path, record, tree), MAX_DRAFT_WIDTH)
                trees.setdefault(loaded.paths, loaded)
    except (RecordError, TreeError) as err:
        warn(f"ignored: the tuning record {path}: {err.message}")
        return []
    if trees:
        print(
            f"exporting the trees the tuning record of this machine ({path}) chose: "
            f"{', '.join(t.name for t in trees.values())}",
            file=sys.stderr,
        )
    return list(trees.values())
