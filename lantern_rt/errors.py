"""One-line errors and warnings for the command line: what counts as bad input, and how it is
reported.

Every error the package raises for bad input derives from :class:`LanternError`; the command
line turns it into ``error: ...`` on stderr and exit code 2. A message names a run option
through :func:`option`: as the Python API's keyword (``compile=False``) in ``str(error)``, as
its flag (``--no-compile``, :func:`flag`) on the command line. This module imports no other
module of the package, so every layer can use it.
"""

from __future__ import annotations

import functools
import re
import signal
import sys
from typing import Any

import click

EXIT_BAD_INPUT = 2
_REFERENCE = re.compile("\x1f([^\x1f\x1e]*)\x1e([^\x1f\x1e]*)\x1f")  # option(): keyword, flag


def flag(name: str, *value: object) -> str:
    """How the command line spells run option ``name`` (set to ``value``): ``--batch-size``,
    ``--batch-size 2``; a switch set: ``--compile``, ``--no-compile``."""
    spelled = "--" + name.replace("_", "-")
    if not value:
        return spelled
    (setting,) = value
    if isinstance(setting, bool):
        return spelled if setting else f"--no-{spelled[2:]}"
    return f"{spelled} {setting}"


def option(name: str, *value: object) -> str:
    """Run option ``name``, or a setting of it to ``value``, in an error's message: the Python
    API's keyword (``compile``, ``compile=False``) in ``str(error)``, its :func:`flag` in
    :meth:`LanternError.command_line`."""
    keyword = name if not value else f"{name}={value[0]!r}"
    return f"\x1f{keyword}\x1e{flag(name, *value)}\x1f"


class LanternError(Exception):
    """Bad input, a bad file or an impossible setting: reported as one line, exit code 2. Its
    message names run options as the Python API does (``str``), and as the command line does
    (:meth:`command_line`)."""

    def __str__(self) -> str:
        return _REFERENCE.sub(r"\1", self.message)

    @property
    def message(self) -> str:
        """The message with its :func:`option` references unspelled, to quote in another error's."""
        return super().__str__()

    def command_line(self) -> str:
        """The message as the command line says it: each run option as its :func:`flag`."""
        return _REFERENCE.sub(r"\2", self.message)


class UserError(LanternError):
    """Bad input given on the command line."""


class Interrupted(SystemExit):
    """A signal stopped the run: Ctrl-C (SIGINT) in a command, or SIGTERM while a file or folder
    is written (:func:`lantern_rt.fileio.sigterm_raises`), raised where the process was so that
    each block it leaves removes what it was writing; exit code 128 + the signal. A SystemExit,
    so that no ``except Exception`` takes it."""

    def __init__(self, signum: int):
        super().__init__(128 + signum)
        self.signum = signum


class TextEncoderError(LanternError, ValueError):
    """A missing text-side dependency, a bad tokenizer or encoder folder, or bad prompts."""


def require(module: str, hint: str) -> Any:
    """Import ``module`` (ftfy, bs4, transformers, tokenizers), or raise :class:`TextEncoderError`
    with the install ``hint``."""
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError as err:
        raise TextEncoderError(f"prompts need {module.split('.')[0]}: {hint}") from err


def warn(message: str) -> None:
    """Tell the user something that does not stop the run: ``warning: ...`` on stderr."""
    print(f"warning: {message}", file=sys.stderr)


def first_line(exc: BaseException, flags: bool = False) -> str:
    """The first line of an exception's message, or its type's name when it has none; ``flags``:
    with its run options named as the command line names them (:meth:`LanternError.command_line`)."""
    text = exc.command_line() if flags and isinstance(exc, LanternError) else str(exc)
    return (text.strip().splitlines() or [type(exc).__name__])[0]


class OneLineErrors(click.Group):
    """A command group whose usage errors (an unknown option, a value of the wrong type or out of
    range) are one line ``error: ...`` with exit code 2, as every other bad input is, rather than
    click's usage, hint and error lines; a run stopped by a signal (:class:`Interrupted`) is one
    line ``error: stopped by SIGINT`` with exit code 128 + the signal, rather than ``Aborted!``."""

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except KeyboardInterrupt:
            raise Interrupted(signal.SIGINT) from None

    def main(self, *args, **kwargs):
        standalone = kwargs.pop("standalone_mode", True)
        try:
            code = super().main(*args, standalone_mode=False, **kwargs)
        except click.UsageError as exc:
            lines = exc.format_message().strip().splitlines()  # names the option, as str(exc) does not
            click.echo(f"error: {lines[0] if lines else 'invalid command line'}", err=True)
            sys.exit(EXIT_BAD_INPUT)
        except Interrupted as exc:
            click.echo(f"error: stopped by {signal.Signals(exc.signum).name}", err=True)
            sys.exit(exc.code)
        except click.ClickException as exc:
            exc.show()
            sys.exit(exc.exit_code)
        except click.Abort:
            click.echo("Aborted!", err=True)
            sys.exit(1)
        if not standalone:
            return code
        sys.exit(code if isinstance(code, int) else 0)


def reports_errors(fn):
    """Turn the package's errors into ``error: ...`` on stderr and exit code 2."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except LanternError as exc:
            click.echo(f"error: {first_line(exc, flags=True)}", err=True)
            sys.exit(EXIT_BAD_INPUT)

    return wrapper
