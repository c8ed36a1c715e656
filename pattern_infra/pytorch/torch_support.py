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
* ``aten.__and__.Tensor`` (``result & mask(...)`` on those bool masks): ``Unsupported fx node ... kind
  __and__``. coremltools' ``bitwise_and`` converter (``logical_and`` on bool tensors, an error otherwise).

* ``aten.index_add`` (``out.index_add_(0, token_idx, expert_out)``, how MoE layers such as Mixtral's and
  Qwen2-MoE's eager experts accumulate each expert's tokens): ``Unsupported fx node index_add``. MIL's
  ``scatter(mode="add")`` along ``dim`` is the same sum (repeated indices accumulate); ``alpha`` scales
  the source first.
* ``aten._assert_tensor_metadata`` (torch 2.13's ``.to(dtype)`` under ``torch.export``): a check at
  export time with no output, so a converter that adds nothing (coremltools 8.3 lacks it).

Three converters coremltools has are wrong for these graphs, and are replaced where they are:

* ``aten.where.ScalarSelf`` (``torch.where(cond, scalar, tensor)``) hands ``cond`` to ``select`` as it
  comes; a float condition (``tril`` of a bool tensor converts to a float one: the sliding-window mask
  of Gemma2-style code) then fails ``select``'s type inference. The replacement casts a non-bool
  condition to bool (non-zero is true, as ``torch.where`` reads it), as coremltools' ``where.self`` does.
* ``aten.gelu`` under ``torch.export`` receives ``approximate='tanh'`` as a keyword argument, which
  coremltools 9.0's converter ignores: ``nn.GELU(approximate="tanh")`` (``gelu_pytorch_tanh``: Gemma,
  Gemma2, SigLIP, Starcoder2) becomes the exact gelu, up to 5e-4 off per activation. The replacement
  reads ``approximate`` positionally or as a keyword and emits ``gelu(mode="TANH_APPROXIMATION")``.
* ``aten.copy`` (``dst.copy_(src)``, how ``torch.export`` writes a slice assignment ``cache[..., b:e] =
  k``) gives ``src`` ``dst``'s shape: ``src`` broadcasts to it, one way. coremltools 9.0 broadcasts the
  two both ways, and where their sizes are two symbols it cannot compare (its "Recklessly broadcast"
  warning) takes the first of a set of them, so the converted program depends on ``PYTHONHASHSEED``:
  ``src``'s size, which is wrong where it is 1 and PyTorch broadcasts it, or ``dst``'s, a ``tile`` to
  it with reps computed at run time. The replacement reads what ``torch.export`` proved: the node's
  ``meta["val"]`` (fake tensors over the export's symbols, valid for every input the exported program
  accepts, whose guards it checks on each call) gives ``src`` and ``dst`` one size where the export
  proved them equal; ``src`` is tiled only where its size is the integer 1, or, where nothing is known,
  by ``shape(dst) // shape(src)`` at run time (1 or ``dst``'s size, the two cases PyTorch accepts).
  In the KV-cache update of a flexible decoder, the slice ``[S - L, S)`` is ``L`` long under the
  export's guard ``S - L >= 0`` (``ExportedProgram._guards_code``: the exported program rejects
  ``S < L``, as the eager module does): the new keys are written as they are, with no ``tile``.

:func:`install` registers them through coremltools' own torch-op registry
(``coremltools.converters.mil.frontend.torch.torch_op_registry.register_torch_op``): a missing converter
only when no converter of that name is registered (a later coremltools that adds its own keeps it); a
replacement only when coremltools' converter fails a probe of the case it gets wrong (the converter is
run on a one-node stand-in graph inside an ``mb.program``: no version is compared). Nothing happens at
``import pattern_infra``: call :func:`install` once before :func:`coremltools.convert`. Installing twice
is a no-op.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

__all__ = ["CONVERTERS", "REPLACEMENTS", "install", "installed"]

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
    shape = (
        [] if size is None else [int(d) for d in np.atleast_1d(size.val)] if size.val is not None else None
    )
    if shape is None:
        raise NotImplementedError(f"new_ones {node.name}: size must be known at conversion time")
    context.add(mb.const(val=np.ones(shape, dtype=np_dtype), name=node.name))


