"""What a run is asked to do, and the application defaults, in one place.

:func:`run_defaults`: the backend (from the backend registry, :mod:`lantern_rt.backends`), method,
tree and sampling (CFG scale, temperature, top-k, top-p) a run gets for what it left unset; the
tree ``lantern export`` writes when given none (:func:`export_tree`); the CPU threads a run may
take (:func:`capped_threads`). ``lantern generate``, ``generate-set``, ``bench``, ``export`` and
``calibrate`` (and the Python API) all resolve their settings here, so they agree.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from lantern_rt.backends import backend_named, default_backend, runs_on_gpu
from lantern_rt.errors import warn
from lantern_rt.models.config import ConfigError
from lantern_rt.runtime.method import (  # the commands' choices and the tests read the methods here too
    COUPLINGS as COUPLINGS,
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
from lantern_rt.runtime.run_shape import available_cores

if TYPE_CHECKING:  # torch-free at import: the command line reads the lists below for its --help
    from lantern_rt.bundle import Bundle
    from lantern_rt.models.model_dir import ModelDir
    from lantern_rt.runtime.sampling import SamplingConfig

DEFAULT_WINDOW = 5  # a Jacobi window's draft positions, when neither window nor tree is given
DEFAULT_OPSET = 18  # torch.onnx's dynamo exporter authors its ops at opset 18
MAX_SEED = 2**63 - 1  # seeds are 0..MAX_SEED (numpy's SeedSequence takes no negative entropy)
MAX_IMAGES_PER_CLASS = 1_000_000


def check_device(device: str, here: bool = True) -> None:
    """:class:`ConfigError` unless ``device`` names a torch device (that this machine has, when
    ``here``)."""
    import torch

    try:
        parsed = torch.device(device)
    except (RuntimeError, TypeError):
        raise ConfigError(f"--device {device!r} is not a torch device: use cpu, cuda or cuda:N") from None
    if not here:
        return
    if parsed.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(
            f"--device {device}: this machine has no CUDA device (torch sees none); use --device cpu"
        )
    if parsed.type == "cuda" and parsed.index is not None and parsed.index >= torch.cuda.device_count():
        raise ConfigError(f"--device {device}: this machine has {torch.cuda.device_count()} CUDA device(s)")


@dataclass(frozen=True)
class RunDefaults:
    """Settings resolved by :func:`run_defaults`."""

    backend: str
    method: str
    tree: str
    sampling: SamplingConfig


def default_cfg_scale(info: ModelDir) -> float:
    """The model's ``sampling_defaults.cfg_scale``, else its family's default for its kind."""
    from lantern_rt.families.registry import family_named

    scale = info.raw.get("sampling_defaults", {}).get("cfg_scale")
    return float(scale) if scale is not None else family_named(info.family).default_cfg_scale(info.gpt)


def default_sampling(
    info: ModelDir,
    *,
    cfg_scale: float | None = None,
    temperature: float | None = None,
    top_k: int | None = None,
    top_p: float | None = None,
    greedy: bool = False,
) -> SamplingConfig:
    """The sampling of a run over ``info`` (a model directory, or a bundle's
    :func:`~lantern_rt.families.loading.bundle_info`, which carries the model's defaults): each
    setting given (not None), else the model's ``sampling_defaults``, else the library's (the CFG
    scale: :func:`default_cfg_scale`; temperature 1, top-k 0 (off), top-p 1); temperature 0 when
    ``greedy``. :class:`~lantern_rt.runtime.sampling.SamplingError` for a value out of range."""
    from lantern_rt.runtime.sampling import SamplingConfig

    model = info.raw.get("sampling_defaults", {})
    given = {"temperature": temperature, "top_k": top_k, "top_p": top_p}
    kinds = {"temperature": float, "top_k": int, "top_p": float}  # JSON's 1 is a temperature of 1.0
    chosen = {
        key: kinds[key](model[key]) if value is None else value
        for key, value in given.items()
        if key in model or value is not None
    }
    if greedy:
        chosen["temperature"] = 0.0
    scale = default_cfg_scale(info) if cfg_scale is None else float(cfg_scale)
    return SamplingConfig(cfg_scale=scale, **chosen)


def default_tree(backend: str, device: str) -> str:
    """The tree of a run that names none (and has no bundle's to take): :data:`GPU_DEFAULT_TREE`
    when ``backend`` computes on a GPU (:func:`runs_on_gpu`), else :data:`CPU_DEFAULT_TREE`."""
    return GPU_DEFAULT_TREE if runs_on_gpu(backend, device) else CPU_DEFAULT_TREE


def machine_device() -> str:
    """This machine's device: ``cuda`` when torch sees a CUDA device, else ``cpu``."""
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def export_tree(device: str | None = None) -> str:
    """The tree ``lantern export`` writes when given none: the one ``lantern generate`` chooses
    for a model on ``device`` (default: :func:`machine_device`; one this machine lacks too, as a
    bundle may be exported for another) and its default backend, so that the bundle runs on that
    device with the tree a run there would have."""
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
            raise ConfigError(f"--method {method}: give --window N or --tree, not both")
        if not tree.startswith(("chain-", "pac-")):
            raise ConfigError(
                f"--method {method} drafts a Jacobi window: --tree takes chain-N or pac-K-D-N, not {tree!r}"
            )
        try:
            nodes = load_tree(tree).num_nodes
        except TreeError as exc:
            raise ConfigError(f"--tree {tree}: {exc}") from None
        if image_tokens is not None and nodes >= image_tokens:
            raise ConfigError(
                f"--tree {tree} verifies {nodes} tokens; at most {image_tokens - 1} (the image has "
                f"{image_tokens} tokens)"
            )
        return tree
    window = DEFAULT_WINDOW if window is None else window
    if isinstance(window, bool) or not isinstance(window, int) or window < 1:
        raise ConfigError(f"--window must be an integer >= 1, not {window}")
    if image_tokens is not None and window >= image_tokens:
        raise ConfigError(
            f"--window must be at most {image_tokens - 1} (the image has {image_tokens} tokens), not {window}"
        )
    return f"chain-{window}"


def run_defaults(
    source: ModelDir | Bundle,
    *,
    backend: str | None = None,
    method: str | None = None,
    tree: str | None = None,
    cfg_scale: float | None = None,
    temperature: float | None = None,
    top_k: int | None = None,
    top_p: float | None = None,
    greedy: bool = False,
    device: str = "cpu",
    drafter_override: bool = False,
    window: int | None = None,
) -> RunDefaults:
    """Fill in what the caller left as None for a run over a model directory or a bundle: the
    backend from the device and what is installed (:func:`default_backend`), the method from
    whether there is a drafter (lantern++, else ar), the tree from the bundle (its first) or
    the backend's device (:func:`default_tree`; a Jacobi method's: the chain of its ``window``,
    :data:`DEFAULT_WINDOW` positions unless given), and the sampling from the model
    (:func:`default_sampling`)."""
    from lantern_rt.bundle import Bundle
    from lantern_rt.families.loading import bundle_info

    is_bundle = isinstance(source, Bundle)
    info = bundle_info(source) if is_bundle else source
    has_drafter = source.has_drafter if is_bundle else "drafter" in source.files or drafter_override
    backend = backend_named(backend or default_backend(device, is_bundle, drafter_override)).name
    method = method or ("lantern++" if has_drafter else "ar")
    if method in JACOBI_METHODS:
        tree = window_tree(method, tree, window, info.gpt.block_size)
    elif window is not None:
        raise ConfigError(
            f"--window sets the Jacobi window of --method {' or '.join(JACOBI_METHODS)}, not {method}"
        )
    if tree is None:
        exported = list(source.trees) if is_bundle else []
        tree = exported[0] if exported else default_tree(backend, device)
    sampling = default_sampling(
        info, cfg_scale=cfg_scale, temperature=temperature, top_k=top_k, top_p=top_p, greedy=greedy
    )
    return RunDefaults(backend, method, tree, sampling)


def calibration_method(bundle: Bundle) -> MethodConfig:
    """What ``lantern calibrate`` drives a bundle's graphs with when given no method: the run's
    default (:func:`run_defaults`: lantern++ with a drafter, else ar), or sjd over the bundle's
    first chain for a bundle without a drafter whose chains have verify graphs."""
    from lantern_rt.runtime.backends.bundle_graphs import bundle_windows

    windows = bundle_windows(bundle)
    if not bundle.has_drafter and windows:
        return MethodConfig("sjd", tree=next(iter(windows)))
    return MethodConfig(run_defaults(bundle).method)


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


@dataclass(frozen=True)
class RunRequest:
    """A run's request, validated before any work (:func:`run_request`)."""

    conditions: list[int | str]  # class ids, or prompts for a text-conditional model
    sampling: SamplingConfig
    method: MethodConfig
    settings: RunDefaults


def run_request(
    md: ModelDir,
    source: ModelDir | Bundle,
    *,
    classes: Sequence[str] | None,
    prompts: Sequence[str] | None,
    greedy: bool,
    device: str,
    k: int,
    delta: float,
    lam: float,
    cfg_scale: float | None = None,
    temperature: float | None = None,
    top_k: int | None = None,
    top_p: float | None = None,
    method: str | None = None,
    tree: str | None = None,
    window: int | None = None,
    backend: str | None = None,
    drafter: str | None = None,
    coupling: str | None = None,
) -> RunRequest:
    """What a run asks for over ``md`` (its info) and ``source`` (what it runs: the model
    directory or the opened bundle), validated before any work: the conditions
    (:func:`requested_conditions`; none when ``classes`` and ``prompts`` are both None: the Python
    API and a server take them per call), the sampling (temperature 0 when ``greedy``), the method and
    its acceptance parameters; what is None :func:`run_defaults` fills in."""
    check_device(device)
    settings = run_defaults(
        source,
        backend=backend,
        method=method,
        tree=tree,
        cfg_scale=cfg_scale,
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        greedy=greedy,
        device=device,
        drafter_override=drafter is not None,
        window=window,
    )
    later = classes is None and prompts is None
    conditions = [] if later else requested_conditions(md, classes or (), prompts or ())
    mc = MethodConfig(settings.method, settings.tree, k, delta, lam, drafter, coupling)
    mc.relaxation()  # validates k, delta and lambda before any work
    return RunRequest(conditions, settings.sampling, mc, settings)
