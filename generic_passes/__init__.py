"""Fusion passes written as patterns. ``import generic_passes`` registers every one of them.

One module per pass, named after the pass it registers (``common::fuse_gelu_exact`` lives in
``fuse_gelu_exact.py``). Passes under a coremltools id replace coremltools' pass only while
``ENABLE_EXPERIMENTAL_PASSES=1``; passes in the ``generic`` namespace are new fusions.
"""

from __future__ import annotations

import importlib
import pkgutil
from collections.abc import Iterator
from contextlib import contextmanager

from coremltools.converters.mil.mil.passes.pass_registry import PASS_REGISTRY

__all__ = ["CLEANUP_PASSES", "MODULES", "coremltools_cleanup"]

MODULES: tuple[str, ...] = tuple(
    sorted(info.name for info in pkgutil.iter_modules(__path__) if not info.name.startswith("_"))
)
"""Names of the pass modules, each imported (and so registered) once, in sorted order."""

for _name in MODULES:
    importlib.import_module(f"{__name__}.{_name}")

CLEANUP_PASSES: tuple[str, ...] = (
    "common::const_elimination",
    "common::dead_code_elimination",
    "common::reduce_transposes",
    "common::topological_reorder",
)
"""coremltools' non-fusion passes replaced by plain graph passes giving the same program (issue 17):
coremltools' ``topological_reorder`` is quadratic, its ``reduce_transposes`` formats and re-infers the
whole block for nothing, its ``const_elimination`` and ``dead_code_elimination`` walk the whole program
and recompute every var's dependence on ``constexpr`` ops when they have nothing to do (see each
module)."""


@contextmanager
def coremltools_cleanup(pass_ids: tuple[str, ...] = CLEANUP_PASSES) -> Iterator[None]:
    """Puts coremltools' own passes back under ``pass_ids`` for the duration of the ``with`` block.

    The pipeline then runs coremltools' passes for these ids even with the override on, as before their
    replacements existed: the benchmark's baseline ("today's path") and the tests comparing both.
    A pipeline built inside the block (``pattern_infra.pipeline()``) keeps coremltools' passes too.
    """
    saved = {pass_id: PASS_REGISTRY.passes[pass_id] for pass_id in pass_ids}
    for pass_id, container in saved.items():
        replaced = getattr(container, "replaces", None)
        if replaced is None:
            raise ValueError(f"coremltools_cleanup: {pass_id!r} does not replace a coremltools pass.")
        PASS_REGISTRY.passes[pass_id] = replaced
    try:
        yield
    finally:
        PASS_REGISTRY.passes.update(saved)
