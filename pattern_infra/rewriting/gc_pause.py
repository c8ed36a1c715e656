"""Cyclic garbage collection paused while a pass runs, and what the pass allocated promoted after it:
with a large graph alive, each generational collection would walk all of it."""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager

__all__ = ["paused_gc"]


@contextmanager
def paused_gc() -> Iterator[None]:
    """Cyclic GC off for the ``with`` block, back as it was after it, the block's survivors promoted."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        _promote_survivors()
        if was_enabled:
            gc.enable()


_PROMOTE_ABOVE = 20_000  # young objects above which the pass's survivors are promoted, not collected


def _promote_survivors() -> None:
    """Moves the objects allocated since the last collection to the oldest generation, unexamined,
    when there are many of them.

    Everything the pass allocated and still holds is young, and the first allocation after it would
    collect all of it. ``gc.freeze()`` then ``gc.unfreeze()`` moves every tracked object to the oldest
    generation in constant time; the next full collection examines them. If the process froze objects
    itself they would be unfrozen too, so then nothing is moved; asking (``gc.get_freeze_count()``)
    walks the frozen objects, so it is asked only for a large pass.
    """
    if gc.get_count()[0] > _PROMOTE_ABOVE and gc.get_freeze_count() == 0:
        gc.freeze()
        gc.unfreeze()
