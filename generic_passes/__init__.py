"""Fusion passes written as patterns. ``import generic_passes`` registers every one of them.

One module per pass, named after the pass it registers (``common::fuse_gelu_exact`` lives in
``fuse_gelu_exact.py``). Passes under a coremltools id replace coremltools' pass only while
``ENABLE_EXPERIMENTAL_PASSES=1``; passes in the ``generic`` namespace are new fusions.
"""

from __future__ import annotations

import importlib
import pkgutil

__all__ = ["MODULES"]

MODULES: tuple[str, ...] = tuple(
    sorted(info.name for info in pkgutil.iter_modules(__path__) if not info.name.startswith("_"))
)
"""Names of the pass modules, each imported (and so registered) once, in sorted order."""

for _name in MODULES:
    importlib.import_module(f"{__name__}.{_name}")
