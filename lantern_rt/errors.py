"""One-line errors for the command line: what counts as bad input, and how it is reported."""

from __future__ import annotations

import functools
import sys

import click

EXIT_BAD_INPUT = 2


class UserError(Exception):
    """Bad input from the user: reported as one line, exit code 2."""


def first_line(exc: BaseException) -> str:
    """The first line of an exception's message, or its type's name when it has none."""
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0]


def _user_errors() -> tuple[type[BaseException], ...]:
    from lantern_rt.engines.compat import EngineError
    from lantern_rt.export.bundle import BundleError, ExportError
    from lantern_rt.models.checkpoint import CheckpointError
    from lantern_rt.models.config import ConfigError
    from lantern_rt.runtime.acceptance import AcceptanceError
    from lantern_rt.runtime.sampling import SamplingError
    from lantern_rt.runtime.tree import TreeError

    return (
        UserError,
        CheckpointError,
        ConfigError,
        SamplingError,
        TreeError,
        AcceptanceError,
        BundleError,
        ExportError,
        EngineError,
    )


def reports_errors(fn):
    """Turn the package's input errors into ``error: ...`` on stderr and exit code 2."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except _user_errors() as exc:
            click.echo(f"error: {exc}", err=True)
            sys.exit(EXIT_BAD_INPUT)

    return wrapper
