"""``python -m pattern_infra``: the ``mil-patterns`` command line (see :mod:`pattern_infra.cli.commands`)."""

from .cli.commands import main

main(prog_name="mil-patterns")
