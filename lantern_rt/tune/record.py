"""The tuning record: what ``lantern tune`` measured on one machine for one model or bundle, and
what it chose per batch size, as one JSON file written atomically (a stopped tune leaves the
previous record or none, never a part). A record holds the machine it was measured on (CPU,
cores, GPU, backend and versions, :func:`this_machine`); one from another machine or version is
refused by :func:`read_record` with one line saying what differs.

Where it lives: beside a bundle (``BUNDLE/tuning.json``), or for a model directory in the export
cache's ``tuning/`` folder, by the model's name and fingerprint (:func:`model_record_path`); the
tuned tree also in a file of its own beside it (:func:`tree_file`).
"""

from __future__ import annotations

import importlib
import json
import platform
from pathlib import Path
from typing import Any

from lantern_rt.errors import LanternError
from lantern_rt.fileio import write_together
from lantern_rt.runtime.run_shape import available_cores
from lantern_rt.runtime.tree import StaticTree, TreeError, build_tree
from lantern_rt.version import package_version

FORMAT = "lantern-rt-tuning"
VERSION = 1
BUNDLE_RECORD = "tuning.json"  # beside a bundle's manifest
TUNED_TREE = "tuned"  # the name `lantern export --tree` and the record give the tuned tree
MAX_RECORD_BYTES = 16 << 20


class RecordError(LanternError, ValueError):
    """A tuning record that is corrupt, of another format, or from another machine or version."""


def bundle_record_path(bundle: Path) -> Path:
    """A bundle's record: ``BUNDLE/tuning.json``."""
    return Path(bundle) / BUNDLE_RECORD


def model_record_path(cache: Path, name: str, fingerprint: str) -> Path:
    """A model directory's record in the export cache folder ``cache`` (the parent of its
    ``bundles/``): ``tuning/NAME-FINGERPRINT16.json``."""
    return Path(cache) / "tuning" / f"{name}-{fingerprint[:16]}.json"


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


def tree_file(path: Path) -> Path:
    """The tuned tree's own JSON file beside the record at ``path`` (``NAME.tree.json``), which
    ``lantern export --tree FILE`` reads."""
    return Path(path).with_suffix(".tree.json")


def write_record(path: Path, record: dict[str, Any]) -> None:
    """Write ``record`` (the JSON of a tune) to ``path`` and its tuned tree to :func:`tree_file`,
    together and atomically: both appear whole or neither does (Ctrl-C, a full disk), their
    folder made first; a record without a tuned tree removes an older tree file."""
    body = json.dumps({"format": FORMAT, "version": VERSION, **record}, indent=1).encode()
    writes = {Path(path): lambda tmp: tmp.write_bytes(body)}
    tree = record.get("tuned_tree")
    if tree is not None:
        text = json.dumps(tree).encode()
        writes[tree_file(path)] = lambda tmp: tmp.write_bytes(text)
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    write_together(writes)
    if tree is None:
        tree_file(path).unlink(missing_ok=True)


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


def record_tree(record: dict[str, Any], path: Path | str = "the tuning record") -> StaticTree:
    """The record's tuned tree (:data:`TUNED_TREE`); :class:`RecordError` when it holds none."""
    raw = record.get("tuned_tree")
    if not isinstance(raw, dict) or not isinstance(raw.get("paths"), list):
        raise RecordError(f"{path} holds no tuned tree: its choice at every batch size is AR")
    try:
        return build_tree(raw["paths"], name=TUNED_TREE)
    except TreeError as err:
        raise RecordError(f"{path}: its tuned tree is corrupt: {err}") from None
