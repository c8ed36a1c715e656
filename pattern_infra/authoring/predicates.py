"""Ready predicates for ``var_constraints``, after the TFLite matcher's tensor and op rules.

Each takes program variables or ops (as found on a :class:`~pattern_infra.language.pattern.Pattern`) and
returns a plain ``bool``; combine them with ``and``::

    def var_constraints(p):
        return is_constant(p.conv.weight) and rank_is(p.root_var, 4) and scalar_close_to(p.mul.y, 0.5)

A program read back from a saved ``.mlpackage`` (coremltools' milproto loader) holds numpy scalars as
attribute values (``numpy.bool_``, ``numpy.int32``, ``numpy.float16``), a converted one Python values:
``op.keep_dims.val is True`` holds for the second only. Read attributes with :func:`value_of` or
:func:`attr_is`, which give the same answer for both, and compare float constants with a tolerance no
finer than their dtype's (:func:`dtype_rtol`): a float16 ``1 / sqrt(128)`` is ``0.08837890625``.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import numpy as np
from coremltools.converters.mil.mil import Operation, Var, types
from coremltools.converters.mil.mil.types.symbolic import is_symbolic

__all__ = [
    "attr_is",
    "dtype_rtol",
    "value_of",
    "is_constant",
    "is_constexpr",
    "scalar_close_to",
    "has_one_consumer",
    "has_consumers",
    "rank_is",
    "dtype_is",
    "shape_known",
    "broadcastable",
    "same_shape",
    "not_block_output",
    "axes_are",
]


def is_constant(var: Var) -> bool:
    """The variable has a compile-time value (TFLite ``TensorHasData``)."""
    return var is not None and var.val is not None


def value_of(var: Var | None) -> Any:
    """A constant's value with numpy scalars made Python ones: ``numpy.bool_`` -> ``bool``, ``numpy.int32``
    -> ``int``, ``numpy.float16`` -> ``float``, a 0-d array -> its element; arrays of more elements stay
    arrays. None when ``var`` is None or not a compile-time constant."""
    if var is None or var.val is None:
        return None
    value = var.val
    if isinstance(value, np.ndarray) and value.ndim == 0:
        value = value[()]
    return value.item() if isinstance(value, np.generic) else value


def attr_is(op: Operation, name: str, value: Any) -> bool:
    """``op``'s input ``name`` is a constant equal to ``value``, of the same kind:
    ``attr_is(mean, "keep_dims", True)`` holds for ``True`` and ``numpy.True_``, not for ``1``; False when
    the input is absent."""
    got = value_of(getattr(op, name, None))
    if got is None or isinstance(got, np.ndarray):
        return False
    if isinstance(value, bool) or isinstance(got, bool):
        return type(got) is type(value) and got == value
    return bool(got == value)


def dtype_rtol(var: Var, floor: float = 0.0) -> float:
    """The relative rounding error of a value stored in ``var``'s float dtype (its unit roundoff: 2**-11
    for float16, 2**-24 for float32), at least ``floor``; ``floor`` for any other dtype.

    Use it for a tolerance on a constant the program holds: a float16 ``1 / sqrt(128)`` differs from the
    real number by 1.1e-4 of it, which a float32 tolerance (``1e-6``) would refuse.
    """
    dtype = var.dtype
    if types.is_tensor(var.sym_type):
        dtype = var.sym_type.get_primitive()
    if dtype == types.fp16:
        return max(floor, 2.0**-11)
    if dtype == types.fp32:
        return max(floor, 2.0**-24)
    return floor


def is_constexpr(var: Var) -> bool:
    """The variable comes from a ``constexpr_*`` op (compressed weights: not foldable)."""
    return var is not None and var.op is not None and var.op.op_type.startswith("constexpr_")


def scalar_close_to(var: Var, value: float, *, rtol: float = 1e-5, atol: float = 1e-6) -> bool:
    """A constant with exactly one element, close to ``value``."""
    if not is_constant(var):
        return False
    arr = np.asarray(var.val)
    return arr.size == 1 and bool(np.isclose(arr.reshape(()).item(), value, rtol=rtol, atol=atol))


def has_consumers(var: Var, count: int) -> bool:
    """The variable is used exactly ``count`` times (each use counted)."""
    return len(var.child_ops) == count


def has_one_consumer(var: Var) -> bool:
    """The variable is used exactly once (TFLite ``TensorsHaveOneConsumer``)."""
    return has_consumers(var, 1)


def rank_is(var: Var, *ranks: int) -> bool:
    """The variable's rank is one of ``ranks`` (unknown rank: False)."""
    shape = var.shape
    return shape is not None and len(shape) in ranks


def dtype_is(var: Var, *dtypes: str) -> bool:
    """The element type is one of ``dtypes``, given as MIL names: "fp16", "fp32", "int32", "bool"..."""
    dtype = var.dtype
    if types.is_tensor(var.sym_type):
        dtype = var.sym_type.get_primitive()
    return types.builtin_to_string(dtype) in dtypes


def shape_known(var: Var) -> bool:
    """Every dimension is a known integer (no symbol)."""
    return var.shape is not None and not any(is_symbolic(d) for d in var.shape)


def broadcastable(a: Var, b: Var) -> bool:
    """The two shapes broadcast against each other (symbolic dims must be equal or meet a 1)."""
    if a.shape is None or b.shape is None:
        return False
    for x, y in zip(reversed(a.shape), reversed(b.shape)):
        if x == y or x == 1 or y == 1:
            continue
        return False
    return True


def same_shape(a: Var, b: Var) -> bool:
    """Identical shapes, symbolic dims compared by identity."""
    return a.shape is not None and b.shape is not None and tuple(a.shape) == tuple(b.shape)


def not_block_output(ops: Iterable[Operation]) -> bool:
    """No output of these ops is an output of any block."""
    return all(not v.consuming_blocks for op in ops for v in op.outputs)


def axes_are(var: Var, rank: int, *allowed: Iterable[int]) -> bool:
    """A constant axes list equal, after normalising negatives against ``rank``, to one of ``allowed``."""
    if not is_constant(var):
        return False
    got = sorted(int(a) % rank for a in np.atleast_1d(var.val))
    return any(got == sorted(int(a) % rank for a in choice) for choice in allowed)