def _index_add(context: Any, node: Any) -> None:
    """``aten.index_add(x, dim, index, source, alpha=1)``: ``x`` with ``alpha * source[i]`` added at row
    ``index[i]`` of axis ``dim`` (repeated indices accumulate): MIL's ``scatter(mode="add")``."""
    import numpy as np
    from coremltools.converters.mil import Builder as mb
    from coremltools.converters.mil.frontend.torch.ops import _get_inputs, _get_kwinputs
    from coremltools.converters.mil.mil import types

    inputs = _get_inputs(context, node, min_expected=4)
    x, dim, index, source = inputs[:4]
    alpha = inputs[4] if len(inputs) > 4 else _get_kwinputs(context, node, "alpha", default=[None])[0]
    alpha = alpha.val if alpha is not None and hasattr(alpha, "val") else alpha
    if alpha is not None and alpha != 1:
        source = mb.mul(x=source, y=np.array(alpha, dtype=types.nptype_from_builtin(source.dtype)))
    axis = int(dim.val) if hasattr(dim, "val") else int(dim)
    axis = axis + x.rank if axis < 0 else axis
    if index.dtype != types.int32:
        index = mb.cast(x=index, dtype="int32")
    context.add(mb.scatter(data=x, indices=index, updates=source, axis=axis, mode="add", name=node.name))


def _assert_tensor_metadata(context: Any, node: Any) -> None:
    """``aten._assert_tensor_metadata``: an export-time check with no output; nothing to convert."""


def _where_scalar_self(context: Any, node: Any) -> None:
    """``aten.where.ScalarSelf(cond, scalar, x)``: ``select``, a non-bool ``cond`` cast to bool first."""
    from coremltools.converters.mil import Builder as mb
    from coremltools.converters.mil.frontend.torch.ops import _get_inputs, promote_input_dtypes
    from coremltools.converters.mil.mil import types

    cond, a, b = _get_inputs(context, node, expected=3)
    a, b = promote_input_dtypes([a, b])
    if not types.is_bool(cond.dtype):
        cond = mb.cast(x=cond, dtype="bool")
    context.add(mb.select(cond=cond, a=a, b=b, name=node.name))


def _gelu(context: Any, node: Any) -> None:
    """``aten.gelu(x, approximate='none')``, ``approximate`` read positionally or as a keyword.

    ``torch.export`` passes ``approximate`` as the literal string. coremltools looks a string argument up
    as a node name first, so a model with a node named ``tanh`` (Gemma2's soft-capping) would hand its
    ``tanh`` output over as ``approximate``: the literal is read from the node itself; any other value (a
    TorchScript constant's name) through the context.
    """
    from coremltools.converters.mil import Builder as mb
    from coremltools.converters.mil.frontend.torch.ops import _get_inputs

    x = _get_inputs(context, node, min_expected=1)[0]
    raw = node.inputs[1] if len(node.inputs) > 1 else (node.kwinputs or {}).get("approximate", [None])[0]
    approximate = raw
    if raw not in (None, "none", "tanh"):
        bound = context[raw] if isinstance(raw, str) and raw in context else raw
        approximate = bound.val if hasattr(bound, "val") else bound
    if approximate not in (None, "none", "tanh"):
        raise NotImplementedError(
            f"gelu {node.name}: approximate={approximate!r} (torch knows 'none' and 'tanh')"
        )
    mode = "TANH_APPROXIMATION" if approximate == "tanh" else "EXACT"
    context.add(mb.gelu(x=x, mode=mode, name=node.name))


def _torch_sizes(val: Any) -> list[Any] | None:
    """The sizes of a node's ``meta["val"]`` (a fake tensor) as sympy expressions in ``torch.export``'s
    symbols (ints as sympy integers); None when the node has no tensor value."""
    import sympy as sp
    import torch

    shape = getattr(val, "shape", None)
    if shape is None:
        return None
    sizes = []
    for size in shape:
        if isinstance(size, torch.SymInt):
            sizes.append(size.node.expr)  # with the shape env's replacements applied
        else:
            sizes.append(sp.Integer(int(size)))
    return sizes


def _torch_sizes_of_input(context: Any, name: str) -> list[Any] | None:
    """The ``torch.export`` sizes of the node named ``name`` of the graph being converted (None for a
    placeholder, a literal, or outside a conversion)."""
    try:
        graph = context.torch_graph
    except (AttributeError, ValueError):  # no graph: a stand-in (or a coremltools without the property)
        return None
    for node in graph.nodes:
        if name in node.outputs:
            return _torch_sizes((node.meta or {}).get("val"))
    return None


