"""coremltools' progress bars off for the duration of a block (:func:`no_progress_bars`), and its
import-time warnings held for the command line (:func:`held_import_warnings`).

coremltools draws a tqdm bar for its PyTorch frontend and for every pass pipeline it applies, on stderr,
with no option to turn them off; tqdm reads its defaults from the environment (``TQDM_DISABLE``) only
when it is imported. Capturing a pattern or saving a model prints nothing of them: the two names
coremltools calls are swapped for quiet bars during the block.

Importing coremltools logs warnings on its ``coremltools`` logger (an untested torch version, the
missing Core ML runtime on Linux) and its dependencies may ``warnings.warn``. ``import pattern_infra``
holds them while it imports coremltools and shows them right after, as they would have been shown;
in the command line (``mil-patterns``, ``python -m pattern_infra``) they stay held, and ``--debug``
shows them (:func:`show_held_warnings`).
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import logging
import sys
import warnings
from collections.abc import Iterator
from pathlib import Path

__all__ = ["held_import_warnings", "is_command_line", "no_progress_bars", "show_held_warnings"]

_HELD: list[logging.LogRecord | warnings.WarningMessage] = []
"""What :func:`held_import_warnings` held and did not show (the command line's)."""

_BARS = [("coremltools.converters.mil.mil.passes.pass_pipeline", "tqdm")]
_TORCH_BARS = [("coremltools.converters.mil.frontend.torch.ops", "_tqdm")]


@contextlib.contextmanager
def no_progress_bars(*, torch: bool = False) -> Iterator[None]:
    """Inside the block, coremltools' pass-pipeline progress bars are off, and with ``torch`` its
    PyTorch frontend's too (that module imports torch)."""
    from tqdm import tqdm

    quiet = functools.partial(tqdm, disable=True)
    saved = []
    for module_name, attribute in _BARS + (_TORCH_BARS if torch else []):
        module = importlib.import_module(module_name)
        saved.append((module, attribute, getattr(module, attribute)))
        setattr(module, attribute, quiet)
    try:
        yield
    finally:
        for module, attribute, bar in saved:
            setattr(module, attribute, bar)


def is_command_line() -> bool:
    """Whether this process is ``mil-patterns`` or ``python -m pattern_infra`` (from the interpreter's
    own arguments, known before anything is imported)."""
    argv = sys.orig_argv
    as_module = any(a == "-m" and b.split(".")[0] == "pattern_infra" for a, b in zip(argv, argv[1:]))
    return as_module or any(Path(arg).stem == "mil-patterns" for arg in argv[1:2])


@contextlib.contextmanager
def held_import_warnings(*, show: bool | None = None) -> Iterator[None]:
    """Holds the ``coremltools`` logger's records and the warnings raised inside the block; on exit they
    are shown (``show``, default: unless :func:`is_command_line`) or kept for :func:`show_held_warnings`."""
    held: list[logging.LogRecord | warnings.WarningMessage] = []
    logger = logging.getLogger("coremltools")
    handler = logging.Handler()
    handler.emit = held.append  # type: ignore[method-assign, assignment]
    propagate = logger.propagate
    logger.addHandler(handler)
    logger.propagate = False
    try:
        with warnings.catch_warnings(record=True) as caught:
            yield
        held += caught
    finally:
        logger.removeHandler(handler)
        logger.propagate = propagate
    _HELD.extend(held)
    if not is_command_line() if show is None else show:
        show_held_warnings()


def show_held_warnings() -> None:
    """Shows what :func:`held_import_warnings` held (once), as it would have been shown."""
    held, _HELD[:] = list(_HELD), []
    for item in held:
        if isinstance(item, logging.LogRecord):
            logging.getLogger(item.name).handle(item)
        else:
            warnings.showwarning(item.message, item.category, item.filename, item.lineno)
