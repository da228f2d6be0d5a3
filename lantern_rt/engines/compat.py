"""Every TensorRT version switch in one place (10.3 on JetPack 6, 10.x, 11.x).

Nothing here imports ``tensorrt`` at module import: :func:`require_tensorrt` does, with an install
hint when it fails. The helpers take the imported module as their first argument, so that the
rest of the package never branches on a TensorRT version.
"""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path
from types import ModuleType
from typing import Any

from lantern_rt.errors import LanternError, first_line

PRECISIONS = ("fp32", "fp16", "int8")  # from the graphs: fp32/fp16 tensors, int8 Q/DQ nodes
DEFAULT_WORKSPACE_MB = 1024
MIN_VERSION = (10, 3)  # JetPack 6.1/6.2; the name-based tensor API and strongly typed networks
INSTALL_HINT = (
    "install TensorRT with `pip install tensorrt --extra-index-url https://pypi.nvidia.com` "
    "(x86_64 and SBSA), or on a Jetson use JetPack's system package (python3-libnvinfer) from a "
    "venv made with --system-site-packages (docs/jetson.md)"
)


class EngineError(LanternError, ValueError):
    """TensorRT engines cannot be built or used: bad input, missing or mismatched plans."""


class TensorRTUnavailable(EngineError):
    """The ``tensorrt`` module cannot be imported, or is older than :data:`MIN_VERSION`."""


def require_tensorrt() -> ModuleType:
    """The ``tensorrt`` module; :class:`TensorRTUnavailable`, with the install hint, when it
    cannot be imported or is too old."""
    try:
        import tensorrt
    except ImportError as exc:  # also a wheel whose libnvinfer/libnvonnxparser is missing
        reason = first_line(exc)
        raise TensorRTUnavailable(f"TensorRT is not available ({reason}): {INSTALL_HINT}") from None
    if version_tuple(tensorrt.__version__) < MIN_VERSION:
        wanted = ".".join(map(str, MIN_VERSION))
        raise TensorRTUnavailable(
            f"TensorRT {tensorrt.__version__} is too old: lantern-rt needs {wanted} or newer; {INSTALL_HINT}"
        )
    return tensorrt


def version_tuple(version: str) -> tuple[int, ...]:
    """``"10.3.0.30"`` -> ``(10, 3, 0, 30)``; stops at the first part that is not a number."""
    parts = []
    for part in version.split("."):
        if not part.isdigit():
            break
        parts.append(int(part))
    return tuple(parts)


def network_flags(trt: ModuleType) -> int:
    """Flags for ``Builder.create_network``: STRONGLY_TYPED (TensorRT 10; accepted and ignored by
    11, where strong typing is always on) and EXPLICIT_BATCH only where the enum still has it (a
    no-op since 10). Whichever a version lacks is left out."""
    flags = 0
    for name in ("STRONGLY_TYPED", "EXPLICIT_BATCH"):
        member = getattr(trt.NetworkDefinitionCreationFlag, name, None)
        if member is not None:
            flags |= 1 << int(member)
    return flags


def set_workspace(trt: ModuleType, config: Any, workspace_mb: int) -> None:
    """Cap the builder's scratch memory (the WORKSPACE pool) at ``workspace_mb`` MiB."""
    config.set_memory_pool_limit(trt.MemoryPoolType.WORKSPACE, workspace_mb << 20)


def open_timing_cache(builder: Any, path: Path | None) -> Any:
    """A timing cache to share between the builds of one run: read from ``path`` when it exists,
    else empty. TensorRT refuses a cache from another version or GPU; an empty one is used then."""
    config = builder.create_builder_config()
    if path is not None and path.is_file():
        cache = config.create_timing_cache(path.read_bytes())
        if cache is not None and config.set_timing_cache(cache, False):
            return cache
        print(f"warning: ignoring timing cache {path} (another TensorRT version or GPU)", file=sys.stderr)
    return config.create_timing_cache(b"")


def save_timing_cache(cache: Any, path: Path) -> None:
    """Write ``cache`` to ``path`` through a temporary file, so a crash leaves the old one."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(memoryview(cache.serialize()))
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def parser_error_text(error: Any) -> str:
    """One ONNX parser error as a line: node, its operator and name where this version says
    (``node_name``/``node_operator`` are recent additions), then the description."""
    node = error.node()
    if node < 0:
        return str(error.desc())
    operator = getattr(error, "node_operator", lambda: "")()
    name = getattr(error, "node_name", lambda: "")()
    label = " ".join(part for part in (operator, repr(name) if name else "") if part)
    return f"node {node}{f' ({label})' if label else ''}: {error.desc()}"


def make_logger(trt: ModuleType) -> Any:
    """A TensorRT logger that prints warnings to stderr and keeps errors in ``.errors`` (a
    failed build returns None; the reason is only in the log)."""

    class CollectingLogger(trt.ILogger):
        def __init__(self) -> None:
            trt.ILogger.__init__(self)
            self.errors: list[str] = []

        def log(self, severity: Any, msg: str) -> None:
            if severity in (trt.ILogger.INTERNAL_ERROR, trt.ILogger.ERROR):
                self.errors.append(msg)
            elif severity == trt.ILogger.WARNING:
                print(f"tensorrt: {msg}", file=sys.stderr)

    return CollectingLogger()
