"""What the commands share: the model and run options, prompt options, and the parsing of
their values (a bundle or a model directory, batch sizes)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

from lantern_rt.backends import BACKENDS, backend_named
from lantern_rt.errors import UserError
from lantern_rt.runtime.run_shape import MAX_BATCH_SIZE, MAX_STREAMS, check_batch_sizes, check_stream_counts
from lantern_rt.settings import (
    COUPLINGS,
    CPU_DEFAULT_TREE,
    DEFAULT_COUPLING,
    DEFAULT_WINDOW,
    GPU_DEFAULT_TREE,
    MAX_IMAGES_PER_CLASS,
    MAX_SEED,
    METHODS,
    RunRequest,
    capped_threads,
    run_request,
)

if TYPE_CHECKING:  # the command line imports its work lazily, for a fast --help
    from lantern_rt.bundle import Bundle
    from lantern_rt.models.model_dir import ModelDir

SEED = click.IntRange(min=0, max=MAX_SEED)
COMPILE_HELP = (
    "Compile each whole decode step with torch.compile (inductor, fullgraph: a graph break is an "
    "error; torch backend only), once per run: the compile time is reported once (stats "
    "compile_seconds). Off by default: on a CPU at demo size the compiled step is 1.2-1.6x faster "
    "per call, but its compile (minutes) outweighs that below hundreds of images (BENCHMARKS.md, "
    "'Issue 47: compiled torch path'); unmeasured on a GPU. Needs a C++ compiler (CPU) or Triton (GPU)."
)
IMAGES_PER_CLASS = click.IntRange(min=1, max=MAX_IMAGES_PER_CLASS)
compile_option = click.option(
    "--compile/--no-compile", "compile_step", default=False, show_default=True, help=COMPILE_HELP
)


class StreamCount(click.ParamType):
    """``--streams``: ``auto`` (None: the pipeline chooses) or a count in 1..MAX_STREAMS."""

    name = "auto|N"

    def convert(self, value, param, ctx):  # type: ignore[override]
        if value is None or value == "auto":
            return None
        if isinstance(value, int) and not isinstance(value, bool):
            number = value
        elif isinstance(value, str) and value.strip().isdigit():
            number = int(value)
        else:
            self.fail(f"{value!r} is neither 'auto' nor a whole number", param, ctx)
        if not 1 <= number <= MAX_STREAMS:
            self.fail(f"{number} is not in 1..{MAX_STREAMS} (or 'auto')", param, ctx)
        return number


class BackendName(click.Choice):
    """``--backend``: a name in the backend registry, read when the option is parsed or shown (a
    backend registered after this module is imported is a choice too)."""

    def __init__(self) -> None:
        super().__init__(list(BACKENDS))

    @property  # type: ignore[override]
    def choices(self) -> tuple[str, ...]:
        return tuple(BACKENDS)

    @choices.setter
    def choices(self, value: object) -> None:
        """The registry's names stand: what click's constructor sets is not kept."""


def threads_option(help: str, minimum: int = 0, default: int | None = 0) -> Callable:
    """``--threads`` (``help`` first): capped at the cores the process may use, with a warning
    (``settings.capped_threads``)."""
    return click.option(
        "--threads",
        type=click.IntRange(min=minimum),
        default=default,
        callback=lambda ctx, param, value: capped_threads(value),
        help=f"{help} More than the CPU cores this process may use (its CPU affinity) is capped "
        "to them, with a warning.",
    )


def open_run_source(
    model_path: Path | None, bundle: Path | None, backend: str | None, drafter_path: Path | None
):
    """(model info, what to build the pipeline from: a model directory or the opened bundle)."""
    from lantern_rt.pipeline import open_source

    if bundle is not None and drafter_path is not None:
        raise UserError("--bundle runs an exported bundle with its own drafter: drop --drafter")
    if bundle is not None and backend is not None:
        backend_named(backend).check_bundle()
    return open_source(model_path, bundle)


model_option = click.option(
    "--model",
    "model_path",
    type=click.Path(path_type=Path),
    default=None,
    help="Model directory (config.json + weights). Default: the built-in Fashion-MNIST demo.",
)


def options(*decorators: Callable) -> Callable:
    """The click options ``decorators`` as one decorator, in the order given (--help's order)."""

    def apply(command: Callable) -> Callable:
        for option in reversed(decorators):
            command = option(command)
        return command

    return apply


classes_option = click.option(
    "--class",
    "--classes",
    "classes",
    multiple=True,
    help="Class ids or names, comma-separated or repeated. Default: every class.",
)
seed_option = click.option(
    "--seed",
    type=SEED,
    default=0,
    show_default=True,
    help="Random seed; the same seed and settings give the same tokens.",
)
# what each image samples: the CFG scale, temperature, top-k and top-p (settings.default_sampling)
sampling_options = options(
    click.option(
        "--cfg-scale",
        type=float,
        default=None,
        help="Classifier-free guidance scale s in u + s*(c - u). Default: the model's (3.0 for the demo).",
    ),
    click.option(
        "--temperature",
        type=float,
        default=None,
        help="Sampling temperature; 0 means greedy. Default: the model's sampling_defaults, else 1.0.",
    ),
    click.option(
        "--top-k",
        type=int,
        default=None,
        help="Keep the k most likely tokens (0 = off). Default: the model's sampling_defaults, else 0.",
    ),
    click.option(
        "--top-p",
        type=float,
        default=None,
        help="Nucleus sampling mass in (0, 1]. Default: the model's sampling_defaults, else 1.0.",
    ),
)
cuda_graphs_option = click.option(
    "--cuda-graphs/--no-cuda-graphs",
    default=True,
    show_default=True,
    help="Replay each step from a captured CUDA graph (torch on a CUDA --device, tensorrt).",
)
device_option = click.option(
    "--device",
    default="cpu",
    show_default=True,
    help="Where the run computes (cpu, cuda or cuda:N): the torch backend's device, and what the "
    "default --backend and --tree are chosen for.",
)


def bundle_option(help: str) -> Callable:
    """``--bundle``: an exported bundle to run instead of a model directory."""
    return click.option("--bundle", type=click.Path(path_type=Path), default=None, help=help)


# The options ``generate`` and ``generate-set`` share: what to make and how (classes and counts,
# sampling, method, backend, device, batch size), resolved by ``settings.run_request``; ``bench``
# takes the sampling, device and engine ones among them.
greedy_option = click.option("--greedy", is_flag=True, help="Greedy decoding (same as --temperature 0).")
# how a run decodes (method, tree, engine, device, threads, batch size): what a server fixes
decode_options = options(
    click.option(
        "--method",
        type=click.Choice(METHODS),
        default=None,
        help="Decoding method: plain autoregressive, exact speculative, or relaxed (LANTERN, LANTERN++); "
        "sjd and sjd++ need no drafter: a Jacobi window drafted from the target's own distributions, exact "
        "or with LANTERN++'s neighbour credit. Default: lantern++ when the model has a drafter, else ar.",
    ),
    click.option(
        "--tree",
        default=None,
        help="Static draft tree: naive_extend_57, mc_sim_7b_63, chain-N, or a JSON file of paths (--method sjd, "
        "sjd++: chain-N or pac-K-D-N). Default: "
        f"the bundle's first tree with --bundle, else {CPU_DEFAULT_TREE} on a CPU (a tree's cost grows with "
        f"its size there; measured best in BENCHMARKS.md), {GPU_DEFAULT_TREE} on a GPU (tensorrt, or a CUDA --device).",
    ),
    click.option(
        "--window",
        type=int,
        default=None,
        help=f"Draft positions per step of --method sjd or sjd++ (a chain of N; a bundle needs 'lantern export "
        f"--tree chain-N'; --tree pac-K-D-N instead: K candidates per position down to depth D, N verify "
        f"tokens). Default: {DEFAULT_WINDOW}.",
    ),
    click.option(
        "--coupling",
        type=click.Choice(COUPLINGS),
        default=None,
        help="How --method sjd or sjd++ draws a position's draft from one call to the next: maximal (keep "
        "the last draft where a test allows), gumbel (the position's Gumbel noise kept), none (afresh); all "
        f"exact. Default: {DEFAULT_COUPLING}.",
    ),
    click.option(
        "--lantern-k", type=int, default=10, show_default=True, help="Latent neighbours per drafted token."
    ),
    click.option(
        "--lantern-delta", type=float, default=0.1, show_default=True, help="LANTERN TV budget in [0, 1]."
    ),
    click.option(
        "--lantern-lambda", type=float, default=5.0, show_default=True, help="LANTERN++ cap lambda >= 1."
    ),
    click.option(
        "--backend",
        type=BackendName(),
        default=None,
        help="Runtime backend. Default on a CPU: onnxruntime (a model directory is exported once into "
        "$LANTERN_CACHE or ~/.cache/lantern-rt); torch for another --device or a --drafter override. "
        "tensorrt runs a bundle's plans from 'lantern build-engines'.",
    ),
    cuda_graphs_option,
    compile_option,
    bundle_option(
        "Run an exported bundle (from 'lantern export') instead of a model directory, on onnxruntime "
        "or tensorrt (--backend)."
    ),
    device_option,
    threads_option(
        "CPU threads (0: the library default; generate-set: per worker, 1 per Ray actor by default)."
    ),
    click.option(
        "--batch-size",
        type=click.IntRange(min=1, max=MAX_BATCH_SIZE),
        default=1,
        show_default=True,
        help="Images decoded together per step; the tokens do not depend on it (a bundle must hold graphs for it: lantern export --batch-size).",
    ),
)
run_options = options(
    classes_option,
    click.option(
        "--num-images",
        "-n",
        type=IMAGES_PER_CLASS,
        default=4,
        show_default=True,
        help="Images per class.",
    ),
    sampling_options,
    greedy_option,
    seed_option,
    decode_options,
)
# the run options a server fixes: all but a request's own (its classes, count and seed)
served_run_options = options(sampling_options, greedy_option, decode_options)


def requested_run(
    md: ModelDir, source: ModelDir | Bundle, prompts: Sequence[str] | None, drafter: str | None = None
) -> RunRequest:
    """``settings.run_request`` for the :func:`run_options` the running command was given
    (``prompts`` None and no ``--class`` option: the conditions come later, per request)."""
    given = click.get_current_context().params
    return run_request(
        md,
        source,
        classes=given.get("classes"),  # None: lantern serve, whose requests give them
        prompts=prompts,
        cfg_scale=given["cfg_scale"],
        temperature=given["temperature"],
        top_k=given["top_k"],
        top_p=given["top_p"],
        greedy=given["greedy"],
        method=given["method"],
        tree=given["tree"],
        window=given["window"],
        backend=given["backend"],
        device=given["device"],
        k=given["lantern_k"],
        delta=given["lantern_delta"],
        lam=given["lantern_lambda"],
        drafter=drafter,
        coupling=given["coupling"],
    )


def load_options(given: dict[str, Any]) -> dict[str, Any]:
    """The keywords of ``lantern_rt.load`` from the :func:`run_options` (or
    :func:`served_run_options`) a command was given (its click parameters)."""
    return {
        "backend": given["backend"],
        "device": given["device"],
        "method": given["method"],
        "tree": given["tree"],
        "window": given["window"],
        "batch_size": given["batch_size"],
        "streams": given["streams"],
        "threads": given["threads"],
        "cuda_graphs": given["cuda_graphs"],
        "compile": given["compile_step"],
        "cfg_scale": given["cfg_scale"],
        "temperature": given["temperature"],
        "top_k": given["top_k"],
        "top_p": given["top_p"],
        "greedy": given["greedy"],
        "lantern_k": given["lantern_k"],
        "lantern_delta": given["lantern_delta"],
        "lantern_lambda": given["lantern_lambda"],
        "coupling": given["coupling"],
    }


def prompt_options(command: Callable) -> Callable:
    """``--prompt`` and ``--prompts``, for text-to-image models (read by :func:`_prompts`)."""
    command = click.option(
        "--prompts",
        "prompts_file",
        type=click.Path(path_type=Path),
        default=None,
        help="Text file of prompts, one per line (UTF-8; blank lines skipped), for a text-to-image or Chameleon-family model.",
    )(command)
    return click.option(
        "--prompt",
        "prompt_texts",
        multiple=True,
        help="A prompt for a text-to-image or Chameleon-family model (repeatable). Prompts over the "
        "model's prompt length (120 T5 tokens for LlamaGen, the config's prompt.tokens for Anole "
        "and Lumina-mGPT) are truncated with a warning.",
    )(command)


def _integers(text: str, option: str, example: str) -> list[int]:
    try:
        return [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise UserError(f"{option} takes comma-separated integers such as {example}, got {text!r}") from None


def parse_batch_sizes(text: str) -> list[int]:
    """``--batch-size 1,8`` -> [1, 8]; :class:`UserError` for anything else."""
    return check_batch_sizes(_integers(text, "--batch-size", "1,8"))


def parse_stream_counts(text: str) -> list[int]:
    """``--streams 1,2`` -> [1, 2]; :class:`UserError` for anything else."""
    return check_stream_counts(_integers(text, "--streams", "1,2"))
