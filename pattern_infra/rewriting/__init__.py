"""Rewriting: a pass's run over a program (:mod:`.driver`): the op index and the anchor loop
(:mod:`.blocks`), revisits after a rewrite (:mod:`.changes`), dead matched ops (:mod:`.removal`), the
undo journal (:mod:`.journal`), and a pattern with its callbacks and counters (:mod:`.subpass`).
Imports the language and matching."""

from .driver import run_subpasses
from .removal import remove_dead_ops
from .subpass import DEFAULT_MAX_ITERATIONS, PassStats, SubPass

__all__ = ["DEFAULT_MAX_ITERATIONS", "PassStats", "SubPass", "remove_dead_ops", "run_subpasses"]
