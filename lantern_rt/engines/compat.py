"""Every difference between the TensorRT products and versions lantern-rt builds plans with, in
one place: NVIDIA's TensorRT (``trt``: 10.3 on JetPack 6, 10.x, 11.x; builds on the GPU that will
run the plans) and TensorRT for RTX (``trt-rtx``: builds ahead of time, with or without a GPU, for
the compute capabilities asked). A :class:`Flavour` record says what each one is called, how it is
installed, the network flags it takes and what it accepts.

Nothing here imports a TensorRT module at module import: :func:`require` does, with the flavour's
install hint when it fails. The helpers take the imported module as their first argument, so that
the rest of the package never branches on a TensorRT version.
"""

from __future__ import annotations

import importlib.util
import os
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

from lantern_rt.errors import LanternError, first_line

# from the graphs: fp32/fp16 tensors, int8 Q/DQ nodes, int8/int4 weight-only (block-wise DequantizeLinear)
PRECISIONS = ("fp32", "fp16", "int8", "w8a16", "w4a16")
DEFAULT_WORKSPACE_MB = 1024


class EngineError(LanternError, ValueError):
    """TensorRT engines cannot be built or used: bad input, missing or mismatched plans."""


class TensorRTUnavailable(EngineError):
    """A flavour's module cannot be imported, or is older than its :attr:`Flavour.min_version`."""


@dataclass(frozen=True)
class Flavour:
    """One TensorRT product: ``name`` (``--flavour`` and engines.json's ``flavour``), ``label``
    (for messages), the Python ``module`` and its ``min_version``, the ``install`` hint, the
    ``network_flags`` it is asked for where its version has them, whether it builds
    ``ahead_of_time`` (for target compute capabilities, no GPU needed; otherwise for the GPU it
    runs on), the compute capabilities it knows but cannot build lantern-rt's graphs for
    (``unbuildable``: capability and why) and whether it takes a ``timing_cache``."""

    name: str
    label: str
    module: str
    min_version: tuple[int, ...]
    install: str
    network_flags: tuple[str, ...]
    ahead_of_time: bool
    timing_cache: bool
    unbuildable: tuple[tuple[str, str], ...] = ()


TRT = Flavour(
    name="trt",
    label="TensorRT",
    module="tensorrt",
    min_version=(10, 3),  # JetPack 6.1/6.2; the name-based tensor API and strongly typed networks
    install="install TensorRT with `pip install tensorrt --extra-index-url https://pypi.nvidia.com` "
    "(x86_64 and SBSA), or on a Jetson use JetPack's system package (python3-libnvinfer) from a "
    "venv made with --system-site-packages (docs/jetson.md)",
    # STRONGLY_TYPED: 10.x (11 accepts and ignores it: always on); EXPLICIT_BATCH: a no-op since 10
    network_flags=("STRONGLY_TYPED", "EXPLICIT_BATCH"),
    ahead_of_time=False,
    timing_cache=True,
)
TRT_RTX = Flavour(
    name="trt-rtx",
    label="TensorRT for RTX",
    module="tensorrt_rtx_bindings",
    min_version=(1, 0),  # IBuilderConfig's compute capabilities (ahead-of-time builds)
    install="install TensorRT for RTX with `pip install 'lantern-rt[trt-rtx]'` (its two binary wheels, "
    "tensorrt-rtx-cu12-libs and tensorrt-rtx-cu12-bindings; no GPU needed to build)",
    network_flags=("STRONGLY_TYPED",),
    ahead_of_time=True,
    timing_cache=False,  # NVIDIA: a timing cache makes its build query for a GPU, and changes nothing
    unbuildable=(
        (
            "7.5",
            "it has no fp32 matrix products for Turing, and every bundle keeps some in fp32 (the output "
            "head, the VQ decoder)",
        ),
    ),
)
FLAVOURS = {flavour.name: flavour for flavour in (TRT, TRT_RTX)}


def flavour_named(name: str) -> Flavour:
    """The flavour called ``name``; :class:`EngineError` listing the known ones."""
    if name not in FLAVOURS:
        raise EngineError(f"unknown TensorRT flavour {name!r}: choose {' or '.join(FLAVOURS)}")
    return FLAVOURS[name]


def is_installed(flavour: Flavour) -> bool:
    """Whether ``flavour``'s module can be found here (without importing it)."""
    if flavour.module in sys.modules:  # None there: an import that is known to fail
        return sys.modules[flavour.module] is not None
    return importlib.util.find_spec(flavour.module) is not None


def installed_flavours() -> list[Flavour]:
    """The flavours whose module can be found here, TensorRT's first."""
    return [flavour for flavour in FLAVOURS.values() if is_installed(flavour)]


def no_tensorrt_hint() -> str:
    """What to install when no flavour is."""
    return f"no TensorRT is installed: {TRT.install}; or, to build for RTX GPUs, {TRT_RTX.install}"


