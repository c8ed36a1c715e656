"""Rewriting: a pass's run over a program, its modules listed in docs/ARCHITECTURE.md ("The packages").
Imports the language and matching."""

from .driver import run_subpasses
from .removal import remove_dead_ops
from .subpass import DEFAULT_MAX_ITERATIONS, PassStats, SubPass

__all__ = ["DEFAULT_MAX_ITERATIONS", "PassStats", "SubPass", "remove_dead_ops", "run_subpasses"]