def _copy_repeats(
    dst: Any, src: Any, dst_torch: list[Any] | None, src_torch: list[Any] | None, name: str
) -> list[int | str]:
    """The repeat of each axis of ``src`` (as ``dst``'s rank) in ``copy(dst, src)`` (:func:`_copy`): an int,
    ``"dst"`` (``dst``'s size, read at run time) or ``"ratio"`` (``dst``'s size over ``src``'s, at run
    time)."""
    import sympy as sp
    from coremltools.converters.mil.mil.types.symbolic import is_symbolic

    known = dst_torch is not None and src_torch is not None and len(dst_torch) == len(src_torch) == dst.rank
    dst_torch, src_torch = dst_torch or [], src_torch or []  # read only where known
    reps: list[int | str] = []
    for axis, (d, s) in enumerate(zip(dst.shape, src.shape)):
        if (is_symbolic(d) == is_symbolic(s) and d == s) or (
            known and sp.expand(dst_torch[axis] - src_torch[axis]) == 0
        ):
            reps.append(1)
        elif (not is_symbolic(s) and s == 1) or (known and src_torch[axis] == 1):
            reps.append("dst" if is_symbolic(d) else int(d))
        elif is_symbolic(d) or is_symbolic(s):
            reps.append("ratio")
        else:
            raise ValueError(f"copy {name}: src of shape {src.shape} does not broadcast to dst's {dst.shape}")
    return reps


def _copy(context: Any, node: Any) -> None:
    """``aten.copy(dst, src)``: ``src`` broadcast to ``dst``'s shape and cast to ``dst``'s dtype.

    PyTorch's ``dst.copy_(src)`` broadcasts one way: ``src`` (rank at most ``dst``'s) takes ``dst``'s
    shape, each of its sizes equal to ``dst``'s or 1. Per axis (aligned from the right), the repeat is:

    1. 1 where the sizes are the same: equal integers, one MIL symbol, or one ``torch.export`` size (the
       ``meta["val"]`` of the copy, which has ``dst``'s shape, and of ``src``'s node: ``torch.export``
       proved them equal, under the guards the exported program checks on every call);
    2. ``dst``'s size where ``src``'s is 1 (an integer, or ``torch.export``'s size; ``dst``'s is read with
       ``shape(dst)`` when symbolic);
    3. otherwise ``shape(dst) // shape(src)`` at run time: ``dst``'s size when ``src``'s is 1, else 1,
       the two cases PyTorch accepts.

    Every repeat 1: ``src`` itself (cast when the dtypes differ); else one ``tile``.
    """
    import numpy as np
    import sympy as sp
    from coremltools.converters.mil import Builder as mb
    from coremltools.converters.mil.frontend.torch.ops import _get_inputs
    from coremltools.converters.mil.mil import types

    dst, src = _get_inputs(context, node, expected=[2, 3])[:2]
    if src.rank > dst.rank:
        raise ValueError(
            f"copy {node.name}: src of shape {src.shape} into dst of shape {dst.shape} "
            f"(PyTorch broadcasts src to dst's shape, so src's rank cannot be larger)"
        )
    src_torch = _torch_sizes_of_input(context, node.inputs[1])
    extra = dst.rank - src.rank
    if extra:
        src = mb.expand_dims(x=src, axes=list(range(extra)))
        src_torch = None if src_torch is None else [sp.Integer(1)] * extra + src_torch
    reps = _copy_repeats(dst, src, _torch_sizes((node.meta or {}).get("val")), src_torch, node.name)
    out = src
    if all(isinstance(r, int) for r in reps):
        if any(r != 1 for r in reps):
            out = mb.tile(x=src, reps=reps)
    else:
        dst_shape, src_shape = mb.shape(x=dst), mb.shape(x=src) if "ratio" in reps else None
        parts = []
        for axis, r in enumerate(reps):
            if isinstance(r, int):
                parts.append(np.array([r], dtype=np.int32))
                continue
            size = mb.gather(x=dst_shape, indices=[axis], axis=0)
            parts.append(
                size if r == "dst" else mb.floor_div(x=size, y=mb.gather(x=src_shape, indices=[axis], axis=0))
            )
        out = mb.tile(x=src, reps=mb.concat(values=parts, axis=0))
    if out.dtype != dst.dtype:
        out = mb.cast(x=out, dtype=types.builtin_to_string(dst.dtype))
    context.add(out, torch_name=node.name)


