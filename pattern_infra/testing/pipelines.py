"""Whole conversions compared structurally: pass by pass against :func:`pattern_infra.pipeline`.

Two conversions of the same source give programs that differ only in the builder's global counters
(generated op names, block numbers). :func:`converted` resets the op-name counter before converting and
:func:`program_signature` numbers blocks in order of appearance, so equal signatures mean the same
ops, names, types, attributes and constants (as printed), in the same order, with the same scopes.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import coremltools as ct
from coremltools.converters.mil import Builder as mb
from coremltools.converters.mil.mil import Program

from ..rewriting.blocks import walk_blocks
from .convert import experimental_passes

__all__ = ["converted", "program_signature"]

_BLOCK = re.compile(r"\bblock\d+\b")


def converted(
    source: Callable[[], Any],
    pass_pipeline: Callable[[], Any] | None = None,
    *,
    override: bool = True,
    **convert_options: Any,
) -> Program:
    """The MIL program ``coremltools.convert`` makes of ``source()``, the name counter reset first.

    Args:
        source: Builds a fresh model or MIL program (``convert`` changes a MIL program in place).
        pass_pipeline: Builds the pipeline to pass (None: coremltools' default).
        override: ``ENABLE_EXPERIMENTAL_PASSES`` during the conversion.
        **convert_options: Further ``convert`` arguments (default ``convert_to="mlprogram"``,
            ``skip_model_load=True``).
    """
    model = source()
    options: dict[str, Any] = {"convert_to": "mlprogram", "skip_model_load": True, **convert_options}
    if pass_pipeline is not None:
        options["pass_pipeline"] = pass_pipeline()
    mb.name_count.clear()
    with experimental_passes(override):
        return ct.convert(model, **options)._mil_program


def program_signature(prog: Program) -> tuple[str, list[tuple[str, str, Any]]]:
    """The printed program with blocks numbered in order, and every op's (name, type, scopes)."""
    numbers: dict[str, str] = {}
    text = _BLOCK.sub(lambda m: numbers.setdefault(m.group(0), f"block#{len(numbers)}"), str(prog))
    scopes = [
        (op.name, op.op_type, sorted((str(source), list(values)) for source, values in op.scopes.items()))
        for block, _ in walk_blocks(prog)
        for op in block.operations
    ]
    return text, scopes
