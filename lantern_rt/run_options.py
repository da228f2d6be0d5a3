"""The run options: every option of a run declared once, with its type, default, help and
constraints (:class:`RunOptions`), as vLLM declares its engine's in ``EngineArgs``.

``lantern_rt.load`` takes them as keywords; ``lantern generate``, ``generate-set``, ``bench`` and
``serve`` take them as flags made from these declarations (:mod:`lantern_rt.cli.options`); and
:func:`lantern_rt.settings.resolve` turns them and a source into a run's plan, as vLLM's
``create_engine_config`` does. Torch-free: the command line reads them for its --help.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import types
import typing
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lantern_rt.backends import BACKENDS
from lantern_rt.errors import option
from lantern_rt.models.config import ConfigError
from lantern_rt.runtime.method import COUPLINGS, DEFAULT_COUPLING, METHODS
from lantern_rt.runtime.run_shape import (
    AUTO_STREAMS_MAX,
    CACHE_WINDOWS,
    MAX_BATCH_SIZE,
    MAX_CACHE_WINDOWS,
    MAX_STREAMS,
)

DEFAULT_WINDOW = 5  # a Jacobi window's draft positions, when neither window nor tree is given
AUTO = "auto"  # the method of a run that names none: its tuning record's choice, else the defaults


@dataclass(frozen=True)
class Declaration:
    """What an option is besides its name, type and default: its ``help``; the values it may
    take (``choices``, or a function that lists them when asked: the registry's backends), and
    the bounds of a number; ``auto``: None is a value of its own, said ``auto``; ``samples``:
    it says how each image samples (the others say how the run decodes)."""

    help: str
    choices: tuple[str, ...] | Callable[[], tuple[str, ...]] | None = None
    minimum: float | None = None
    maximum: float | None = None
    auto: bool = False
    samples: bool = False

    def allowed(self) -> tuple[str, ...] | None:
        """The values it takes when they are listed (None: any of its type)."""
        return self.choices() if callable(self.choices) else self.choices


def declared(default: Any, help: str, **constraints: Any) -> Any:
    """A field of :class:`RunOptions`: its default and its :class:`Declaration`."""
    return field(default=default, metadata={"declaration": Declaration(help, **constraints)})


def _backends() -> tuple[str, ...]:
    return tuple(BACKENDS)


@dataclass(frozen=True)
class RunOptions:
    """The options of a run, each checked against its declaration; what is None gets its default
    from :func:`lantern_rt.settings.resolve`, from the source and the machine."""

    cfg_scale: float | None = declared(
        None,
        "Classifier-free guidance scale s in u + s*(c - u). Default: the model's (3.0 for the demo).",
        samples=True,
    )
    temperature: float | None = declared(
        None,
        "Sampling temperature; 0 means greedy. Default: the model's sampling_defaults, else 1.0.",
        samples=True,
    )
    top_k: int | None = declared(
        None,
        "Keep the k most likely tokens (0 = off). Default: the model's sampling_defaults, else 0.",
        samples=True,
    )
    top_p: float | None = declared(
        None,
        "Nucleus sampling mass in (0, 1]. Default: the model's sampling_defaults, else 1.0.",
        samples=True,
    )
    greedy: bool = declared(False, "Greedy decoding (same as a temperature of 0).", samples=True)
    method: str | None = declared(
        None,
        "Decoding method: plain autoregressive, exact speculative, or relaxed (LANTERN, LANTERN++); "
        "sjd and sjd++ need no drafter: a Jacobi window drafted from the target's own distributions, "
        "exact or with LANTERN++'s neighbour credit. Default: auto: with no tree given, the method and "
        "tree this machine's tuning record chose for the batch size ('lantern tune'; AR where "
        "speculation did not pay), else lantern++ when the model has a drafter, else ar.",
        choices=(*METHODS, AUTO),
    )
    tree: str | None = declared(
        None,
        "Static draft tree: naive_extend_57, mc_sim_7b_63, chain-N, tuned (the tree 'lantern tune' chose), "
        "or a JSON file of paths (sjd, sjd++: "
        "chain-N or pac-K-D-N). Default: the bundle's first tree, else chain-5 on a CPU (a tree's cost "
        "grows with its size there; measured best in BENCHMARKS.md), naive_extend_57 on a GPU "
        "(tensorrt, or a CUDA device).",
    )
    window: int | None = declared(
        None,
        "Draft positions per step of sjd or sjd++ (a chain of N; a bundle needs 'lantern export "
        "--tree chain-N'; a tree pac-K-D-N instead: K candidates per position down to depth D, N "
        f"verify tokens). Default: {DEFAULT_WINDOW}.",
    )
    coupling: str | None = declared(
        None,
        "How sjd or sjd++ draws a position's draft from one call to the next: maximal (keep the last "
        "draft where a test allows), gumbel (the position's Gumbel noise kept), none (afresh); all "
        f"exact. Default: {DEFAULT_COUPLING}.",
        choices=COUPLINGS,
    )
    lantern_k: int = declared(10, "Latent neighbours per drafted token.")
    lantern_delta: float = declared(0.1, "LANTERN TV budget in [0, 1].")
    lantern_lambda: float = declared(5.0, "LANTERN++ cap lambda >= 1.")
    drafter: Path | None = declared(
        None, "Drafter folder (EAGLE layout: config.json + weights). Default: the model's own."
    )
    backend: str | None = declared(
        None,
        "Runtime backend. Default on a CPU: onnxruntime (a model directory is exported once into "
        "$LANTERN_CACHE or ~/.cache/lantern-rt); torch for another device or a drafter override. "
        "tensorrt runs a bundle's plans from 'lantern build-engines'.",
        choices=_backends,
    )
    device: str = declared(
        "cpu",
        "Where the run computes (cpu, cuda or cuda:N): the torch backend's device, and what the "
        "default backend and tree are chosen for.",
    )
    cuda_graphs: bool = declared(
        True, "Replay each step from a captured CUDA graph (torch on a CUDA device, tensorrt)."
    )
    compile: bool = declared(
        False,
        "Compile each whole decode step with torch.compile (inductor, fullgraph: a graph break is an "
        "error; torch backend only), once per run: the compile time is reported once (stats "
        "compile_seconds). Off by default: on a CPU at demo size the compiled step is 1.2-1.6x faster "
        "per call, but its compile (minutes) outweighs that below hundreds of images (BENCHMARKS.md, "
        "'Issue 47: compiled torch path'); unmeasured on a GPU. Needs a C++ compiler (CPU) or Triton "
        "(GPU).",
    )
    threads: int = declared(
        0,
        "CPU threads (0: the library default; generate-set: per worker, 1 per Ray actor by default).",
        minimum=0,
    )
    batch_size: int = declared(
        1,
        "Images decoded together per step; the tokens do not depend on it (a bundle must hold graphs "
        "for it: lantern export --batch-size).",
        minimum=1,
        maximum=MAX_BATCH_SIZE,
    )
    cache_windows: int = declared(
        CACHE_WINDOWS,
        "Windows of the KV cache a target step reads (docs/method.md §12): the step graphs per batch "
        "size a model directory's first-use export writes (1: the fastest export, every step over the "
        "whole cache), and the torch backend's; the tokens do not depend on it. A bundle keeps the "
        "windows it was exported with (lantern export --cache-windows).",
        minimum=1,
        maximum=MAX_CACHE_WINDOWS,
    )
    streams: int | None = declared(
        1,
        "Batches decoded at once on the CPU (onnxruntime, openvino), each on its share of the "
        "threads: more images per second when there are several to make; one image's time is "
        f"unchanged. auto: one per thread (threads 0: per core), at most {AUTO_STREAMS_MAX} and the "
        "batches to make; one on a GPU or another backend.",
        minimum=1,
        maximum=MAX_STREAMS,
        auto=True,
    )

    def __post_init__(self) -> None:
        for name, kind in option_types().items():
            _check(name, kind, getattr(self, name), declaration(name))

    @classmethod
    def of(cls, given: Mapping[str, Any]) -> RunOptions:
        """The options among ``given`` (a command's parameters: the others are left out)."""
        return cls(**{name: value for name, value in given.items() if name in option_types()})


def sampling_options() -> tuple[str, ...]:
    """The options that say how each image samples, in the order declared."""
    return tuple(name for name in option_types() if declaration(name).samples)


def declaration(name: str) -> Declaration:
    """Option ``name``'s declaration."""
    return {f.name: f.metadata["declaration"] for f in dataclasses.fields(RunOptions)}[name]


@functools.cache
def option_types() -> dict[str, tuple[type, bool]]:
    """Each option's (type, whether None is a value), in the order declared."""
    hints = typing.get_type_hints(RunOptions)
    kinds = {}
    for f in dataclasses.fields(RunOptions):
        args = typing.get_args(hints[f.name]) if isinstance(hints[f.name], types.UnionType) else ()
        plain = [a for a in args if a is not type(None)] or [hints[f.name]]
        kinds[f.name] = (plain[0], type(None) in args)
    return kinds


def _check(name: str, kind: tuple[type, bool], value: Any, rule: Declaration) -> None:
    """:class:`ConfigError` naming option ``name`` unless ``value`` is of its type and within its
    constraints."""
    base, nullable = kind
    if value is None and nullable:
        return
    expected = {bool: "True or False", int: "an integer", float: "a number", str: "a string"}
    fits = {
        bool: isinstance(value, bool),
        int: isinstance(value, int) and not isinstance(value, bool),
        float: isinstance(value, int | float) and not isinstance(value, bool),
        str: isinstance(value, str),
        Path: isinstance(value, str | os.PathLike),
    }[base]
    if not fits:
        raise ConfigError(f"{option(name)} must be {expected.get(base, 'a path')}, got {value!r}")
    allowed = rule.allowed()
    if allowed is not None and value not in allowed:
        raise ConfigError(f"unknown {name} {value!r}; choose from {', '.join(allowed)}"[:300])
    low, high = rule.minimum, rule.maximum
    if (low is not None and value < low) or (high is not None and value > high):
        bounds = f">= {low}" if high is None else f"in {low}..{high}"
        raise ConfigError(f"{option(name)} must be {bounds}, got {value!r}")
