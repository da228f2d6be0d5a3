"""One-line errors for the command line: what counts as bad input, and how it is reported.

Every error the package raises for bad input derives from :class:`LanternError`; the command
line turns it into ``error: ...`` on stderr and exit code 2. This module imports no other module
of the package, so every layer can use it.
"""

from __future__ import annotations

import functools
import sys

import click

EXIT_BAD_INPUT = 2


class LanternError(Exception):
    """Bad input, a bad file or an impossible setting: reported as one line, exit code 2."""


class UserError(LanternError):
    """Bad input given on the command line."""


def first_line(exc: BaseException) -> str:
    """The first line of an exception's message, or its type's name when it has none."""
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0]


def reports_errors(fn):
    """Turn the package's errors into ``error: ...`` on stderr and exit code 2."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except LanternError as exc:
            click.echo(f"error: {first_line(exc)}", err=True)
            sys.exit(EXIT_BAD_INPUT)

    return wrapper
