"""coremltools' progress bars off for the duration of a block (:func:`no_progress_bars`).

coremltools draws a tqdm bar for its PyTorch frontend and for every pass pipeline it applies, on stderr,
with no option to turn them off; tqdm reads its defaults from the environment (``TQDM_DISABLE``) only
when it is imported. Capturing a pattern or saving a model prints nothing of them: the two names
coremltools calls are swapped for quiet bars during the block.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
from collections.abc import Iterator

__all__ = ["no_progress_bars"]

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
