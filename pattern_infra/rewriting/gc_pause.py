"""Cyclic garbage collection paused while a pass runs: with a large graph alive, each generational
collection would walk all of it."""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager

__all__ = ["paused_gc"]

_PROMOTE_ABOVE = 20_000  # young objects above which the pass's survivors are promoted, not collected


@contextmanager
def paused_gc() -> Iterator[None]:
    """Cyclic GC off for the ``with`` block, back as it was after it.

    Everything the block allocated and still holds is then young, and the first allocation after it
    would collect all of it; so many survivors are moved to the oldest generation, unexamined, in
    constant time (``gc.freeze()`` then ``gc.unfreeze()``). Not if the process froze objects itself:
    they would be unfrozen too (asking, ``gc.get_freeze_count()``, walks them: only for a large pass).
    """
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if gc.get_count()[0] > _PROMOTE_ABOVE and gc.get_freeze_count() == 0:
            gc.freeze()
            gc.unfreeze()
        if was_enabled:
            gc.enable()
