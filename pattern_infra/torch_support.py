"""Converters coremltools 9.0 lacks for the graphs ``torch.export`` makes of Hugging Face models.

``torch.export`` of a ``transformers`` CausalLM called as users call it (``model(input_ids).logits``)
contains nodes coremltools 9.0's PyTorch frontend rejects:

* ``aten.alias`` (from ``hidden_states[:, -0:, :]``, the ``logits_to_keep`` slice):
  ``Unsupported fx node alias``. An alias is a view of its input with the same values: the converter
  returns its input, exactly as coremltools' own converter of ``alias_copy``, ``clone`` and ``detach``.
* ``aten.where.ScalarOther`` (``torch.where(cond, tensor, scalar)``, in the causal-mask code):
  ``Unsupported fx node where``. coremltools converts ``where.self`` (two tensors) and
  ``where.ScalarSelf``; the scalar-other form is the same ``select(cond, a, b)``, which coremltools'
  ``where.self`` converter already builds (it promotes the scalar to the tensor's dtype).
* ``aten.new_ones`` (``q_idx.new_ones((), dtype=torch.bool)``, where ``transformers`` combines mask
  functions, e.g. Mistral's sliding window): ``Unsupported fx node new_ones``. A constant of ones of
  the given size and dtype (the size must be known at conversion time).
* ``aten.__and__.Tensor`` (``result & mask(...)`` on those bool masks): ``Unsupported fx node ... kind __and__``.
  coremltools' ``bitwise_and`` converter (``logical_and`` on bool tensors, an error otherwise).

:func:`install` registers them through coremltools' own torch-op registry
(``coremltools.converters.mil.frontend.torch.torch_op_registry.register_torch_op``), each only when no
converter of that name is registered (a later coremltools that adds its own keeps it). Nothing happens
at ``import pattern_infra``: call :func:`install` once before :func:`coremltools.convert`. Installing
twice is a no-op.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

__all__ = ["CONVERTERS", "install", "installed"]

logger = logging.getLogger(__name__)


def _alias(context: Any, node: Any) -> None:
    """``aten.alias(x)``: a view of ``x`` with the same values, so ``x`` itself."""
    from coremltools.converters.mil.frontend.torch.ops import _get_inputs

    x = _get_inputs(context, node, expected=1)[0]
    context.add(x, torch_name=node.name)


def _same_as(kind: str) -> Callable[[Any, Any], None]:
    """A converter that calls coremltools' own converter of ``kind`` (an op kind missing from its aliases)."""

    def convert(context: Any, node: Any) -> None:
        from coremltools.converters.mil.frontend.torch.torch_op_registry import _TORCH_OPS_REGISTRY

        _TORCH_OPS_REGISTRY.get_func(kind)(context, node)

    return convert


def _new_ones(context: Any, node: Any) -> None:
    """``aten.new_ones(x, size, dtype=...)``: a constant of ones (``x`` only lends device and dtype).

    The size must be known at conversion time (the mask code calls it with ``()``); the dtype is the
    ``dtype`` keyword, else ``x``'s.
    """
    import numpy as np
    from coremltools.converters.mil import Builder as mb
    from coremltools.converters.mil.frontend.torch.ops import _get_inputs, _get_kwinputs
    from coremltools.converters.mil.frontend.torch.utils import NUM_TO_NUMPY_DTYPE, TORCH_DTYPE_TO_NUM
    from coremltools.converters.mil.mil import types

    inputs = _get_inputs(context, node, min_expected=2)
    x, size = inputs[0], inputs[1]
    dtype = _get_kwinputs(context, node, "dtype", default=[None])[0]
    dtype = dtype.val if dtype is not None and hasattr(dtype, "val") else dtype
    if dtype is None:
        np_dtype = types.nptype_from_builtin(x.dtype)
    elif isinstance(dtype, (int, np.integer)):
        np_dtype = NUM_TO_NUMPY_DTYPE[int(dtype)]
    else:
        np_dtype = NUM_TO_NUMPY_DTYPE[TORCH_DTYPE_TO_NUM[dtype]]
    shape = [] if size is None else [int(d) for d in np.atleast_1d(size.val)] if size.val is not None else None
    if shape is None:
        raise NotImplementedError(f"new_ones {node.name}: size must be known at conversion time")
    context.add(mb.const(val=np.ones(shape, dtype=np_dtype), name=node.name))


CONVERTERS: dict[str, Callable[[Any, Any], None]] = {
    "alias": _alias,
    "where.scalarother": _same_as("where"),
    "new_ones": _new_ones,
    "__and__": _same_as("bitwise_and"),
}
"""Converter of each PyTorch op kind, as coremltools' frontend names an fx node (lower case, no ``aten.``
prefix, no ``.default``/``.Tensor`` suffix), that :func:`install` adds."""


def _keys(kind: str) -> list[str]:
    """The registry keys coremltools reads for ``kind``.

    The frontend checks ``kind in registry`` with the fx node's name (``__and__``) and then looks the
    converter up through ``sanitize_op_kind``, which also strips ``__`` around it (``and``): a converter
    must be under both.
    """
    from coremltools.converters.mil.frontend.torch.utils import sanitize_op_kind

    return list(dict.fromkeys([kind, sanitize_op_kind(kind)]))


def _registered(kind: str) -> bool:
    from coremltools.converters.mil.frontend.torch.torch_op_registry import _TORCH_OPS_REGISTRY

    return all(key in _TORCH_OPS_REGISTRY.name_to_func_mapping for key in _keys(kind))


def installed() -> list[str]:
    """The op kinds of :data:`CONVERTERS` that coremltools' registry currently converts."""
    return [kind for kind in CONVERTERS if _registered(kind)]


def install() -> list[str]:
    """Register the converters of :data:`CONVERTERS` that coremltools does not have.

    Each goes through coremltools' ``register_torch_op`` under each key coremltools reads for the op kind
    that has no converter yet (a key ending in ``_``, which ``register_torch_op`` reserves for in-place
    ops, through the registry's ``set_func_by_name``); a key coremltools already has keeps its converter.

    Returns:
        The op kinds registered by this call (empty when coremltools already converts them all, e.g. on a
        second call).
    """
    from coremltools.converters.mil.frontend.torch.torch_op_registry import (
        _TORCH_OPS_REGISTRY,
        register_torch_op,
    )

    added = []
    for kind, func in CONVERTERS.items():
        missing = [key for key in _keys(kind) if key not in _TORCH_OPS_REGISTRY.name_to_func_mapping]
        if not missing:
            continue
        for key in missing:
            if key.endswith("_"):
                # register_torch_op refuses names ending in "_" (taken for in-place ops), such as "__and__"
                _TORCH_OPS_REGISTRY.set_func_by_name(func, key)
            else:
                func.__name__ = key  # the registry keys a converter by its function's name
                register_torch_op(func)
        added.append(kind)
        logger.debug(f"registered a converter for torch op {kind!r} under {missing}")
    return added
