"""Random inputs for a program: one value per function input, of the declared shape and dtype
(:func:`random_inputs`), a symbolic dimension given a small size."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Final

import numpy as np
from coremltools.converters.mil.mil import types
from coremltools.converters.mil.mil.types.symbolic import is_symbolic

from pattern_infra.verification.errors import EvaluationError

__all__ = ["random_inputs", "sizes_in_ranges"]

_DEFAULT_SYMBOL_SIZES: Final = (3, 4, 5, 2, 6, 7)
_INT_INPUT_HIGH: Final = 4  # random integer inputs are drawn from [0, 4)


def random_inputs(
    prog: Any,
    *,
    seed: int = 0,
    function: str = "main",
    sizes_for_symbols: Mapping[Any, int] | None = None,
) -> dict[str, np.ndarray]:
    """Draw one random value per function input, with the declared shapes and dtypes.

    Floating inputs come from a standard normal distribution, integer inputs uniformly from
    ``[0, 4)``, booleans are fair coin flips. A symbolic dimension becomes a small concrete size;
    every occurrence of the same symbol gets the same size. Deterministic for a given seed.

    Args:
        prog: A coremltools ``Program``.
        seed: Seed of the numpy generator.
        function: The function whose inputs are drawn.
        sizes_for_symbols: Sizes for symbolic dimensions, keyed by symbol (or its name, e.g.
            ``"is0"``). Unlisted symbols get sizes 3, 4, 5, 2, 6, 7, ... in order of first use.

    Returns:
        One array per input, keyed by input name, in the function's input order.

    Raises:
        EvaluationError: An input has a type that is neither a float, integer nor bool tensor.
    """
    if function not in prog.functions:
        raise EvaluationError(f"The program has no function '{function}'; it has {sorted(prog.functions)}.")
    func = prog.functions[function]
    rng = np.random.default_rng(seed)
    sizes = {str(key): int(value) for key, value in (sizes_for_symbols or {}).items()}
    defaults_used = 0
    arrays: dict[str, np.ndarray] = {}
    for name, var in func.inputs.items():
        shape = []
        for dim in var.shape:
            if not is_symbolic(dim):
                shape.append(int(dim))
                continue
            key = str(dim)
            if key not in sizes:
                sizes[key] = _DEFAULT_SYMBOL_SIZES[defaults_used % len(_DEFAULT_SYMBOL_SIZES)]
                defaults_used += 1
            shape.append(sizes[key])
        dtype = var.dtype
        np_type = np.dtype(types.nptype_from_builtin(dtype))
        if types.is_float(dtype):
            arrays[name] = rng.standard_normal(shape).astype(np_type)
        elif types.is_bool(dtype):
            arrays[name] = rng.random(shape) < 0.5
        elif types.is_int(dtype):
            arrays[name] = rng.integers(0, _INT_INPUT_HIGH, size=shape).astype(np_type)
        else:
            raise EvaluationError(
                f"Input '{name}' has type {types.builtin_to_string(dtype)}; random_inputs draws float, "
                "integer and bool tensors only. Pass inputs explicitly."
            )
    return arrays


def sizes_in_ranges(prog: Any, description: Any, *, function: str = "main") -> dict[str, int]:
    """Sizes for the symbolic dimensions of ``prog``'s inputs within the ranges a saved model declares.

    A flexible dimension of a model input (``ct.RangeDim``: ``shapeRange.sizeRanges``) gets the size
    :func:`random_inputs` would give it (3, 4, 5, ... in order of first use), moved into its range;
    enumerated shapes (``ct.EnumeratedShapes``) give the first shape listed; an image's height and
    width ranges (``imageSizeRange``) or first enumerated size likewise.

    Args:
        prog: The model's MIL program.
        description: The model specification's ``description`` (its ``input`` entries are read).
        function: The function whose inputs are sized.

    Returns:
        Symbol name to size, for ``sizes_for_symbols``.
    """
    inputs = prog.functions[function].inputs
    sizes: dict[str, int] = {}
    for feature in description.input:
        var = inputs.get(feature.name)
        if var is None or not hasattr(var, "shape"):
            continue
        choices = _declared_dims(feature.type, len(var.shape))
        for dim, choice in zip(var.shape, choices):
            if not is_symbolic(dim) or str(dim) in sizes:
                continue
            default = _DEFAULT_SYMBOL_SIZES[len(sizes) % len(_DEFAULT_SYMBOL_SIZES)]
            if isinstance(choice, int):
                sizes[str(dim)] = choice
            else:
                lower, upper = choice
                sizes[str(dim)] = max(lower, default if upper < 0 else min(default, upper))
    return sizes


def _declared_dims(feature_type: Any, rank: int) -> list[int | tuple[int, int]]:
    """Per dimension, the size an input's type fixes or its (lower, upper) range (upper -1: unbounded)."""
    free: list[int | tuple[int, int]] = [(1, -1)] * rank
    kind = feature_type.WhichOneof("Type")
    if kind == "multiArrayType":
        array = feature_type.multiArrayType
        flexible = array.WhichOneof("ShapeFlexibility")
        if flexible == "shapeRange":
            return [(int(r.lowerBound), int(r.upperBound)) for r in array.shapeRange.sizeRanges]
        if flexible == "enumeratedShapes" and array.enumeratedShapes.shapes:
            return [int(d) for d in array.enumeratedShapes.shapes[0].shape]
    elif kind == "imageType" and rank >= 2:
        image = feature_type.imageType
        flexible = image.WhichOneof("SizeFlexibility")
        if flexible == "imageSizeRange":
            ranges = image.imageSizeRange
            height = (int(ranges.heightRange.lowerBound), int(ranges.heightRange.upperBound))
            width = (int(ranges.widthRange.lowerBound), int(ranges.widthRange.upperBound))
            return free[:-2] + [height, width]
        if flexible == "enumeratedSizes" and image.enumeratedSizes.sizes:
            first = image.enumeratedSizes.sizes[0]
            return free[:-2] + [int(first.height), int(first.width)]
    return free