CONVERTERS: dict[str, Callable[[Any, Any], None]] = {
    "alias": _alias,
    "where.scalarother": _same_as("where"),
    "new_ones": _new_ones,
    "__and__": _same_as("bitwise_and"),
    "index_add": _index_add,
    "_assert_tensor_metadata": _assert_tensor_metadata,
}
"""Converter of each PyTorch op kind, as coremltools' frontend names an fx node (lower case, no ``aten.``
prefix, no ``.default``/``.Tensor`` suffix), that :func:`install` adds."""


def _run_on_stand_in(
    convert: Callable[[Any, Any], None],
    kind: str,
    args: Callable[[Any], list[Any]],
    kwargs: dict[str, Sequence[Any]] | None = None,
    names: tuple[str, ...] = (),
) -> Any:
    """Runs converter ``convert`` on a one-node ``torch.export`` graph of ``kind`` inside an ``mb.program``.

    Args:
        convert: A converter, as coremltools' registry holds them.
        kind: The node's op kind.
        args: Called with the program's input (fp32, shape (2, 2)); returns the node's positional inputs
            (MIL vars, or literals as ``torch.export`` passes them).
        kwargs: The node's keyword inputs, as ``torch.export`` passes them (each a sequence of bindings).
        names: Names of other nodes of the graph (each bound to the input), which a string argument may
            collide with.

    Returns:
        The program (an exception of the converter or of MIL's type inference propagates).
    """
    from coremltools.converters.mil import Builder as mb
    from coremltools.converters.mil.frontend.torch.converter import TranscriptionContext
    from coremltools.converters.mil.frontend.torch.internal_graph import InternalTorchIRNode
    from coremltools.converters.mil.frontend.torch.utils import TorchFrontend

    @mb.program(input_specs=[mb.TensorSpec(shape=(2, 2))])
    def prog(x: Any) -> Any:
        context = TranscriptionContext(frontend=TorchFrontend.TORCHEXPORT)
        for name in names:
            context.add(mb.identity(x=x), torch_name=name)
        inputs = []
        for i, value in enumerate(args(x)):
            inputs.append(f"input{i}")
            context.add(value, torch_name=inputs[-1])
        convert(context, InternalTorchIRNode(kind=kind, inputs=inputs, outputs=["out"], kwinputs=kwargs))
        return context["out"]

    return prog


def _selects_with_a_float_condition(convert: Callable[[Any, Any], None]) -> bool:
    """Whether ``convert`` (a ``where.scalarself`` converter) accepts a float condition."""
    from coremltools.converters.mil import Builder as mb

    try:
        _run_on_stand_in(convert, "where.scalarself", lambda x: [x, mb.const(val=-1.0), x])
    except Exception:  # MIL's type inference rejects the float cond (a ValueError in coremltools 8.3 and 9.0)
        return False
    return True


def _reads_approximate_keyword(convert: Callable[[Any, Any], None]) -> bool:
    """Whether ``convert`` (a ``gelu`` converter) makes the tanh gelu of ``gelu(x, approximate='tanh')``,
    also in a graph with a node named ``tanh``."""
    try:
        prog = _run_on_stand_in(convert, "gelu", lambda x: [x], {"approximate": ("tanh",)}, names=("tanh",))
    except Exception:
        return False
    modes = [op.mode.val for op in prog.functions["main"].operations if op.op_type == "gelu"]
    return modes == ["TANH_APPROXIMATION"]


