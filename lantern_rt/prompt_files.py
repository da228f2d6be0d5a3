"""Prompts given on a command line: ``--prompt`` texts and ``--prompts`` files."""

from __future__ import annotations

from pathlib import Path

from lantern_rt.errors import UserError


def read_prompts(texts: tuple[str, ...], file: Path | None) -> list[str]:
    """The --prompt texts, then the --prompts file's non-blank lines (UTF-8); a missing,
    unreadable or empty file is a one-line :class:`UserError`."""
    prompts = list(texts)
    if file is not None:
        try:
            lines = file.read_text(encoding="utf-8").splitlines()
        except FileNotFoundError:
            raise UserError(f"--prompts file not found: {file}") from None
        except (OSError, UnicodeDecodeError) as exc:
            raise UserError(f"cannot read --prompts {file}: {exc}") from None
        found = [line.strip() for line in lines if line.strip()]
        if not found:
            raise UserError(f"--prompts {file} holds no prompt (one per line)")
        prompts += found
    return prompts
