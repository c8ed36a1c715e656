"""``python -m pattern_infra``: the ``mil-patterns`` command line (see :mod:`pattern_infra.cli`)."""

from .cli import main

main(prog_name="mil-patterns")