def _broadcasts_to_the_destination(convert: Callable[[Any, Any], None]) -> bool:
    """Whether ``convert`` (a ``copy`` converter) broadcasts ``src`` of shape ``(1, 2)`` to ``dst``'s
    ``(3, 2)`` when the program declares the two first sizes as different symbols.

    PyTorch's ``dst.copy_(src)`` takes ``dst``'s shape. coremltools 9.0 broadcasts both ways and takes
    the first symbol of a set (``pymil_broadcast_shapes``), ``src``'s or ``dst``'s depending on
    ``PYTHONHASHSEED``: the probe draws symbols until that set lists ``src``'s first, where taking it
    leaves ``src`` one row long. The program runs in the reference evaluator.
    """
    import numpy as np
    from coremltools.converters.mil import Builder as mb
    from coremltools.converters.mil.frontend.torch.converter import TranscriptionContext
    from coremltools.converters.mil.frontend.torch.internal_graph import InternalTorchIRNode
    from coremltools.converters.mil.frontend.torch.utils import TorchFrontend
    from coremltools.converters.mil.mil import get_new_symbol
    from coremltools.converters.mil.mil.passes.pass_registry import PASS_REGISTRY

    from ..verification.evaluator import evaluate

    a, b = get_new_symbol(), get_new_symbol()
    for _ in range(64):
        if next(iter({a, b})) is b:
            break
        a, b = get_new_symbol(), get_new_symbol()
    # the probe is no conversion: coremltools' warnings while it runs ("Recklessly broadcast") would mislead
    quiet = logging.Filter("coremltools.probe")  # lets through only that logger's records, which none are
    coremltools_logger = logging.getLogger("coremltools")
    coremltools_logger.addFilter(quiet)
    try:

        @mb.program(input_specs=[mb.TensorSpec(shape=(a, 2)), mb.TensorSpec(shape=(b, 2))])
        def prog(dst: Any, src: Any) -> Any:
            context = TranscriptionContext(frontend=TorchFrontend.TORCHEXPORT)
            context.add(dst, torch_name="dst")
            context.add(src, torch_name="src")
            convert(context, InternalTorchIRNode(kind="copy", inputs=["dst", "src"], outputs=["out"]))
            return mb.identity(x=context["out"])

        PASS_REGISTRY["common::dead_code_elimination"](prog)  # the run reads only what the output needs
        src = np.array([[1.0, 2.0]], dtype=np.float32)
        (out,) = evaluate(prog, {"dst": np.zeros((3, 2), dtype=np.float32), "src": src}).values()
    except Exception:  # the converter, MIL's type inference or the run failed: not the right converter
        return False
    finally:
        coremltools_logger.removeFilter(quiet)
    return np.shape(out) == (3, 2) and bool(np.all(out == src))


REPLACEMENTS: dict[str, tuple[Callable[[Any, Any], None], Callable[[Callable[[Any, Any], None]], bool]]] = {
    "where.scalarself": (_where_scalar_self, _selects_with_a_float_condition),
    "gelu": (_gelu, _reads_approximate_keyword),
    "copy": (_copy, _broadcasts_to_the_destination),
}
"""Op kinds whose coremltools converter is wrong for some graphs: our converter, and the probe that says
whether a registered converter gets that case right (:func:`install` replaces it when not)."""


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
    """The op kinds of :data:`CONVERTERS` that coremltools' registry currently converts, then those of
    :data:`REPLACEMENTS` whose converter in the registry is ours."""
    from coremltools.converters.mil.frontend.torch.torch_op_registry import _TORCH_OPS_REGISTRY

    mapping = _TORCH_OPS_REGISTRY.name_to_func_mapping
    ours = [
        kind for kind, (func, _) in REPLACEMENTS.items() if all(mapping.get(k) is func for k in _keys(kind))
    ]
    return [kind for kind in CONVERTERS if _registered(kind)] + ours


def install() -> list[str]:
    """Register the converters of :data:`CONVERTERS` that coremltools does not have, and those of
    :data:`REPLACEMENTS` where coremltools' converter fails the probe.

    Each missing converter goes through coremltools' ``register_torch_op`` under each key coremltools
    reads for the op kind that has no converter yet (a key ending in ``_``, which ``register_torch_op``
    reserves for in-place ops, through the registry's ``set_func_by_name``); a key coremltools already has
    keeps its converter. A replacement takes every key of its op kind, once the registered converter has
    failed its probe (a converter that passes it, e.g. a later coremltools' fixed one, is kept).

    Returns:
        The op kinds registered by this call (empty when coremltools already converts them all, e.g. on a
        second call).
    """
    from coremltools.converters.mil.frontend.torch.torch_op_registry import (
        _TORCH_OPS_REGISTRY,
        register_torch_op,
    )

    mapping = _TORCH_OPS_REGISTRY.name_to_func_mapping
    added = []
    for kind, func in CONVERTERS.items():
        missing = [key for key in _keys(kind) if key not in mapping]
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
    for kind, (func, right) in REPLACEMENTS.items():
        theirs = mapping.get(_keys(kind)[0])
        if theirs is func or (theirs is not None and right(theirs)):
            continue
        for key in _keys(kind):
            _TORCH_OPS_REGISTRY.set_func_by_name(func, key)
        added.append(kind)
        logger.debug(f"replaced the converter of torch op {kind!r} ({getattr(theirs, '__name__', theirs)})")
    return added
