"""Convert PyTorch modules and MIL programs with coremltools, with or without the pass override.

The recipe works without a macOS runtime: ``torch.export.export(...).run_decompositions({})`` then
``coremltools.convert(..., convert_to="mlprogram", skip_model_load=True)``; the MIL program after every
pass of the pipeline is ``mlmodel._mil_program``.

Defaults, which every keyword argument of :func:`coremltools.convert` can override:

* ``compute_precision=coremltools.precision.FLOAT32``, so that numerics compare tightly (the default
  FLOAT16 would also insert ``cast`` ops around the whole program);
* ``minimum_deployment_target=coremltools.target.iOS16`` for PyTorch models (see :data:`DEFAULT_TARGET`).

The override is the environment variable ``ENABLE_EXPERIMENTAL_PASSES``; :func:`experimental_passes`
sets it for the duration of one conversion. A conversion with ``override=True`` first imports
:mod:`generic_passes`, so the project's passes are registered: without them the variable would silently
change nothing.
"""

from __future__ import annotations

import collections
import contextlib
import copy
import importlib
import logging
import os
from collections.abc import Iterator
from typing import Any

import coremltools
from coremltools.converters.mil.mil import Block, Program

from ..passes.container import ENV_VAR, override

__all__ = [
    "DEFAULT_TARGET",
    "ENV_VAR",
    "convert_exported",
    "convert_exported_model",
    "convert_mil",
    "convert_torch",
    "convert_torch_model",
    "count_ops",
    "experimental_passes",
    "iter_ops",
    "op_counts",
]

logger = logging.getLogger(__name__)

DEFAULT_TARGET = coremltools.target.iOS16
"""Deployment target of :func:`convert_torch` unless the caller passes ``minimum_deployment_target``.

coremltools 9.0 produces the very same op graph for every zoo model at iOS15, iOS16, iOS17 and iOS18
(``sdpa``, new in iOS18, is only made from ``F.scaled_dot_product_attention``, which the zoo does not
call), so the target is chosen for what it checks: the oldest target commonly required today keeps the
converted models deployable widely, and a rewrite that emits an op or op version newer than the target is
rejected by coremltools' opset checks instead of passing unnoticed.
"""


@contextlib.contextmanager
def experimental_passes(enabled: bool) -> Iterator[None]:
    """Set ``ENABLE_EXPERIMENTAL_PASSES`` for the duration of the ``with`` block.

    The variable is ``"1"`` when ``enabled`` and absent otherwise; its previous value (or absence) is
    restored on exit, also when the block raises.

    Args:
        enabled: Whether the generic-pass override should be active inside the block.

    Yields:
        Nothing.
    """
    with override(enabled):
        logger.debug(f"{ENV_VAR} set to {os.environ.get(ENV_VAR)!r}")
        yield


def _register_generic_passes(override: bool) -> None:
    """Import :mod:`generic_passes` (registering every project pass) when the override is requested."""
    if override:
        importlib.import_module("generic_passes")


def _with_defaults(convert_kwargs: dict[str, Any]) -> dict[str, Any]:
    """Fill in the keyword arguments of :func:`coremltools.convert` that every conversion here shares."""
    kwargs = dict(convert_kwargs)
    kwargs.setdefault("convert_to", "mlprogram")
    kwargs.setdefault("skip_model_load", True)
    kwargs.setdefault("compute_precision", coremltools.precision.FLOAT32)
    return kwargs


def convert_torch_model(
    module: Any, example_args: tuple[Any, ...], *, override: bool, **convert_kwargs: Any
) -> Any:
    """:func:`convert_torch`, returning the ``MLModel`` (to save it) rather than its MIL program."""
    import torch  # Imported here: the core framework never needs torch.

    from ..pytorch import torch_support

    torch_support.install()
    exported = torch.export.export(module.eval(), tuple(example_args)).run_decompositions({})
    logger.debug(f"converting {type(module).__name__} with override={override}")
    return convert_exported_model(exported, override=override, **convert_kwargs)


