"""A run's defaults and refusals, in one place: :func:`resolve` turns a source (a model directory
or a bundle) and its :class:`~lantern_rt.run_options.RunOptions` into one :class:`RunPlan`
(backend, device, method, tree, shape, sampling, whether the source is exported first), filling
in what the options leave unset and refusing what cannot run, before any work. ``lantern
generate``, ``generate-set``, ``bench`` and ``serve`` and the Python API all run plans.

Besides: the tree ``lantern export`` writes when given none (:func:`export_tree`), the CPU
threads a command may take (:func:`capped_threads`), what a run makes (:func:`requested_conditions`)
and what ``lantern calibrate`` drives a bundle with (:func:`calibration_method`).
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import TYPE_CHECKING, Any

from lantern_rt.backends import MODEL, Backend, EngineOptions, backend_named, default_backend
from lantern_rt.errors import option, warn
from lantern_rt.models.config import ConfigError
from lantern_rt.models.sampling_config import DRAW_SETTINGS, SamplingConfig
from lantern_rt.run_options import AUTO, DEFAULT_WINDOW, RunOptions, option_types
from lantern_rt.runtime.method import (
    COUPLINGS as COUPLINGS,  # the commands' choices and the tests read the methods here too
)
from lantern_rt.runtime.method import (
    CPU_DEFAULT_TREE,
    GPU_DEFAULT_TREE,
    JACOBI_METHODS,
    MethodConfig,
)
from lantern_rt.runtime.method import (
    DEFAULT_COUPLING as DEFAULT_COUPLING,
)
from lantern_rt.runtime.method import (
    METHODS as METHODS,
)
from lantern_rt.runtime.run_shape import RunShape, available_cores

if TYPE_CHECKING:  # torch-free at import: the command line reads the lists above for its --help
    from lantern_rt.bundle import Bundle
    from lantern_rt.models.model_dir import ModelDir

DEFAULT_OPSET = 18  # torch.onnx's dynamo exporter authors its ops at opset 18
MAX_SEED = 2**63 - 1  # seeds are 0..MAX_SEED (numpy's SeedSequence takes no negative entropy)
MAX_IMAGES_PER_CLASS = 1_000_000


@dataclass(frozen=True)
class RunPlan:
    """What a run does: its ``source`` (a model directory or an opened bundle), the ``backend``
    that runs it, the ``method``, how each image samples, how it decodes (``shape``), where
    (``device``) on how many CPU ``threads`` (0: the engine's choice), with steps replayed from
    CUDA graphs or compiled; ``images``, the run's length, chooses the streams of a shape whose
    streams are None. :func:`resolve` makes it from a source and its options, every setting
    checked; :func:`lantern_rt.pipeline.build_pipeline` builds its pipeline."""

    source: ModelDir | Bundle
    backend: str
    method: MethodConfig
    sampling: SamplingConfig
    shape: RunShape = RunShape()
    device: str = "cpu"
    threads: int = 0
    cuda_graphs: bool = True
    compile: bool = False
    images: int | None = None

    @cached_property
    def info(self) -> ModelDir:
        """The model's names, classes and geometry (for a bundle: rebuilt from its manifest)."""
        return _info(self.source)

    @property
    def source_is_model(self) -> bool:
        """Whether the source is a model directory (else a bundle)."""
        return _is_model(self.source)

    @property
    def record(self) -> Backend:
        """The backend's record in the registry."""
        return backend_named(self.backend)

    @property
    def exports(self) -> bool:
        """Whether its model directory is exported into the cache first (a backend that runs bundles)."""
        return self.source_is_model and MODEL not in self.record.runs

    @property
    def runs_on_gpu(self) -> bool:
        """Whether it computes on a GPU."""
        return self.record.runs_on_gpu(self.device)

    @property
    def engine(self) -> EngineOptions:
        """How the backend's engine runs beside what it runs."""
        return EngineOptions(self.device, self.threads, self.cuda_graphs, self.compile, self.images)


def resolve(
    source: ModelDir | Bundle, options: RunOptions = RunOptions(), images: int | None = None
) -> RunPlan:
    """The plan of a run of ``source`` (a model directory or an opened bundle) with ``options``,
    for ``images`` images when known (None: any number; the streams of ``streams`` None are
    chosen for it). What the options leave None gets its default: the backend from the device
    and what is installed (:func:`~lantern_rt.backends.default_backend`), the method and tree
    from this machine's tuning record (:func:`tuned_method`), else the method from whether
    there is a drafter (lantern++, else ar), the tree from the bundle (its first) or the
    backend's device (:func:`default_tree`; a Jacobi method's: the chain of its ``window``), the
    sampling from the model (:func:`default_sampling`). Every refusal of the options is raised
    here, before any work (an export, a model's weights loaded), as a :class:`ConfigError` or the
    error of the rule it breaks, naming the options as keywords."""
    check_device(options.device)
    is_bundle = not _is_model(source)
    drafter = None if options.drafter is None else str(options.drafter)
    record = backend_named(options.backend or default_backend(options.device, is_bundle, drafter is not None))
    record.check_available()  # before any export: without its engine there is nothing to run it
    info = _info(source)
    name, tree = tuned_method(source, options, record, drafter)
    method = default_method(source, name, drafter)
    if method in JACOBI_METHODS:
        tree = window_tree(method, tree, options.window, info.gpt.block_size)
    elif options.window is not None:
        raise ConfigError(
            f"{option('window')} sets the Jacobi window of {option('method')} "
            f"{' or '.join(JACOBI_METHODS)}, not {option('method', method)}"
        )
    if tree is None:
        exported = list(source.trees) if is_bundle else []
        tree = exported[0] if exported else default_tree(record.name, options.device)
    mc = MethodConfig(
        method,
        tree,
        options.lantern_k,
        options.lantern_delta,
        options.lantern_lambda,
        drafter,
        options.coupling,
    )
    mc.relaxation()  # validates k, delta and lambda
    sampling = default_sampling(info, options)
    shape = RunShape(
        options.batch_size, sampling.guided, cache_windows=options.cache_windows, streams=options.streams
    )
    plan = RunPlan(
        source,
        record.name,
        mc,
        sampling,
        shape,
        options.device,
        options.threads,
        options.cuda_graphs,
        options.compile,
        images,
    )
    _check_engine(plan, record)
    _check_source(plan)
    return plan


def tuned_method(
    source: ModelDir | Bundle, options: RunOptions, record: Backend, drafter: str | None
) -> tuple[str | None, str | None]:
    """(method, tree) of a run before the defaults: the options', ``--tree tuned`` standing for
    the tuning record's tree; for a run that names no method (or ``auto``), no tree, no window and
    no drafter, what this machine's tuning record chose for its batch size on its backend (said in
    one line; a record from another machine or version is ignored with a one-line note)."""
    from lantern_rt.tune.record import TUNED_TREE, tuned_choice, tuned_tree_spec

    method = None if options.method == AUTO else options.method
    if options.tree == TUNED_TREE:
        return method, tuned_tree_spec(source, record.name)
    if method is None and options.tree is None and options.window is None and drafter is None:
        choice = tuned_choice(source, record.name, record.package, options.batch_size)
        if choice is not None:
            print(choice.note, file=sys.stderr)
            return choice.method, choice.tree
    return method, options.tree


def method_options(method: MethodConfig) -> dict[str, Any]:
    """The run options that :func:`resolve` makes ``method`` of (its tree named: a Jacobi
    window's too)."""
    return {
        "method": method.method,
        "tree": method.tree,
        "coupling": method.coupling,
        "lantern_k": method.k,
        "lantern_delta": method.delta,
        "lantern_lambda": method.lam,
        "drafter": method.drafter,
    }


def _check_engine(plan: RunPlan, record: Backend) -> None:
    """The refusals of what the backend cannot do: another device, more streams than one,
    compiled steps (or no compiler for them)."""
    from lantern_rt.runtime.streams import stream_threads

    if record.cpu_only and not plan.device.startswith("cpu"):
        raise ConfigError(
            f"the {record.name} backend runs on the CPU, not {plan.device}: use {option('device', 'cpu')}"
        )
    streams = plan.shape.streams
    if not record.streams and streams is not None and streams > 1:
        able = " or ".join(b for b in _backends() if backend_named(b).streams)
        raise ConfigError(
            f"{option('streams')} decodes several batches at once on {able}; the {record.name} backend "
            f"decodes one stream: use {option('backend')} {able} or {option('streams', 1)}"
        )
    if streams is not None:
        stream_threads(plan.threads, streams)  # a thread each at least
    if plan.compile:
        if not record.compiles:
            raise ConfigError(
                f"{option('compile')} compiles the torch backend's decode step; {record.name} runs its "
                f"own graphs: use {option('backend', 'torch')} or {option('compile', False)}"
            )
        from lantern_rt.runtime.backends.compiled import require_compiler

        require_compiler(plan.device)


def _check_source(plan: RunPlan) -> None:
    """The refusals of what the source cannot run: a bundle that lacks the run's batch size,
    rows, drafter or tree; a model directory its family cannot generate with, or that a backend
    of bundles would export without the drafter override."""
    from lantern_rt.families.registry import family_named

    source, method = plan.source, plan.method
    if plan.source_is_model:
        if plan.exports:
            family_named(source.family).check_runnable(source)  # before the export it would finish first
            if method.drafter is not None:
                raise ConfigError(
                    f"a {option('drafter')} override runs on the torch backend (bundles hold the "
                    f"model's own drafter): use {option('backend', 'torch')}"
                )
        return
    plan.record.check_bundle()
    if method.drafter is not None:
        raise ConfigError(f"a bundle runs its own drafter: drop {option('drafter')}")
    source.batch(plan.shape.batch_size)  # refused unless exported for it
    check_guidance(plan.sampling, source.constants.guided, str(source.path))
    _check_tree(source, method)


def check_guidance(sampling: SamplingConfig, guided: bool, runner: str) -> None:
    """:class:`ConfigError` when ``sampling`` guides and ``runner`` (a bundle, a pipeline) runs
    one row per image (not ``guided``)."""
    if sampling.guided and not guided:
        raise ConfigError(
            f"CFG scale {sampling.cfg_scale} needs each image's unconditional row, and {runner} runs "
            f"one row per image (a bundle exported with --no-guidance): use {option('cfg_scale', 1)} "
            "or a bundle exported without --no-guidance"
        )


def _check_tree(bundle: Bundle, method: MethodConfig) -> None:
    """:class:`ConfigError` unless ``bundle`` holds the graphs ``method`` drafts and verifies with."""
    from lantern_rt.runtime.backends.bundle_graphs import bundle_trees, bundle_windows
    from lantern_rt.runtime.drafting import MAX_DRAFT_WIDTH
    from lantern_rt.runtime.tree import load_tree

    if method.jacobi:
        window = load_tree(method.tree, MAX_DRAFT_WIDTH)
        if window.paths not in {t.paths for t in bundle_windows(bundle).values()}:
            chain = method.tree.startswith("chain-")
            named = option("window", window.num_nodes) if chain else option("tree", method.tree)
            raise ConfigError(
                f"bundle {bundle.path} has no verify graph for {named}: export one "
                f"with 'lantern export --model MODEL_DIR --tree {method.tree} --out BUNDLE'"
            )
    elif method.method != "ar":
        if not bundle.has_drafter:
            raise ConfigError(
                f"bundle {bundle.path} has no drafter graphs: re-export a model that has a drafter"
            )
        tree = bundle_trees(bundle).get(method.tree) or load_tree(method.tree, MAX_DRAFT_WIDTH)
        if tree.paths not in {t.paths for t in bundle.trees.values()}:
            raise ConfigError(
                f"bundle {bundle.path} was not exported for {option('tree', method.tree)}; export it "
                f"with 'lantern export --tree {method.tree}'"
            )


def _is_model(source: ModelDir | Bundle) -> bool:
    from lantern_rt.models.model_dir import ModelDir

    return isinstance(source, ModelDir)


def _info(source: ModelDir | Bundle) -> ModelDir:
    from lantern_rt.families.loading import bundle_info

    return source if _is_model(source) else bundle_info(source)  # type: ignore[return-value,arg-type]


def _backends() -> tuple[str, ...]:
    from lantern_rt.backends import BACKENDS

    return tuple(BACKENDS)


def check_device(device: str, here: bool = True) -> None:
    """:class:`ConfigError` unless ``device`` names a torch device (that this machine has, when
    ``here``)."""
    import torch

    try:
        parsed = torch.device(device)
    except (RuntimeError, TypeError):
        raise ConfigError(
            f"{option('device')} {device!r} is not a torch device: use cpu, cuda or cuda:N"
        ) from None
    if not here:
        return
    if parsed.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(
            f"{option('device', device)}: this machine has no CUDA device (torch sees none); use "
            f"{option('device', 'cpu')}"
        )
    if parsed.type == "cuda" and parsed.index is not None and parsed.index >= torch.cuda.device_count():
        raise ConfigError(
            f"{option('device', device)}: this machine has {torch.cuda.device_count()} CUDA device(s)"
        )


def default_method(source: ModelDir | Bundle, method: str | None = None, drafter: str | None = None) -> str:
    """``method``, else lantern++ when the run has a drafter (the source's, or a ``drafter``
    override), else ar."""
    has_drafter = drafter is not None or (
        "drafter" in source.files if _is_model(source) else source.has_drafter  # type: ignore[union-attr]
    )
    return method or ("lantern++" if has_drafter else "ar")


def default_cfg_scale(info: ModelDir) -> float:
    """The model's ``sampling_defaults.cfg_scale``, else its family's default for its kind."""
    from lantern_rt.families.registry import family_named

    scale = info.raw.get("sampling_defaults", {}).get("cfg_scale")
    return float(scale) if scale is not None else family_named(info.family).default_cfg_scale(info.gpt)


def default_sampling(info: ModelDir, options: RunOptions = RunOptions()) -> SamplingConfig:
    """The sampling of a run over ``info`` (a model directory, or a bundle's
    :func:`~lantern_rt.families.loading.bundle_info`, which carries the model's defaults) with
    ``options``: each sampling option given (not None), else the model's ``sampling_defaults``,
    else the library's (the CFG scale: :func:`default_cfg_scale`; temperature 1, top-k 0 (off),
    top-p 1); temperature 0 when ``greedy``. :class:`~lantern_rt.models.sampling_config.SamplingError`
    for a value out of range."""

    model = info.raw.get("sampling_defaults", {})
    chosen = {
        key: kind(model[key]) if value is None else value  # JSON's 1 is a temperature of 1.0
        for key, (kind, _) in option_types().items()
        if key in DRAW_SETTINGS and ((value := getattr(options, key)) is not None or key in model)
    }
    if options.greedy:
        chosen["temperature"] = 0.0
    scale = default_cfg_scale(info) if options.cfg_scale is None else float(options.cfg_scale)
    return SamplingConfig(cfg_scale=scale, **chosen)


def default_tree(backend: str, device: str) -> str:
    """The tree of a run that names none (and has no bundle's to take): :data:`GPU_DEFAULT_TREE`
    when ``backend`` computes on a GPU, else :data:`CPU_DEFAULT_TREE`."""
    return GPU_DEFAULT_TREE if backend_named(backend).runs_on_gpu(device) else CPU_DEFAULT_TREE


def machine_device() -> str:
    """This machine's device: ``cuda`` when torch sees a CUDA device, else ``cpu``."""
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def export_tree(device: str | None = None) -> str:
    """The tree ``lantern export`` writes when given none: the one a run chooses for a model on
    ``device`` (default: :func:`machine_device`; one this machine lacks too, as a bundle may be
    exported for another) and its default backend, so that the bundle runs on that device with
    the tree a run there would have."""
    device = machine_device() if device is None else device
    check_device(device, here=False)
    return default_tree(default_backend(device, bundle=False, drafter_override=False), device)


def capped_threads(threads: int | None) -> int | None:
    """``threads`` CPU threads (0 or None: the library's choice, kept) at most the
    :func:`available_cores`, with a one-line warning when it asked for more: threads beyond the
    cores only queue on them (``--threads 64`` on two cores ran 5-8x slower than ``--threads 2``)."""
    cores = available_cores()
    if threads and threads > cores:
        warn(f"--threads {threads} is more than the {cores} CPU cores this process may use: using {cores}")
        return cores
    return threads


def window_tree(method: str, tree: str | None, window: int | None, image_tokens: int | None) -> str:
    """The tree of a Jacobi ``method``: ``tree`` when given (``chain-N`` or ``pac-K-D-N``, N
    verify tokens below the root), else ``chain-{window}`` (:data:`DEFAULT_WINDOW` when None);
    :class:`ConfigError` for both, another tree, or N outside 1..image_tokens - 1 (the image's
    first token is drawn before any window; no upper bound when ``image_tokens`` is None)."""
    if tree is not None:
        from lantern_rt.runtime.tree import TreeError, load_tree

        if window is not None:
            raise ConfigError(
                f"{option('method', method)}: give {option('window')} N or {option('tree')}, not both"
            )
        if not tree.startswith(("chain-", "pac-")):
            raise ConfigError(
                f"{option('method', method)} drafts a Jacobi window: {option('tree')} takes chain-N or "
                f"pac-K-D-N, not {tree!r}"
            )
        try:
            nodes = load_tree(tree).num_nodes
        except TreeError as exc:
            raise ConfigError(f"{option('tree', tree)}: {exc.message}") from None
        if image_tokens is not None and nodes >= image_tokens:
            raise ConfigError(
                f"{option('tree', tree)} verifies {nodes} tokens; at most {image_tokens - 1} (the image "
                f"has {image_tokens} tokens)"
            )
        return tree
    window = DEFAULT_WINDOW if window is None else window
    if isinstance(window, bool) or not isinstance(window, int) or window < 1:
        raise ConfigError(f"{option('window')} must be an integer >= 1, not {window}")
    if image_tokens is not None and window >= image_tokens:
        raise ConfigError(
            f"{option('window')} must be at most {image_tokens - 1} (the image has {image_tokens} "
            f"tokens), not {window}"
        )
    return f"chain-{window}"


def calibration_method(bundle: Bundle) -> MethodConfig:
    """What ``lantern calibrate`` drives a bundle's graphs with when given no method: a run's
    default (:func:`default_method`: lantern++ with a drafter, else ar), or sjd over the bundle's
    first chain for a bundle without a drafter whose chains have verify graphs."""
    from lantern_rt.runtime.backends.bundle_graphs import bundle_windows

    windows = bundle_windows(bundle)
    if not bundle.has_drafter and windows:
        return MethodConfig("sjd", tree=next(iter(windows)))
    return MethodConfig(default_method(bundle))


def requested_conditions(info: ModelDir, classes: Sequence[str], prompts: Sequence[str]) -> list[int | str]:
    """What a run makes, validated against the model's kind: class ids (``classes``: ids or
    names; every class when empty) for a class-conditional model, ``prompts`` for a
    text-conditional one (at least one; an empty prompt is conditioned as the model's own code
    conditions it: LlamaGen on ``</s>`` alone, not on the null caption); :class:`ConfigError`
    otherwise."""
    if info.gpt.takes_prompts:
        if classes:
            raise ConfigError(
                f"{info.name} is a text-to-image model: give --prompt or --prompts, not --class"
            )
        if not prompts:
            raise ConfigError(f"{info.name} is a text-to-image model: give --prompt TEXT or --prompts FILE")
        return list(prompts)
    if prompts:
        raise ConfigError(f"{info.name} is a class-conditional model: give --class, not --prompt/--prompts")
    specs = [s for c in classes for s in c.split(",") if s.strip()] or [
        str(i) for i in range(info.gpt.num_classes)
    ]
    return [info.class_id(s) for s in specs]
