"""An independent copy of a coremltools ``Program``: :func:`clone_program`.

Copying a program: ``copy.deepcopy`` works on coremltools programs (coremltools' own pass tests rely
on it) but recurses about 15 Python frames per op along a dependency chain, so a chain of about 65
ops already exceeds Python's default recursion limit, and a few thousand ops overflow a default
thread stack (a segmentation fault, not an exception). :func:`clone_program` therefore runs the deep
copy on a worker thread whose stack and recursion limit grow with the op count.
"""

from __future__ import annotations

import copy
import sys
import threading
from typing import Any, Final

from ..rewriting.blocks import walk_blocks

__all__ = ["clone_program"]

_CLONE_BASE_STACK: Final = 32 * 1024 * 1024
_CLONE_STACK_PER_OP: Final = 8 * 1024
_CLONE_MAX_STACK: Final = 1024 * 1024 * 1024
_CLONE_FRAMES_PER_OP: Final = 40


def clone_program(prog: Any) -> Any:
    """Return an independent deep copy of a coremltools ``Program``.

    The copy shares no op, var or block with the original, so a pass applied to it leaves the
    original untouched. See the module docstring for why the copy runs on a worker thread.

    Args:
        prog: The program to copy.

    Returns:
        The copy.
    """
    n_ops = sum(len(ops) for _, ops in walk_blocks(prog))
    stack = min(_CLONE_BASE_STACK + _CLONE_STACK_PER_OP * n_ops, _CLONE_MAX_STACK)
    limit = max(sys.getrecursionlimit(), 10_000 + _CLONE_FRAMES_PER_OP * n_ops)
    result: list[Any] = []
    failure: list[BaseException] = []

    def work() -> None:
        try:
            result.append(copy.deepcopy(prog))
        except BaseException as exc:  # re-raised on the calling thread below
            failure.append(exc)

    old_limit = sys.getrecursionlimit()
    old_stack = threading.stack_size()
    try:
        sys.setrecursionlimit(limit)
        threading.stack_size(stack)
        worker = threading.Thread(target=work, name="pattern_infra-clone_program")
        worker.start()
        worker.join()
    finally:
        threading.stack_size(old_stack)
        sys.setrecursionlimit(old_limit)
    if failure:
        raise failure[0]
    return result[0]