def convert_torch(
    module: Any, example_args: tuple[Any, ...], *, override: bool, **convert_kwargs: Any
) -> Program:
    """Export a PyTorch module with :mod:`torch.export` and convert it to an ML program.

    The converters of :func:`pattern_infra.pytorch.torch_support.install` are installed first (``.to(dtype)``
    exports an ``_assert_tensor_metadata`` node, which coremltools 8.3 does not convert).

    Args:
        module: A :class:`torch.nn.Module`; it is put in ``eval()`` mode.
        example_args: Positional example inputs for :func:`torch.export.export`.
        override: Whether the generic-pass override is enabled during conversion (see
            :func:`experimental_passes`); when true, :mod:`generic_passes` is imported first.
        **convert_kwargs: Extra keyword arguments for :func:`coremltools.convert`; they win over the
            defaults (``convert_to="mlprogram"``, ``skip_model_load=True``, FLOAT32 compute precision,
            :data:`DEFAULT_TARGET`).

    Returns:
        The MIL program after the whole pass pipeline.
    """
    return convert_torch_model(module, example_args, override=override, **convert_kwargs)._mil_program


def convert_exported_model(exported: Any, *, override: bool, **convert_kwargs: Any) -> Any:
    """Convert an already exported program (``torch.export.export(...).run_decompositions({})``) to an
    ``MLModel``.

    Converting does not change ``exported``, so one export serves several conversions (override off and
    on, several deployment targets).

    Args:
        exported: A :class:`torch.export.ExportedProgram`.
        override: As for :func:`convert_torch`.
        **convert_kwargs: As for :func:`convert_torch`.

    Returns:
        The converted model.
    """
    kwargs = _with_defaults(convert_kwargs)
    kwargs.setdefault("minimum_deployment_target", DEFAULT_TARGET)
    _register_generic_passes(override)
    with experimental_passes(override):
        return coremltools.convert(exported, **kwargs)


def convert_exported(exported: Any, *, override: bool, **convert_kwargs: Any) -> Program:
    """:func:`convert_exported_model`, returning the MIL program after the whole pass pipeline."""
    return convert_exported_model(exported, override=override, **convert_kwargs)._mil_program


def convert_mil(prog: Program, *, override: bool, **kwargs: Any) -> Program:
    """Run :func:`coremltools.convert` on a copy of an ``mb.program``.

    The passes of the pipeline mutate the program they convert, so the caller's program is deep-copied
    first and stays untouched. No deployment target is forced: coremltools infers it from the opset the
    program was built with, unless ``minimum_deployment_target`` is passed.

    Args:
        prog: The program to convert, e.g. one built with ``@mb.program``.
        override: Whether the generic-pass override is enabled during conversion; when true,
            :mod:`generic_passes` is imported first.
        **kwargs: Extra keyword arguments for :func:`coremltools.convert` (e.g. ``pass_pipeline``); they win
            over the defaults (``convert_to="mlprogram"``, ``skip_model_load=True``, FLOAT32 precision).

    Returns:
        The converted copy of ``prog`` after the whole pass pipeline.
    """
    prog_copy = copy.deepcopy(prog)
    _register_generic_passes(override)
    with experimental_passes(override):
        mlmodel = coremltools.convert(prog_copy, **_with_defaults(kwargs))
    return mlmodel._mil_program


def _iter_block_ops(block: Block) -> Iterator[Any]:
    for op in block.operations:
        yield op
        for nested in op.blocks:
            yield from _iter_block_ops(nested)


def iter_ops(prog: Program) -> Iterator[Any]:
    """Yield every op of every function in program order, descending into nested blocks.

    Functions are visited in the order of ``prog.functions``; the ops of a nested block (``cond``,
    ``while_loop``) come right after the op that owns them.

    Args:
        prog: A MIL program.

    Yields:
        Each :class:`~coremltools.converters.mil.mil.Operation`, ``const`` ops included.
    """
    for function in prog.functions.values():
        yield from _iter_block_ops(function)


def op_counts(prog: Program) -> collections.Counter[str]:
    """Count ops by type over all functions and all blocks, nested ones included.

    Nothing is excluded: ``const`` ops are counted under ``"const"`` (use :func:`count_ops` for a total
    without them).

    Args:
        prog: A MIL program.

    Returns:
        A counter from op type to number of ops.
    """
    return collections.Counter(op.op_type for op in iter_ops(prog))


def count_ops(prog: Program, include_const: bool = False) -> int:
    """Total number of ops over all functions and nested blocks.

    Args:
        prog: A MIL program.
        include_const: Whether ``const`` ops count.

    Returns:
        The number of ops.
    """
    return sum(1 for op in iter_ops(prog) if include_const or op.op_type != "const")
