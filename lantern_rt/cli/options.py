"""What the commands share: the run options as flags, made from their declarations
(:class:`lantern_rt.run_options.RunOptions`), the model, prompt and class options, and the
parsing of their values (a bundle or a model directory, batch sizes)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

from lantern_rt.errors import UserError, flag
from lantern_rt.run_options import RunOptions, declaration, option_types
from lantern_rt.runtime.run_shape import check_batch_sizes, check_stream_counts
from lantern_rt.settings import MAX_IMAGES_PER_CLASS, MAX_SEED, capped_threads

if TYPE_CHECKING:  # the command line imports its work lazily, for a fast --help
    from lantern_rt.bundle import Bundle
    from lantern_rt.models.model_dir import ModelDir

SEED = click.IntRange(min=0, max=MAX_SEED)
IMAGES_PER_CLASS = click.IntRange(min=1, max=MAX_IMAGES_PER_CLASS)
RUN = tuple(option_types())  # every run option, in the order declared (--help's)
_DECLARED = object()  # a command that keeps an option's declared default


class Auto(click.ParamType):
    """An option whose None is ``auto``, else a whole number within its declaration's bounds
    (``--streams``)."""

    def __init__(self, name: str) -> None:
        self.bounds = declaration(name)
        self.name = "auto|N"

    def convert(self, value, param, ctx):  # type: ignore[override]
        if value is None or value == "auto":
            return None
        if isinstance(value, int) and not isinstance(value, bool):
            number = value
        elif isinstance(value, str) and value.strip().isdigit():
            number = int(value)
        else:
            self.fail(f"{value!r} is neither 'auto' nor a whole number", param, ctx)
        low, high = int(self.bounds.minimum or 1), int(self.bounds.maximum or number)
        if not low <= number <= high:
            self.fail(f"{number} is not in {low}..{high} (or 'auto')", param, ctx)
        return number


class Listed(click.Choice):
    """A choice among the values a declaration lists when asked (the backends: read when the
    option is parsed or shown, so that one registered after this module is imported is a
    choice too)."""

    def __init__(self, listed: Callable[[], tuple[str, ...]]) -> None:
        self._listed = listed
        super().__init__(list(listed()))

    @property  # type: ignore[override]
    def choices(self) -> tuple[str, ...]:
        return self._listed()

    @choices.setter
    def choices(self, value: object) -> None:
        """The listed values stand: what click's constructor sets is not kept."""


def run_option_type(name: str) -> click.ParamType | type:
    """The click type of run option ``name``: from its declared type and constraints."""
    rule, (kind, _) = declaration(name), option_types()[name]
    if rule.auto:
        return Auto(name)
    if callable(rule.choices):
        return Listed(rule.choices)
    if rule.choices is not None:
        return click.Choice(rule.choices)
    if kind is Path:
        return click.Path(path_type=Path)
    if kind in (int, float) and (rule.minimum is not None or rule.maximum is not None):
        ranged = click.IntRange if kind is int else click.FloatRange
        return ranged(min=rule.minimum, max=rule.maximum)
    return kind


def run_option(name: str, default: Any = _DECLARED, multiple: bool = False, help: str = "") -> Callable:
    """Run option ``name`` as a flag (:func:`~lantern_rt.errors.flag`), made from its
    declaration: its type, constraints and help; ``default`` overrides the declared one (a
    command's own). ``multiple``: given once per value, with the ``help`` of what the command
    does with each (a sweep of ``lantern bench``)."""
    field = {f.name: f for f in dataclasses.fields(RunOptions)}[name]
    value = field.default if default is _DECLARED else default
    rule, (kind, _) = declaration(name), option_types()[name]
    given: dict[str, Any] = {"help": rule.help, "default": value}
    if multiple:
        return click.option(flag(name), name, type=run_option_type(name), multiple=True, help=help)
    if kind is bool:
        return click.option(f"{flag(name)}/{flag(name, False)}", name, show_default=True, **given)
    if rule.auto and value is None:
        given["default"] = "auto"
    if name == "threads":
        return threads_option(rule.help, int(rule.minimum or 0), value)
    shown = value is not None or rule.auto
    return click.option(flag(name), name, type=run_option_type(name), show_default=shown, **given)


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


def run_options(*names: str, **defaults: Any) -> Callable:
    """The run options ``names`` as flags (:func:`run_option`), in that order, with a command's
    own ``defaults``."""
    return options(*(run_option(n, defaults.get(n, _DECLARED)) for n in names))


def open_run_source(model_path: Path | None, bundle: Path | None) -> tuple[ModelDir, ModelDir | Bundle]:
    """(model info, what to build the pipeline from: a model directory or the opened bundle)."""
    from lantern_rt.pipeline import open_source

    if bundle is not None and model_path is not None:
        raise UserError("--bundle runs an exported bundle: drop --model")
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


def bundle_option(help: str) -> Callable:
    """``--bundle``: an exported bundle to run instead of a model directory."""
    return click.option("--bundle", type=click.Path(path_type=Path), default=None, help=help)


run_bundle_option = bundle_option(
    "Run an exported bundle (from 'lantern export') instead of a model directory, on onnxruntime, "
    "openvino or tensorrt (--backend)."
)
num_images_option = click.option(
    "--num-images",
    "-n",
    type=IMAGES_PER_CLASS,
    default=4,
    show_default=True,
    help="Images per class.",
)


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
