"""``python -m lantern_rt.cli``: the ``lantern`` command."""

from lantern_rt.cli import main

main()
