"""The package's version, installed or not.

On a machine without network access (the GPU check's), the checkout runs from ``PYTHONPATH``
without ``pip install``, and ``importlib.metadata`` knows no ``lantern-rt``: the version is then
read from the ``pyproject.toml`` beside the package.
"""

from __future__ import annotations

import importlib.metadata
import re
from pathlib import Path

PYPROJECT = Path(__file__).resolve().parent.parent / "pyproject.toml"


def package_version() -> str:
    """``lantern-rt``'s version: the installed distribution's, else the checkout's pyproject.toml's."""
    try:
        return importlib.metadata.version("lantern-rt")
    except importlib.metadata.PackageNotFoundError:
        pass
    try:
        match = re.search(r'^version\s*=\s*"([^"]+)"', PYPROJECT.read_text(), re.MULTILINE)
    except OSError:
        match = None
    return match.group(1) if match else "unknown"