def choose_flavour(requested: str | None) -> Flavour:
    """``requested`` (a name), or the one installed flavour; :class:`TensorRTUnavailable` when
    none is, :class:`EngineError` when both are and none was asked for."""
    if requested is not None:
        return flavour_named(requested)
    found = installed_flavours()
    if not found:
        raise TensorRTUnavailable(no_tensorrt_hint())
    if len(found) > 1:
        names = " or ".join(f"--flavour {flavour.name}" for flavour in found)
        raise EngineError(
            f"both {' and '.join(flavour.label for flavour in found)} are installed: choose one with {names}"
        )
    return found[0]


def require(flavour: Flavour = TRT) -> ModuleType:
    """``flavour``'s module; :class:`TensorRTUnavailable`, with its install hint, when it cannot
    be imported or is too old."""
    try:
        module = importlib.import_module(flavour.module)
    except ImportError as exc:  # also a wheel whose native libraries are missing
        raise TensorRTUnavailable(
            f"{flavour.label} is not available ({first_line(exc)}): {flavour.install}"
        ) from None
    if version_tuple(module.__version__) < flavour.min_version:
        wanted = ".".join(map(str, flavour.min_version))
        raise TensorRTUnavailable(
            f"{flavour.label} {module.__version__} is too old: lantern-rt needs {wanted} or newer; "
            f"{flavour.install}"
        )
    return module


def require_tensorrt() -> ModuleType:
    """The module of the first installed flavour (the tensorrt backend's check that it can run);
    :class:`TensorRTUnavailable` naming both install hints when none is."""
    found = installed_flavours()
    if not found:
        raise TensorRTUnavailable(no_tensorrt_hint())
    return require(found[0])


def version_tuple(version: str) -> tuple[int, ...]:
    """``"10.3.0.30"`` -> ``(10, 3, 0, 30)``; stops at the first part that is not a number."""
    parts = []
    for part in version.split("."):
        if not part.isdigit():
            break
        parts.append(int(part))
    return tuple(parts)


def network_flags(trt: ModuleType, flavour: Flavour = TRT) -> int:
    """Flags for ``Builder.create_network``: ``flavour``'s, each where this version's enum has it."""
    flags = 0
    for name in flavour.network_flags:
        member = getattr(trt.NetworkDefinitionCreationFlag, name, None)
        if member is not None:
            flags |= 1 << int(member)
    return flags


def supported_capabilities(trt: ModuleType, flavour: Flavour) -> list[str]:
    """The compute capabilities an ahead-of-time flavour builds lantern-rt's graphs for: those of
    its enum (``SM86`` -> ``"8.6"``, ``SM120`` -> ``"12.0"``) but its ``unbuildable`` ones, in
    ascending order."""
    found = [
        name[2:] for name in trt.ComputeCapability.__members__ if name[:2] == "SM" and name[2:].isdigit()
    ]
    unbuildable = dict(flavour.unbuildable)
    ccs = [f"{digits[:-1]}.{digits[-1]}" for digits in sorted(found, key=int)]
    return [cc for cc in ccs if cc not in unbuildable]


def target_capabilities(trt: ModuleType, flavour: Flavour, requested: Sequence[str] | None) -> list[str]:
    """The compute capabilities to build for: ``requested`` (checked; repeats dropped, ascending)
    or, by default, every one the flavour builds lantern-rt's graphs for. [] for a flavour that
    builds for the GPU it runs on, which takes none."""
    if not flavour.ahead_of_time:
        if requested:
            raise EngineError(
                f"{flavour.label} builds for the GPU it runs on and takes no --compute-capability: "
                f"drop it, or build ahead of time with --flavour {TRT_RTX.name}"
            )
        return []
    supported = supported_capabilities(trt, flavour)
    if not requested:
        return supported
    for cc in requested:
        why = dict(flavour.unbuildable).get(cc)
        if why is not None:
            raise EngineError(
                f"{flavour.label} {trt.__version__} cannot build lantern-rt's graphs for compute "
                f"capability {cc}: {why}; leave it out"
            )
        if cc not in supported:
            raise EngineError(
                f"{flavour.label} {trt.__version__} cannot build for compute capability {cc!r}: "
                f"choose from {', '.join(supported)}"
            )
    return sorted(set(requested), key=version_tuple)


def set_capabilities(trt: ModuleType, config: Any, capabilities: Sequence[str]) -> None:
    """Make ``config`` build for these compute capabilities (``"8.6"`` -> ``SM86``)."""
    config.num_compute_capabilities = len(capabilities)
    for i, cc in enumerate(capabilities):
        config.set_compute_capability(getattr(trt.ComputeCapability, "SM" + cc.replace(".", "")), i)


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
    """A TensorRT logger that prints each warning once to stderr and keeps errors in ``.errors``
    (a failed build returns None; the reason is only in the log)."""

    class CollectingLogger(trt.ILogger):
        def __init__(self) -> None:
            trt.ILogger.__init__(self)
            self.errors: list[str] = []
            self.warned: set[str] = set()  # each warning is printed once (the parser's repeat per graph)

        def log(self, severity: Any, msg: str) -> None:
            if severity in (trt.ILogger.INTERNAL_ERROR, trt.ILogger.ERROR):
                self.errors.append(msg)
            elif severity == trt.ILogger.WARNING and msg not in self.warned:
                self.warned.add(msg)
                print(f"tensorrt: {msg}", file=sys.stderr)

    return CollectingLogger()
