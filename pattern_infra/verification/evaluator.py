"""Reference evaluator: runs a coremltools MIL ``Program`` in numpy.

The evaluator gives every op a small, independent numpy definition read from the op's definition in
``coremltools/converters/mil/mil/ops/defs/`` (docstrings first, then ``default_inputs`` and
``type_inference``). It is the oracle the verification helpers compare a rewritten program against,
so it is written for clarity and for agreement with the op definitions, not for speed.

Design (tinygrad / xDSL style): a table maps each op type to a short function that receives an
:class:`OpContext` and returns the op's output value(s)::

    @register_op_semantics("relu")
    def _relu(ctx: OpContext) -> np.ndarray:
        return np.maximum(ctx.array("x"), 0)

How a program runs:

1. Function inputs are checked against the declared shapes (a symbolic dimension binds to one size
   for the whole call, so two inputs sharing a symbol must agree) and converted to the working dtype.
2. Ops run in program order. An op whose type has semantics in the table is computed by that
   function, even when coremltools already inferred a compile-time value for it (coremltools' value
   inference is not always faithful: ``concat(interleave=True)`` folds as a plain concat). An op with
   no semantics but with compile-time values on every output is read from ``var.val``; any other
   op raises :class:`~pattern_infra.verification.errors.UnsupportedOpError`: the evaluator never guesses.
3. Each result is cast to its output var's dtype (see *Precision*) and its shape is checked against
   every static dimension the program declares, so a wrong semantics or a wrong type inference
   surfaces at the op that produced it.
4. ``cond`` and ``while_loop`` evaluate their nested blocks with a scope that sees the enclosing
   values.
5. State (iOS18 stateful models, ``coremltools.StateType``): a function input of state type is not
   passed in ``inputs`` but held in a mutable mapping passed as ``state`` (name to array, start from
   :func:`initial_state`), which is how the state outlives one call, as Core ML's ``MLState`` does.
   ``read_state`` returns a copy of the value held; ``coreml_update_state`` stores its ``value`` there
   (after the ops before it, in program order) and returns it. The values are held in the working
   dtype: in float64 precision an fp16 state holds float64 values, as every fp16 ``cast`` is then the
   identity.

Precision:

* ``"float64"`` (default): every floating tensor (inputs, constants, results) is held in float64,
  so a fused op and its decomposed form agree to about 1e-12 and a test can use ``rtol=1e-5``
  meaningfully. ``cast`` between floating dtypes is then the identity (it does not round to fp16);
  casts to integer or bool types behave as in native mode.
* ``"native"``: every result is rounded to its output var's dtype (fp16 stays fp16, fp32 stays
  fp32). Within one op numpy may use a wider accumulator (e.g. ``np.mean`` of fp16).

Floating-point exceptions (overflow in ``exp``, ``0/0``, ...) are silenced; they propagate as
``inf``/``nan`` exactly as IEEE arithmetic produces them.

Where an op definition leaves a case open, the choice below is the one the coremltools frontends
rely on, and it is named in the op's semantics function; cases nobody specifies (update-mode
scatters with duplicate indices, integer ``real_div`` that is not exact, nearest-neighbour
resizes by other than whole multiples, even ``local_response_norm`` windows) raise
:class:`UnsupportedOpError` instead.
"""

from __future__ import annotations

import itertools
import logging
import math
from collections import ChainMap
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Final, Literal, TypeAlias, TypeVar

import numpy as np
from coremltools.converters.mil.mil import types
from coremltools.converters.mil.mil.types.symbolic import is_symbolic

from pattern_infra.language.errors import PatternInfraError
from pattern_infra.verification.errors import EvaluationError, UnsupportedOpError

__all__ = [
    "EvaluationError",
    "OpContext",
    "OpResult",
    "OpSemantics",
    "Precision",
    "evaluate",
    "initial_state",
    "register_op_semantics",
    "supported_op_types",
    "unregister_op_semantics",
]

logger = logging.getLogger(__name__)

Precision: TypeAlias = Literal["float64", "native"]
"""``"float64"`` computes every floating value in float64; ``"native"`` keeps the program's dtypes."""

OpResult: TypeAlias = np.ndarray | tuple[np.ndarray, ...]
"""What a semantics function returns: one array, or a tuple with one array per op output."""

OpSemantics: TypeAlias = Callable[["OpContext"], OpResult]
"""A semantics function: reads the op's inputs from the context, returns its output value(s)."""

_F = TypeVar("_F", bound=Callable[..., Any])

_PRECISIONS: Final = ("float64", "native")
_MAX_WHILE_ITERATIONS: Final = 1_000_000
_MISSING: Final = object()


_SEMANTICS: dict[str, OpSemantics] = {}


def register_op_semantics(op_type: str, *more_op_types: str, replace: bool = False) -> Callable[[_F], _F]:
    """Decorator registering a numpy semantics function for one or more MIL op types.

    Example::

        @register_op_semantics("my_dialect_op")
        def _my_op(ctx: OpContext) -> np.ndarray:
            return ctx.array("x") * ctx.attr("alpha", 1.0)

    Args:
        op_type: The op type, as ``op.op_type`` spells it (e.g. ``"gelu"``).
        *more_op_types: Further op types sharing the same function.
        replace: Allow replacing semantics that are already registered.

    Returns:
        The decorator; it returns the function unchanged.

    Raises:
        EvaluationError: An op type already has semantics and ``replace`` is false.
    """
    op_types = (op_type, *more_op_types)

    def decorator(fn: _F) -> _F:
        for name in op_types:
            if name in _SEMANTICS and not replace:
                raise EvaluationError(
                    f"Op type '{name}' already has reference semantics "
                    f"({getattr(_SEMANTICS[name], '__qualname__', _SEMANTICS[name])!r}); pass "
                    "replace=True to override them."
                )
        for name in op_types:
            _SEMANTICS[name] = fn
        return fn

    return decorator


def unregister_op_semantics(op_type: str) -> OpSemantics:
    """Remove the semantics of one op type (e.g. a plugin's, at teardown).

    Args:
        op_type: The op type to remove.

    Returns:
        The semantics function that was registered.

    Raises:
        EvaluationError: The op type has no semantics.
    """
    if op_type not in _SEMANTICS:
        raise EvaluationError(f"Op type '{op_type}' has no reference semantics to unregister.")
    return _SEMANTICS.pop(op_type)


def supported_op_types() -> tuple[str, ...]:
    """Return the op types the evaluator has semantics for, sorted by name."""
    return tuple(sorted(_SEMANTICS))


# --------------------------------------------------------------------------------------------------
# Running a program
# --------------------------------------------------------------------------------------------------


def evaluate(
    prog: Any,
    inputs: Mapping[str, Any],
    *,
    function: str = "main",
    precision: Precision = "float64",
    state: dict[str, np.ndarray] | None = None,
) -> dict[str, np.ndarray]:
    """Run one function of a MIL program in numpy.

    Args:
        prog: A coremltools ``Program`` (from ``mb.program`` or ``ct.convert(...)._mil_program``).
        inputs: One array per function input, keyed by input name, state inputs left out. Values are
            converted to the input's dtype (float64 for floating inputs in float64 precision).
        function: Name of the function to run.
        precision: ``"float64"`` or ``"native"``; see the module docstring.
        state: One array per state input of the function (from :func:`initial_state`, or from an
            earlier call); ``coreml_update_state`` replaces the arrays in this mapping, so passing the
            same mapping to the next call carries the state over.

    Returns:
        The function outputs keyed by output var name, in the function's output order (a var
        returned twice appears once).

    Raises:
        EvaluationError: Unknown function or precision, missing/unexpected inputs, shape mismatches,
            or an op that cannot be computed with the given values.
        UnsupportedOpError: The function contains an op the evaluator has no semantics for.
    """
    if precision not in _PRECISIONS:
        raise EvaluationError(f"Unknown precision {precision!r}; use one of {list(_PRECISIONS)}.")
    if function not in prog.functions:
        raise EvaluationError(f"The program has no function '{function}'; it has {sorted(prog.functions)}.")
    func = prog.functions[function]
    runner = _Runner(precision)
    env: ChainMap[Any, Any] = ChainMap()
    runner.bind_function_inputs(func, inputs, env, {} if state is None else state)
    logger.debug("evaluating function '%s' (%d ops) in %s", function, len(func.operations), precision)
    values = runner.run_ops(func, env)
    return {var.name: value for var, value in zip(func.outputs, values)}


def initial_state(prog: Any, *, function: str = "main") -> dict[str, np.ndarray]:
    """Zeros for every state input of a function: an empty KV cache.

    A PyTorch decoder's cache buffers start as zeros (``torch.zeros``); pass other arrays to
    :func:`evaluate` to start elsewhere.

    Args:
        prog: A coremltools ``Program``.
        function: Name of the function.

    Returns:
        State input name to a zero array of the wrapped tensor's shape and dtype (no state: empty).

    Raises:
        EvaluationError: Unknown function, or a state whose shape is not static.
    """
    if function not in prog.functions:
        raise EvaluationError(f"The program has no function '{function}'; it has {sorted(prog.functions)}.")
    zeros = {}
    for name, var in prog.functions[function].inputs.items():
        if not types.is_state(var.sym_type):
            continue
        wrapped = var.sym_type.wrapped_type()
        shape = wrapped.get_shape()
        if any(is_symbolic(d) for d in shape):
            raise EvaluationError(
                f"State '{name}' has a symbolic shape {shape}; states must have static shapes."
            )
        zeros[name] = np.zeros(
            [int(d) for d in shape], dtype=types.nptype_from_builtin(wrapped.get_primitive())
        )
    return zeros


class _StateCell:
    """What a state input is bound to while a function runs: its slot in the caller's mapping."""

    __slots__ = ("name", "values", "var")

    def __init__(self, name: str, values: dict[str, np.ndarray], var: Any) -> None:
        self.name = name
        self.values = values
        self.var = var


class OpContext:
    """What a semantics function sees: the op, its input values and its parameters.

    Tensor inputs are read with :meth:`array` (already converted to the working precision),
    compile-time parameters with :meth:`attr` (as plain Python values), tuple inputs such as
    ``concat.values`` with :meth:`arrays`.
    """

    __slots__ = ("op", "_env", "_runner")

    def __init__(self, op: Any, env: ChainMap[Any, Any], runner: _Runner) -> None:
        self.op = op
        """The coremltools ``Operation`` being evaluated."""
        self._env = env
        self._runner = runner

    @property
    def precision(self) -> Precision:
        """The precision the program runs in."""
        return self._runner.precision

    def has(self, name: str) -> bool:
        """Whether the op has input ``name`` (optional inputs may be absent)."""
        return name in self.op.inputs

    def array(self, name: str) -> np.ndarray:
        """The value of tensor input ``name``.

        Raises:
            EvaluationError: The op has no such input.
        """
        var = self.op.inputs.get(name)
        if var is None:
            raise EvaluationError(
                f"Op '{self.op.name}' ({self.op.op_type}) has no input '{name}'; "
                f"it has {sorted(self.op.inputs)}."
            )
        return np.asarray(self._runner.lookup(var, self._env))

    def arrays(self, name: str) -> tuple[np.ndarray, ...]:
        """The values of tuple input ``name`` (e.g. ``concat.values``)."""
        group = self.op.inputs.get(name)
        if group is None:
            raise EvaluationError(f"Op '{self.op.name}' ({self.op.op_type}) has no input '{name}'.")
        return tuple(np.asarray(self._runner.lookup(var, self._env)) for var in group)

    def attr(self, name: str, default: Any = _MISSING) -> Any:
        """The value of parameter ``name`` as a Python value (scalar, list, str or bool).

        Args:
            name: Input name.
            default: Returned when the op has no such input (optional input left unset).

        Raises:
            EvaluationError: The input is absent and no default is given.
        """
        var = self.op.inputs.get(name)
        if var is None:
            if default is _MISSING:
                raise EvaluationError(
                    f"Op '{self.op.name}' ({self.op.op_type}) has no input '{name}' and the "
                    "evaluator has no default for it."
                )
            return default
        value = self._runner.lookup(var, self._env)
        if isinstance(value, np.ndarray):
            return value.tolist() if value.ndim else value.item()
        if isinstance(value, np.generic):
            return value.item()
        return value

    def out_dtype(self, index: int = 0) -> np.dtype:
        """The numpy dtype output ``index`` is held in (float64 for floats in float64 precision)."""
        return self._runner.working_dtype(self.op.outputs[index].dtype)

    def run_block(self, block: Any, block_inputs: Sequence[np.ndarray]) -> list[Any]:
        """Evaluate a nested block with its inputs bound to ``block_inputs``; return its outputs."""
        return self._runner.run_block(block, block_inputs, self._env)

    def unsupported(self, reason: str) -> UnsupportedOpError:
        """Build the error for a configuration of this op whose meaning is not defined."""
        return UnsupportedOpError(
            f"Op '{self.op.name}' of type '{self.op.op_type}': {reason}. The reference evaluator "
            "never guesses; register your own semantics with "
            f"@register_op_semantics('{self.op.op_type}', replace=True) if you know them."
        )


class _Runner:
    """Evaluates the ops and blocks of one call in one precision."""

    def __init__(self, precision: Precision) -> None:
        self.precision: Precision = precision

    # -- dtypes and values ----------------------------------------------------------------------

    def working_dtype(self, builtin: Any) -> np.dtype:
        np_type = np.dtype(types.nptype_from_builtin(builtin))
        if self.precision == "float64" and np.issubdtype(np_type, np.floating):
            return np.dtype(np.float64)
        return np_type

    def convert(self, value: Any, var: Any) -> Any:
        """Cast ``value`` to ``var``'s working dtype (tensors and scalars; others pass through)."""
        if not _is_tensor_like(var):
            return value
        array = np.asarray(value)
        target = self.working_dtype(var.dtype)
        return array if array.dtype == target else array.astype(target)

    def lookup(self, var: Any, env: Mapping[Any, Any]) -> Any:
        if var in env:
            return env[var]
        if var.val is not None:
            return self.convert(var.val, var)
        raise EvaluationError(
            f"Var '{var.name}' has no value: it is neither computed before its use nor a "
            "compile-time constant (is the program topologically sorted?)."
        )

    # -- inputs -----------------------------------------------------------------------------------

    def bind_function_inputs(
        self, func: Any, inputs: Mapping[str, Any], env: ChainMap[Any, Any], state: dict[str, np.ndarray]
    ) -> None:
        states = {name: var for name, var in func.inputs.items() if types.is_state(var.sym_type)}
        declared = {name: var for name, var in func.inputs.items() if name not in states}
        missing = [name for name in declared if name not in inputs]
        unexpected = [name for name in inputs if name not in declared]
        if missing or unexpected:
            raise EvaluationError(
                f"Inputs do not match the function signature {list(declared)}: "
                f"missing {missing}, unexpected {unexpected}"
                + (f" (states {list(states)} go in state=, not in the inputs)." if states else ".")
            )
        if missing_states := [name for name in states if name not in state]:
            raise EvaluationError(
                f"The function has state inputs {list(states)} and no value for {missing_states}: pass "
                "state=initial_state(prog) for a new state, or the mapping an earlier call updated."
            )
        for name, var in states.items():
            wrapped = var.sym_type.wrapped_type().get_shape()
            _check_declared_shape(np.shape(state[name]), wrapped, f"state '{name}'")
            env[var] = _StateCell(name, state, var)
        sizes: dict[str, int] = {}
        for name, var in declared.items():
            value = np.asarray(inputs[name])
            target = self.working_dtype(var.dtype)
            if np.issubdtype(value.dtype, np.floating) and not np.issubdtype(target, np.floating):
                raise EvaluationError(
                    f"Input '{name}' is declared {types.builtin_to_string(var.dtype)} but got "
                    f"floating values ({value.dtype}); pass integers or booleans."
                )
            _check_declared_shape(value.shape, var.shape, f"input '{name}'", sizes)
            env[var] = value.astype(target) if value.dtype != target else value

    # -- ops and blocks ---------------------------------------------------------------------------

    def run_ops(self, block: Any, env: ChainMap[Any, Any]) -> list[Any]:
        for op in block.operations:
            self.run_op(op, env)
        return [self.lookup(var, env) for var in block.outputs]

    def run_block(self, block: Any, block_inputs: Sequence[Any], outer: ChainMap[Any, Any]) -> list[Any]:
        if len(block.inputs) != len(block_inputs):
            raise EvaluationError(
                f"Block '{block.name}' takes {len(block.inputs)} inputs, got {len(block_inputs)}."
            )
        scope = outer.new_child()
        for var, value in zip(block.inputs, block_inputs):
            scope[var] = self.convert(value, var)
        return self.run_ops(block, scope)

    def run_op(self, op: Any, env: ChainMap[Any, Any]) -> None:
        semantics = _SEMANTICS.get(op.op_type)
        if semantics is None:
            if op.outputs and all(var.val is not None for var in op.outputs):
                results: tuple[Any, ...] = tuple(var.val for var in op.outputs)
            else:
                raise UnsupportedOpError(
                    f"Op '{op.name}' of type '{op.op_type}' has no reference semantics and no "
                    "compile-time value. The reference evaluator never guesses: register them with "
                    f"@register_op_semantics('{op.op_type}') from pattern_infra.verification.evaluator."
                )
        else:
            try:
                with np.errstate(all="ignore"):
                    result = semantics(OpContext(op, env, self))
            except PatternInfraError:
                raise
            except Exception as exc:  # numpy/index errors: name the op that failed
                raise EvaluationError(
                    f"Op '{op.name}' ({op.op_type}) failed in the reference evaluator: "
                    f"{type(exc).__name__}: {exc}"
                ) from exc
            results = result if isinstance(result, tuple) else (result,)
        if len(results) != len(op.outputs):
            raise EvaluationError(
                f"Semantics of '{op.op_type}' returned {len(results)} values but op '{op.name}' "
                f"has {len(op.outputs)} outputs."
            )
        for var, value in zip(op.outputs, results):
            converted = self.convert(value, var)
            if _is_tensor_like(var):
                _check_declared_shape(
                    converted.shape, var.shape, f"output '{var.name}' of op '{op.name}' ({op.op_type})"
                )
            env[var] = converted


def _is_tensor_like(var: Any) -> bool:
    sym_type = var.sym_type
    if types.is_tensor(sym_type):
        return True
    return types.is_scalar(sym_type) and not types.is_str(sym_type)


def _check_declared_shape(
    actual: tuple[int, ...], declared: Sequence[Any], what: str, sizes: dict[str, int] | None = None
) -> None:
    """Check a concrete shape against a declared one; bind symbols in ``sizes`` when given.

    For an op output a mismatch means the op's semantics here and coremltools' type inference
    disagree; the message says so, since either may be the wrong one.
    """
    mismatch = len(actual) != len(declared) or any(
        not is_symbolic(want) and int(want) != got for got, want in zip(actual, declared)
    )
    if mismatch:
        hint = (
            ""
            if sizes is not None
            else " (the evaluator's semantics and coremltools' type inference disagree)"
        )
        raise EvaluationError(
            f"{what} has shape {tuple(actual)} but the program declares {tuple(declared)}{hint}."
        )
    if sizes is None:
        return
    for got, want in zip(actual, declared):
        if is_symbolic(want):
            bound = sizes.setdefault(str(want), int(got))
            if bound != got:
                raise EvaluationError(
                    f"{what} has shape {tuple(actual)}: symbol '{want}' is already bound to {bound}."
                )


# --------------------------------------------------------------------------------------------------
# Small shared helpers
# --------------------------------------------------------------------------------------------------


def _axis(axis: int, rank: int) -> int:
    return axis + rank if axis < 0 else axis


def _axes(axes: Sequence[int] | None, rank: int) -> tuple[int, ...]:
    return tuple(range(rank)) if axes is None else tuple(_axis(a, rank) for a in axes)


def _channel_shape(vector: np.ndarray, rank: int) -> np.ndarray:
    """Reshape a per-channel vector so it broadcasts along axis 1 of a rank-``rank`` tensor."""
    return np.reshape(vector, (1, -1) + (1,) * (rank - 2))


def _erf(x: np.ndarray) -> np.ndarray:
    erf = np.frompyfunc(math.erf, 1, 1)
    return np.asarray(erf(np.asarray(x, dtype=np.float64)), dtype=np.float64)


def _sigmoid(x: np.ndarray) -> np.ndarray:
    return 1.0 / (1.0 + np.exp(-x))


def _softmax(x: np.ndarray, axis: int) -> np.ndarray:
    shifted = np.exp(x - np.max(x, axis=axis, keepdims=True))
    return shifted / np.sum(shifted, axis=axis, keepdims=True)


def _normalize_indices(indices: np.ndarray, size: int) -> np.ndarray:
    """Map indices in ``[-size, size)`` to ``[0, size)``; reject anything else."""
    indices = np.asarray(indices, dtype=np.int64)
    if indices.size and (indices.min() < -size or indices.max() >= size):
        raise IndexError(f"indices must lie in [{-size}, {size}), got [{indices.min()}, {indices.max()}]")
    return np.where(indices < 0, indices + size, indices)


# --------------------------------------------------------------------------------------------------
# const, identity, cast, select
# --------------------------------------------------------------------------------------------------


@register_op_semantics("const")
def _const(ctx: OpContext) -> Any:
    var = ctx.op.outputs[0]
    if var.val is None:
        raise ctx.unsupported("a const without a concrete value (symbolic const)")
    return var.val


@register_op_semantics("identity")
def _identity(ctx: OpContext) -> np.ndarray:
    return ctx.array("x")


@register_op_semantics("cast")
def _cast(ctx: OpContext) -> np.ndarray:
    # The target is the output var's dtype; in float64 precision float->float casts do not round.
    x = ctx.array("x")
    target = ctx.out_dtype()
    if target == np.bool_:
        return x != 0
    return x.astype(target)


@register_op_semantics("select")
def _select(ctx: OpContext) -> np.ndarray:
    return np.where(ctx.array("cond"), ctx.array("a"), ctx.array("b"))


# --------------------------------------------------------------------------------------------------
# Elementwise unary
# --------------------------------------------------------------------------------------------------

_UNARY: Final[dict[str, Callable[[np.ndarray], np.ndarray]]] = {
    "abs": np.abs,
    "acos": np.arccos,
    "asin": np.arcsin,
    "atan": np.arctan,
    "atanh": np.arctanh,
    "ceil": np.ceil,
    "cos": np.cos,
    "cosh": np.cosh,
    "erf": _erf,
    "exp": np.exp,
    "exp2": np.exp2,
    "floor": np.floor,
    "logical_not": np.logical_not,
    # Half-way cases round to even: the definition's example rounds 0.5 to 0, as np.round does.
    "round": np.round,
    "sign": np.sign,
    "sin": np.sin,
    "sinh": np.sinh,
    "sqrt": np.sqrt,
    "square": np.square,
    "tan": np.tan,
    "tanh": np.tanh,
    "relu": lambda x: np.maximum(x, 0),
    "relu6": lambda x: np.minimum(np.maximum(x, 0), 6),
    "sigmoid": _sigmoid,
    "silu": lambda x: x * _sigmoid(x),
    "softplus": lambda x: np.logaddexp(0, x),
    "softsign": lambda x: x / (1 + np.abs(x)),
}


def _unary(fn: Callable[[np.ndarray], np.ndarray]) -> OpSemantics:
    def semantics(ctx: OpContext) -> np.ndarray:
        return fn(ctx.array("x"))

    return semantics


for _op_type, _fn in _UNARY.items():
    register_op_semantics(_op_type)(_unary(_fn))


def _epsilon(ctx: OpContext, default: float) -> np.ndarray:
    """The op's ``epsilon``; when unset, the definition's default rounded to the dtype of ``x``."""
    if ctx.has("epsilon"):
        return ctx.array("epsilon")
    declared = np.dtype(types.nptype_from_builtin(ctx.op.inputs["x"].dtype))
    return np.asarray(default, dtype=declared).astype(ctx.out_dtype())


@register_op_semantics("inverse")
def _inverse(ctx: OpContext) -> np.ndarray:
    return 1.0 / (ctx.array("x") + _epsilon(ctx, 1e-4))


@register_op_semantics("log")
def _log(ctx: OpContext) -> np.ndarray:
    return np.log(ctx.array("x") + _epsilon(ctx, 1e-45))


@register_op_semantics("rsqrt")
def _rsqrt(ctx: OpContext) -> np.ndarray:
    return 1.0 / np.sqrt(ctx.array("x") + _epsilon(ctx, 1e-12))


@register_op_semantics("clip")
def _clip(ctx: OpContext) -> np.ndarray:
    return np.minimum(np.maximum(ctx.array("x"), ctx.array("alpha")), ctx.array("beta"))


@register_op_semantics("threshold")
def _threshold(ctx: OpContext) -> np.ndarray:
    return np.maximum(ctx.array("x"), ctx.array("alpha"))


# --------------------------------------------------------------------------------------------------
# Elementwise binary (numpy broadcasting is MIL broadcasting)
# --------------------------------------------------------------------------------------------------

_BINARY: Final[dict[str, Callable[[np.ndarray, np.ndarray], np.ndarray]]] = {
    "add": np.add,
    "sub": np.subtract,
    "mul": np.multiply,
    "floor_div": np.floor_divide,
    # Python's sign convention (result has the sign of y), as the definition's operator.mod.
    "mod": np.mod,
    "pow": np.power,
    "maximum": np.maximum,
    "minimum": np.minimum,
    "equal": np.equal,
    "not_equal": np.not_equal,
    "less": np.less,
    "less_equal": np.less_equal,
    "greater": np.greater,
    "greater_equal": np.greater_equal,
    "logical_and": np.logical_and,
    "logical_or": np.logical_or,
    "logical_xor": np.logical_xor,
}


def _binary(fn: Callable[[np.ndarray, np.ndarray], np.ndarray]) -> OpSemantics:
    def semantics(ctx: OpContext) -> np.ndarray:
        return fn(ctx.array("x"), ctx.array("y"))

    return semantics


for _op_type, _fn2 in _BINARY.items():
    register_op_semantics(_op_type)(_binary(_fn2))


@register_op_semantics("real_div")
def _real_div(ctx: OpContext) -> np.ndarray:
    x, y = ctx.array("x"), ctx.array("y")
    quotient = np.true_divide(x, y)
    if np.issubdtype(ctx.out_dtype(), np.integer) and not np.array_equal(quotient, np.trunc(quotient)):
        raise ctx.unsupported(
            "integer real_div with an inexact quotient (the definition does not say how it rounds)"
        )
    return quotient


# --------------------------------------------------------------------------------------------------
# Activations
# --------------------------------------------------------------------------------------------------


@register_op_semantics("leaky_relu")
def _leaky_relu(ctx: OpContext) -> np.ndarray:
    x = ctx.array("x")
    return np.where(x >= 0, x, ctx.array("alpha") * x)


@register_op_semantics("prelu")
def _prelu(ctx: OpContext) -> np.ndarray:
    x = ctx.array("x")
    alpha = _channel_shape(ctx.array("alpha"), x.ndim)
    return np.where(x > 0, x, alpha * x)


@register_op_semantics("elu")
def _elu(ctx: OpContext) -> np.ndarray:
    x = ctx.array("x")
    return np.where(x > 0, x, ctx.array("alpha") * np.expm1(x))


@register_op_semantics("thresholded_relu")
def _thresholded_relu(ctx: OpContext) -> np.ndarray:
    x = ctx.array("x")
    return np.where(x >= ctx.array("alpha"), x, 0)


@register_op_semantics("clamped_relu")
def _clamped_relu(ctx: OpContext) -> np.ndarray:
    # The docstring: min(beta, x) for x >= 0, min(beta, alpha * x) otherwise. (coremltools' value
    # inference computes min(max(x,0),beta) + min(min(x,0)*alpha, beta), which differs for beta < 0.)
    x, alpha, beta = ctx.array("x"), ctx.array("alpha"), ctx.array("beta")
    return np.where(x >= 0, np.minimum(beta, x), np.minimum(beta, alpha * x))


@register_op_semantics("linear_activation")
def _linear_activation(ctx: OpContext) -> np.ndarray:
    return ctx.array("alpha") * ctx.array("x") + ctx.array("beta")


@register_op_semantics("scaled_tanh")
def _scaled_tanh(ctx: OpContext) -> np.ndarray:
    return ctx.array("alpha") * np.tanh(ctx.array("beta") * ctx.array("x"))


@register_op_semantics("sigmoid_hard")
def _sigmoid_hard(ctx: OpContext) -> np.ndarray:
    linear = ctx.array("alpha") * ctx.array("x") + ctx.array("beta")
    return np.minimum(np.maximum(linear, 0), 1)


@register_op_semantics("softplus_parametric")
def _softplus_parametric(ctx: OpContext) -> np.ndarray:
    x = ctx.array("x")
    alpha = _channel_shape(ctx.array("alpha"), x.ndim)
    beta = _channel_shape(ctx.array("beta"), x.ndim)
    return alpha * np.logaddexp(0, beta * x)


_SQRT_2_OVER_PI: Final = math.sqrt(2.0 / math.pi)


@register_op_semantics("gelu")
def _gelu(ctx: OpContext) -> np.ndarray:
    x = ctx.array("x")
    mode = ctx.attr("mode", "EXACT")
    if mode == "EXACT":
        return 0.5 * x * (1.0 + _erf(x / math.sqrt(2.0)))
    if mode == "TANH_APPROXIMATION":
        return 0.5 * x * (1.0 + np.tanh(_SQRT_2_OVER_PI * (x + 0.044715 * x**3)))
    if mode == "SIGMOID_APPROXIMATION":
        return x * _sigmoid(1.702 * x)
    raise ctx.unsupported(f"gelu mode {mode!r}")


@register_op_semantics("softmax")
def _softmax_op(ctx: OpContext) -> np.ndarray:
    return _softmax(ctx.array("x"), ctx.attr("axis", -1))


# --------------------------------------------------------------------------------------------------
# Reductions
# --------------------------------------------------------------------------------------------------


def _log_sum_exp(x: np.ndarray, axis: tuple[int, ...], keepdims: bool) -> np.ndarray:
    peak = np.max(x, axis=axis, keepdims=True)
    peak = np.where(np.isfinite(peak), peak, 0)
    total = np.log(np.sum(np.exp(x - peak), axis=axis, keepdims=True)) + peak
    return total if keepdims else np.squeeze(total, axis=axis)


_REDUCTIONS: Final[dict[str, Callable[[np.ndarray, tuple[int, ...], bool], np.ndarray]]] = {
    "reduce_sum": lambda x, a, k: np.sum(x, axis=a, keepdims=k),
    "reduce_mean": lambda x, a, k: np.mean(x, axis=a, keepdims=k),
    "reduce_prod": lambda x, a, k: np.prod(x, axis=a, keepdims=k),
    "reduce_max": lambda x, a, k: np.max(x, axis=a, keepdims=k),
    "reduce_min": lambda x, a, k: np.min(x, axis=a, keepdims=k),
    "reduce_l1_norm": lambda x, a, k: np.sum(np.abs(x), axis=a, keepdims=k),
    "reduce_l2_norm": lambda x, a, k: np.sqrt(np.sum(np.square(x), axis=a, keepdims=k)),
    "reduce_sum_square": lambda x, a, k: np.sum(np.square(x), axis=a, keepdims=k),
    "reduce_log_sum": lambda x, a, k: np.log(np.sum(x, axis=a, keepdims=k)),
    "reduce_log_sum_exp": _log_sum_exp,
}


def _reduction(fn: Callable[[np.ndarray, tuple[int, ...], bool], np.ndarray]) -> OpSemantics:
    def semantics(ctx: OpContext) -> np.ndarray:
        x = ctx.array("x")
        return fn(x, _axes(ctx.attr("axes", None), x.ndim), bool(ctx.attr("keep_dims", False)))

    return semantics


for _op_type, _fn3 in _REDUCTIONS.items():
    register_op_semantics(_op_type)(_reduction(_fn3))


@register_op_semantics("reduce_argmax", "reduce_argmin")
def _reduce_arg(ctx: OpContext) -> np.ndarray:
    # Ties resolve to the first index (the definition says the choice is not guaranteed).
    x = ctx.array("x")
    axis = _axis(ctx.attr("axis", -1), x.ndim)
    pick = np.argmax if ctx.op.op_type == "reduce_argmax" else np.argmin
    return pick(x, axis=axis, keepdims=bool(ctx.attr("keep_dims", False)))


# --------------------------------------------------------------------------------------------------
# Linear algebra
# --------------------------------------------------------------------------------------------------


@register_op_semantics("matmul")
def _matmul(ctx: OpContext) -> np.ndarray:
    x, y = ctx.array("x"), ctx.array("y")
    if ctx.attr("transpose_x", False) and x.ndim >= 2:
        x = np.swapaxes(x, -1, -2)
    if ctx.attr("transpose_y", False) and y.ndim >= 2:
        y = np.swapaxes(y, -1, -2)
    return np.matmul(x, y)


@register_op_semantics("linear")
def _linear(ctx: OpContext) -> np.ndarray:
    result = np.matmul(ctx.array("x"), ctx.array("weight").T)
    return result + ctx.array("bias") if ctx.has("bias") else result


@register_op_semantics("einsum")
def _einsum(ctx: OpContext) -> np.ndarray:
    equation = str(ctx.attr("equation")).replace(" ", "")
    operands = ctx.arrays("values")
    lhs, _, _ = equation.partition("->")
    subscripts = lhs.split(",")
    if "." in equation or len(subscripts) != len(operands):
        raise ctx.unsupported(f"einsum equation {equation!r} with {len(operands)} operands")
    # MIL broadcasts size-1 dimensions of a shared label; np.einsum does not, so expand them first.
    sizes: dict[str, int] = {}
    for labels, operand in zip(subscripts, operands):
        for label, size in zip(labels, operand.shape):
            sizes[label] = max(sizes.get(label, 1), size)
    expanded = [np.broadcast_to(op, [sizes[c] for c in labels]) for labels, op in zip(subscripts, operands)]
    return np.einsum(equation, *expanded)


@register_op_semantics("scaled_dot_product_attention")
def _sdpa(ctx: OpContext) -> np.ndarray:
    query, key, value = ctx.array("query"), ctx.array("key"), ctx.array("value")
    scores = np.matmul(query, np.swapaxes(key, -1, -2)) / math.sqrt(query.shape[-1])
    if ctx.has("attn_mask"):
        mask = ctx.array("attn_mask")
        scores = np.where(mask, scores, -np.inf) if mask.dtype == np.bool_ else scores + mask
    return np.matmul(_softmax(scores, -1), value)


# --------------------------------------------------------------------------------------------------
# Convolution and pooling
# --------------------------------------------------------------------------------------------------


def _same_padding(size: int, kernel: int, stride: int) -> int:
    """Total padding of ``same``: the output has ``ceil(size / stride)`` elements."""
    return max(0, (math.ceil(size / stride) - 1) * stride + kernel - size)


def _spatial_padding(
    ctx: OpContext, sizes: Sequence[int], kernels: Sequence[int], strides: Sequence[int]
) -> list[tuple[int, int]]:
    """Per spatial dimension ``(before, after)`` padding of conv/pool ``pad_type``.

    ``same`` puts the odd element after (bottom/right), ``same_lower`` before, as the definitions
    say. (conv's docstring formula for even kernels says the opposite; the frontends map PyTorch's
    and TensorFlow's ``same`` to it, and both pad the extra element at the end.)
    """
    pad_type = str(ctx.attr("pad_type", "valid")).lower()
    rank = len(sizes)
    if pad_type == "valid":
        return [(0, 0)] * rank
    if pad_type == "custom":
        pad = ctx.attr("pad", [0] * 2 * rank)
        return [(int(pad[2 * i]), int(pad[2 * i + 1])) for i in range(rank)]
    if pad_type in ("same", "same_lower"):
        result = []
        for size, kernel, stride in zip(sizes, kernels, strides):
            total = _same_padding(size, kernel, stride)
            small = total // 2
            result.append((small, total - small) if pad_type == "same" else (total - small, small))
        return result
    raise ctx.unsupported(f"pad_type {pad_type!r}")


@register_op_semantics("conv")
def _conv(ctx: OpContext) -> np.ndarray:
    x, weight = ctx.array("x"), ctx.array("weight")
    spatial = x.ndim - 2
    strides = ctx.attr("strides", [1] * spatial)
    dilations = ctx.attr("dilations", [1] * spatial)
    groups = int(ctx.attr("groups", 1))
    kernels = weight.shape[2:]
    effective = [(k - 1) * d + 1 for k, d in zip(kernels, dilations)]
    padding = _spatial_padding(ctx, x.shape[2:], effective, strides)
    padded = np.pad(x, [(0, 0), (0, 0), *padding])
    out_sizes = [(p - e) // s + 1 for p, e, s in zip(padded.shape[2:], effective, strides)]
    batch, c_in = x.shape[:2]
    c_out = weight.shape[0]
    grouped_x = padded.reshape(batch, groups, c_in // groups, *padded.shape[2:])
    grouped_w = weight.reshape(groups, c_out // groups, c_in // groups, *kernels)
    out = np.zeros((batch, groups, c_out // groups, *out_sizes), dtype=np.result_type(x, weight))
    for offset in itertools.product(*(range(k) for k in kernels)):
        window = tuple(
            slice(k * d, k * d + s * (o - 1) + 1, s)
            for k, d, s, o in zip(offset, dilations, strides, out_sizes)
        )
        patch = grouped_x[(slice(None),) * 3 + window]
        tap = grouped_w[(slice(None),) * 3 + offset]
        out += np.einsum("ngc...,goc->ngo...", patch, tap)
    out = out.reshape(batch, c_out, *out_sizes)
    return out + _channel_shape(ctx.array("bias"), out.ndim) if ctx.has("bias") else out


@register_op_semantics("conv_transpose")
def _conv_transpose(ctx: OpContext) -> np.ndarray:
    """Transposed convolution; weight layout ``[C_in, C_out / groups, *K]``.

    The full (uncropped) output has ``(D - 1) * stride + (K - 1) * dilation + 1`` elements per
    spatial dimension. Output element ``j`` is full element ``j + before`` (zero outside), with
    ``before = pad[2i]`` for ``custom``, ``0`` for ``valid`` and ``max(full - out, 0) // 2`` for
    ``same`` (``out = D * stride`` unless ``output_shape`` says otherwise): the TensorFlow
    convention, which the TensorFlow frontend relies on when it emits ``same`` + ``output_shape``.
    """
    x, weight = ctx.array("x"), ctx.array("weight")
    spatial = x.ndim - 2
    strides = ctx.attr("strides", [1] * spatial)
    dilations = ctx.attr("dilations", [1] * spatial)
    groups = int(ctx.attr("groups", 1))
    pad_type = str(ctx.attr("pad_type", "valid")).lower()
    batch, c_in = x.shape[:2]
    kernels = weight.shape[2:]
    c_out = weight.shape[1] * groups
    sizes = x.shape[2:]
    full = [(d_in - 1) * s + (k - 1) * d + 1 for d_in, s, k, d in zip(sizes, strides, kernels, dilations)]
    grouped_x = x.reshape(batch, groups, c_in // groups, *sizes)
    grouped_w = weight.reshape(groups, c_in // groups, c_out // groups, *kernels)
    out = np.zeros((batch, groups, c_out // groups, *full), dtype=np.result_type(x, weight))
    for offset in itertools.product(*(range(k) for k in kernels)):
        window = tuple(
            slice(k * d, k * d + s * (n - 1) + 1, s) for k, d, s, n in zip(offset, dilations, strides, sizes)
        )
        tap = grouped_w[(slice(None),) * 3 + offset]
        out[(slice(None),) * 3 + window] += np.einsum("ngc...,gco->ngo...", grouped_x, tap)
    out = out.reshape(batch, c_out, *full)

    pad = ctx.attr("pad", [0] * 2 * spatial)
    output_shape = ctx.attr("output_shape", None)
    targets: list[int] = []
    befores: list[int] = []
    for i in range(spatial):
        if pad_type == "custom":
            before, size = int(pad[2 * i]), full[i] - int(pad[2 * i]) - int(pad[2 * i + 1])
        elif pad_type == "valid":
            before, size = 0, full[i]
        elif pad_type == "same":
            size = sizes[i] * strides[i]
            before = -1  # depends on the final size, below
        else:
            raise ctx.unsupported(f"pad_type {pad_type!r}")
        if output_shape is not None:
            size = int(output_shape[2 + i])
        if pad_type == "same":
            before = max(full[i] - size, 0) // 2
        targets.append(size)
        befores.append(before)
    result = np.zeros((batch, c_out, *targets), dtype=out.dtype)
    src, dst = [slice(None)] * 2, [slice(None)] * 2
    for before, size, length in zip(befores, targets, full):
        start, stop = before, min(before + size, length)
        src.append(slice(start, stop))
        dst.append(slice(0, max(stop - start, 0)))
    result[tuple(dst)] = out[tuple(src)]
    return result + _channel_shape(ctx.array("bias"), result.ndim) if ctx.has("bias") else result


def _pool_output_size(size: int, kernel: int, stride: int, before: int, after: int, ceil_mode: bool) -> int:
    total = before + after
    if not ceil_mode:
        return (size + total - kernel) // stride + 1
    out = (size + total - kernel + stride - 1) // stride + 1
    # The last window must start inside the input or the leading padding (PyTorch's rule, which
    # the definition restricts to padded pools).
    if total > 0 and (out - 1) * stride >= size + total / 2:
        out -= 1
    return out


def _pool(ctx: OpContext, kind: str) -> np.ndarray:
    x = ctx.array("x")
    spatial = x.ndim - 2
    kernels = ctx.attr("kernel_sizes")
    strides = ctx.attr("strides", [1] * spatial)
    ceil_mode = bool(ctx.attr("ceil_mode", False))
    padding = _spatial_padding(ctx, x.shape[2:], kernels, strides)
    sizes = x.shape[2:]
    outs = [
        _pool_output_size(n, k, s, b, a, ceil_mode)
        for n, k, s, (b, a) in zip(sizes, kernels, strides, padding)
    ]
    exclude_padding = bool(ctx.attr("exclude_padding_from_average", False))
    lead = x.shape[:2]
    total = np.zeros((*lead, *outs), dtype=x.dtype)
    best = np.full((*lead, *outs), -np.inf, dtype=x.dtype)
    count = np.zeros(outs, dtype=np.int64)
    for offset in itertools.product(*(range(k) for k in kernels)):
        gathered = x
        inside = np.ones(outs, dtype=bool)  # position lies in the input
        padded = np.ones(outs, dtype=bool)  # position lies in the input or its padding
        for dim, (k, s, (before, after), n, o) in enumerate(zip(offset, strides, padding, sizes, outs)):
            positions = np.arange(o) * s - before + k
            shape = [1] * spatial
            shape[dim] = o
            inside = inside & ((positions >= 0) & (positions < n)).reshape(shape)
            padded = padded & ((positions >= -before) & (positions < n + after)).reshape(shape)
            gathered = np.take(gathered, np.clip(positions, 0, n - 1), axis=2 + dim)
        if kind == "max":
            best = np.where(inside, np.maximum(best, gathered), best)
            continue
        contribution = np.square(gathered) if kind == "l2" else gathered
        total = total + np.where(inside, contribution, 0)
        count = count + (inside if exclude_padding else padded)
    if kind == "max":
        return best
    if kind == "l2":
        return np.sqrt(total)
    return total / count


@register_op_semantics("max_pool")
def _max_pool(ctx: OpContext) -> np.ndarray:
    return _pool(ctx, "max")


@register_op_semantics("avg_pool")
def _avg_pool(ctx: OpContext) -> np.ndarray:
    return _pool(ctx, "avg")


@register_op_semantics("l2_pool")
def _l2_pool(ctx: OpContext) -> np.ndarray:
    return _pool(ctx, "l2")


# --------------------------------------------------------------------------------------------------
# Normalization
# --------------------------------------------------------------------------------------------------


@register_op_semantics("batch_norm")
def _batch_norm(ctx: OpContext) -> np.ndarray:
    x = ctx.array("x")
    mean = _channel_shape(ctx.array("mean"), x.ndim)
    variance = _channel_shape(ctx.array("variance"), x.ndim)
    epsilon = ctx.array("epsilon") if ctx.has("epsilon") else 1e-5
    out = (x - mean) / np.sqrt(variance + epsilon)
    if ctx.has("gamma"):
        out = out * _channel_shape(ctx.array("gamma"), x.ndim)
    if ctx.has("beta"):
        out = out + _channel_shape(ctx.array("beta"), x.ndim)
    return out


def _normalize(x: np.ndarray, axes: tuple[int, ...], epsilon: Any) -> np.ndarray:
    mean = np.mean(x, axis=axes, keepdims=True)
    variance = np.mean(np.square(x - mean), axis=axes, keepdims=True)
    return (x - mean) / np.sqrt(variance + epsilon)


@register_op_semantics("instance_norm")
def _instance_norm(ctx: OpContext) -> np.ndarray:
    x = ctx.array("x")
    epsilon = ctx.array("epsilon") if ctx.has("epsilon") else 1e-5
    out = _normalize(x, tuple(range(2, x.ndim)), epsilon)
    if ctx.has("gamma"):
        out = out * _channel_shape(ctx.array("gamma"), x.ndim)
    if ctx.has("beta"):
        out = out + _channel_shape(ctx.array("beta"), x.ndim)
    return out


@register_op_semantics("layer_norm")
def _layer_norm(ctx: OpContext) -> np.ndarray:
    # gamma/beta have shape x.shape[axes] with the axes in increasing order.
    x = ctx.array("x")
    axes = tuple(sorted(set(_axes(ctx.attr("axes", None), x.ndim))))
    epsilon = ctx.array("epsilon") if ctx.has("epsilon") else 1e-5
    out = _normalize(x, axes, epsilon)
    broadcast = [x.shape[i] if i in axes else 1 for i in range(x.ndim)]
    if ctx.has("gamma"):
        out = out * np.reshape(ctx.array("gamma"), broadcast)
    if ctx.has("beta"):
        out = out + np.reshape(ctx.array("beta"), broadcast)
    return out


@register_op_semantics("l2_norm")
def _l2_norm(ctx: OpContext) -> np.ndarray:
    # x / sqrt(sum(x^2) + eps) over the last three dimensions; leading dimensions are batch. The sum of
    # squares is internal to the op, not a tensor of the program: it is accumulated in float64 (in
    # "native" precision too) and only the op's result is rounded to its dtype. A float16 x of magnitude
    # 300 therefore normalises correctly, where a written-out pow(x, 2) overflows.
    x = ctx.array("x")
    epsilon = ctx.array("epsilon") if ctx.has("epsilon") else 1e-6
    axes = tuple(range(max(x.ndim - 3, 0), x.ndim))
    wide = x.astype(np.float64)
    return wide / np.sqrt(np.sum(np.square(wide), axis=axes, keepdims=True) + np.float64(epsilon))


@register_op_semantics("local_response_norm")
def _local_response_norm(ctx: OpContext) -> np.ndarray:
    x = ctx.array("x")
    size = int(ctx.attr("size"))
    if size % 2 == 0:
        raise ctx.unsupported(
            f"an even window size ({size}): the definition does not say where it is centred"
        )
    alpha = ctx.array("alpha") if ctx.has("alpha") else 1e-4
    beta = ctx.array("beta") if ctx.has("beta") else 0.75
    k = ctx.array("k") if ctx.has("k") else 1.0
    half = size // 2
    squares = np.pad(np.square(x), [(0, 0), (half, half)] + [(0, 0)] * (x.ndim - 2))
    channels = x.shape[1]
    window_sum = sum(squares[:, i : i + channels] for i in range(size))
    return x / np.power(k + alpha / size * window_sum, beta)


# --------------------------------------------------------------------------------------------------
# Shape manipulation
# --------------------------------------------------------------------------------------------------


@register_op_semantics("reshape")
def _reshape(ctx: OpContext) -> np.ndarray:
    x = ctx.array("x")
    shape = [int(s) for s in np.asarray(ctx.attr("shape")).reshape(-1)]
    if 0 in shape:
        if len(shape) != x.ndim:
            raise ctx.unsupported("a 0 in the target shape when its length differs from rank(x)")
        shape = [x.shape[i] if s == 0 else s for i, s in enumerate(shape)]
    return np.reshape(x, shape)


@register_op_semantics("transpose")
def _transpose(ctx: OpContext) -> np.ndarray:
    return np.transpose(ctx.array("x"), ctx.attr("perm"))


@register_op_semantics("squeeze")
def _squeeze(ctx: OpContext) -> np.ndarray:
    # Like PyTorch: listed axes whose size is not 1 are kept, not an error.
    x = ctx.array("x")
    axes = _axes(ctx.attr("axes", None), x.ndim)
    return np.squeeze(x, axis=tuple(a for a in axes if x.shape[a] == 1))


@register_op_semantics("expand_dims")
def _expand_dims(ctx: OpContext) -> np.ndarray:
    x = ctx.array("x")
    axes = ctx.attr("axes")
    out_rank = x.ndim + len(axes)
    return np.expand_dims(x, tuple(sorted(_axis(a, out_rank) for a in axes)))


@register_op_semantics("concat")
def _concat(ctx: OpContext) -> np.ndarray:
    values = ctx.arrays("values")
    if values[0].ndim == 0:
        return np.stack(values)
    axis = _axis(ctx.attr("axis"), values[0].ndim)
    if not ctx.attr("interleave", False):
        return np.concatenate(values, axis=axis)
    # interleave: out[i::n] = values[i] along the axis (all inputs share one shape).
    stacked = np.stack(values, axis=axis + 1)
    shape = list(values[0].shape)
    shape[axis] *= len(values)
    return stacked.reshape(shape)


@register_op_semantics("split")
def _split(ctx: OpContext) -> tuple[np.ndarray, ...]:
    x = ctx.array("x")
    axis = _axis(ctx.attr("axis"), x.ndim)
    sizes = ctx.attr("split_sizes", None)
    if sizes is None:
        parts = int(ctx.attr("num_splits"))
        sizes = [x.shape[axis] // parts] * parts
    boundaries = np.cumsum(sizes)[:-1]
    return tuple(np.split(x, boundaries, axis=axis))


@register_op_semantics("stack")
def _stack(ctx: OpContext) -> np.ndarray:
    values = ctx.arrays("values")
    return np.stack(values, axis=_axis(ctx.attr("axis"), values[0].ndim + 1))


@register_op_semantics("tile")
def _tile(ctx: OpContext) -> np.ndarray:
    return np.tile(ctx.array("x"), ctx.attr("reps"))


@register_op_semantics("shape")
def _shape(ctx: OpContext) -> np.ndarray:
    return np.asarray(ctx.array("x").shape, dtype=np.int32)


@register_op_semantics("flatten2d")
def _flatten2d(ctx: OpContext) -> np.ndarray:
    x = ctx.array("x")
    axis = _axis(ctx.attr("axis", 1), x.ndim)
    return x.reshape(int(np.prod(x.shape[:axis])), int(np.prod(x.shape[axis:])))


@register_op_semantics("reverse")
def _reverse(ctx: OpContext) -> np.ndarray:
    x = ctx.array("x")
    return np.flip(x, axis=_axes(ctx.attr("axes", None), x.ndim))


def _index_slices(ctx: OpContext, shape: Sequence[int]) -> tuple[tuple[Any, ...], bool]:
    """Python slices (or integer indices for squeezed axes) of ``slice_by_index``/``slice_update``."""
    rank = len(shape)
    begin = [int(b) for b in np.asarray(ctx.attr("begin")).reshape(-1)]
    end = [int(e) for e in np.asarray(ctx.attr("end")).reshape(-1)]
    stride = ctx.attr("stride", None) or [1] * rank
    begin_mask = ctx.attr("begin_mask", None) or [False] * rank
    end_mask = ctx.attr("end_mask", None) or [False] * rank
    squeeze_mask = ctx.attr("squeeze_mask", None) or [False] * rank
    index: list[Any] = []
    for i in range(rank):
        start = None if begin_mask[i] else begin[i]
        if squeeze_mask[i]:
            index.append(0 if start is None else start)
            continue
        index.append(slice(start, None if end_mask[i] else end[i], int(stride[i])))
    return tuple(index), any(squeeze_mask)


@register_op_semantics("slice_by_index")
def _slice_by_index(ctx: OpContext) -> np.ndarray:
    x = ctx.array("x")
    index, _ = _index_slices(ctx, x.shape)
    return np.asarray(x[index])


@register_op_semantics("slice_update")
def _slice_update(ctx: OpContext) -> np.ndarray:
    out = np.array(ctx.array("x"), copy=True)
    index, _ = _index_slices(ctx, out.shape)
    out[index] = ctx.array("update")
    return out


def _state_cell(ctx: OpContext, name: str) -> _StateCell:
    cell = ctx._runner.lookup(ctx.op.inputs[name], ctx._env)
    if not isinstance(cell, _StateCell):
        raise ctx.unsupported(f"input '{name}' is not a function's state input")
    return cell


@register_op_semantics("read_state")
def _read_state(ctx: OpContext) -> np.ndarray:
    cell = _state_cell(ctx, "input")
    return np.array(cell.values[cell.name], dtype=ctx.out_dtype(), copy=True)


@register_op_semantics("coreml_update_state")
def _coreml_update_state(ctx: OpContext) -> np.ndarray:
    cell = _state_cell(ctx, "state")
    value = np.array(ctx.array("value"), copy=True)
    _check_declared_shape(value.shape, cell.var.sym_type.wrapped_type().get_shape(), f"state '{cell.name}'")
    cell.values[cell.name] = value
    return value


@register_op_semantics("slice_by_size")
def _slice_by_size(ctx: OpContext) -> np.ndarray:
    x = ctx.array("x")
    begin = [int(b) for b in np.asarray(ctx.attr("begin")).reshape(-1)]
    size = [int(s) for s in np.asarray(ctx.attr("size")).reshape(-1)]
    index = []
    for dim, (start, length) in enumerate(zip(begin, size)):
        start = _axis(start, x.shape[dim])
        index.append(slice(start, None if length == -1 else start + length))
    return x[tuple(index)]


@register_op_semantics("crop")
def _crop(ctx: OpContext) -> np.ndarray:
    x = ctx.array("x")
    top, bottom = ctx.attr("crop_height")
    left, right = ctx.attr("crop_width")
    return x[..., top : x.shape[-2] - bottom, left : x.shape[-1] - right]


@register_op_semantics("pad")
def _pad(ctx: OpContext) -> np.ndarray:
    x = ctx.array("x")
    pad = [int(p) for p in np.asarray(ctx.attr("pad")).reshape(-1)]
    widths = [(0, 0)] * (x.ndim - len(pad) // 2) + [
        (pad[2 * i], pad[2 * i + 1]) for i in range(len(pad) // 2)
    ]
    mode = ctx.attr("mode", "constant")
    if mode == "constant":
        value = ctx.array("constant_val") if ctx.has("constant_val") else 0.0
        return np.pad(x, widths, mode="constant", constant_values=value)
    if mode == "reflect":
        return np.pad(x, widths, mode="reflect")
    if mode == "replicate":
        return np.pad(x, widths, mode="edge")
    raise ctx.unsupported(f"pad mode {mode!r}")


@register_op_semantics("fill")
def _fill(ctx: OpContext) -> np.ndarray:
    shape = [int(s) for s in np.asarray(ctx.attr("shape")).reshape(-1)]
    value = ctx.array("value") if ctx.has("value") else np.asarray(0.0)
    return np.full(shape, value, dtype=ctx.out_dtype())


@register_op_semantics("fill_like")
def _fill_like(ctx: OpContext) -> np.ndarray:
    value = ctx.array("value") if ctx.has("value") else np.asarray(0.0)
    return np.full(ctx.array("ref_tensor").shape, value, dtype=ctx.out_dtype())


@register_op_semantics("range_1d")
def _range_1d(ctx: OpContext) -> np.ndarray:
    # numpy's stubs take scalars only; 0-d arrays are what numpy itself computes with (Python floats
    # from .item() would give float32 ranges other values)
    return np.arange(ctx.array("start"), ctx.array("end"), ctx.array("step"))  # type: ignore[call-overload]


@register_op_semantics("band_part")
def _band_part(ctx: OpContext) -> np.ndarray:
    x = ctx.array("x")
    lower, upper = int(ctx.attr("lower", -1)), int(ctx.attr("upper", -1))
    rows = np.arange(x.shape[-2])[:, None]
    cols = np.arange(x.shape[-1])[None, :]
    keep = ((lower < 0) | (rows - cols <= lower)) & ((upper < 0) | (cols - rows <= upper))
    return np.where(keep, x, np.zeros((), dtype=x.dtype))


@register_op_semantics("cumsum")
def _cumsum(ctx: OpContext) -> np.ndarray:
    x = ctx.array("x")
    axis = _axis(ctx.attr("axis", 0), x.ndim)
    reverse = bool(ctx.attr("reverse", False))
    data = np.flip(x, axis) if reverse else x
    total = np.cumsum(data, axis=axis)
    if ctx.attr("exclusive", False):
        # out[i] = sum of the elements strictly before i (shifted, not total - x, to stay exact).
        zeros = np.zeros_like(np.take(total, [0], axis=axis))
        total = np.concatenate(
            [zeros, np.take(total, np.arange(total.shape[axis] - 1), axis=axis)], axis=axis
        )
    return np.flip(total, axis) if reverse else total


def _sort_indices(x: np.ndarray, axis: int, ascending: bool) -> np.ndarray:
    """Stable sort order; ties keep their original order in both directions."""
    if ascending:
        return np.argsort(x, axis=axis, kind="stable")
    reversed_order = np.argsort(np.flip(x, axis), axis=axis, kind="stable")
    reversed_order = x.shape[axis] - 1 - reversed_order
    return np.flip(reversed_order, axis)


@register_op_semantics("topk")
def _topk(ctx: OpContext) -> np.ndarray | tuple[np.ndarray, ...]:
    # With sort=False the order is unspecified; the evaluator returns the sorted order.
    x = ctx.array("x")
    axis = _axis(ctx.attr("axis", -1), x.ndim)
    k = int(ctx.attr("k", 1))
    order = _sort_indices(x, axis, bool(ctx.attr("ascending", False)))
    indices = np.take(order, np.arange(k), axis=axis)
    values = np.take_along_axis(x, indices, axis=axis)
    if not ctx.attr("return_indices", True):
        return values
    return values, indices


@register_op_semantics("argsort")
def _argsort(ctx: OpContext) -> np.ndarray:
    x = ctx.array("x")
    return _sort_indices(x, _axis(ctx.attr("axis", -1), x.ndim), bool(ctx.attr("ascending", False)))


@register_op_semantics("non_zero")
def _non_zero(ctx: OpContext) -> np.ndarray:
    return np.transpose(np.nonzero(ctx.array("x")))


@register_op_semantics("one_hot")
def _one_hot(ctx: OpContext) -> np.ndarray:
    # Indices outside [0, depth) give an all-off vector.
    indices = ctx.array("indices")
    depth = int(ctx.attr("one_hot_vector_size"))
    on = ctx.array("on_value") if ctx.has("on_value") else np.asarray(1)
    off = ctx.array("off_value") if ctx.has("off_value") else np.asarray(0)
    hot = np.where(indices[..., None] == np.arange(depth), on, off)
    return np.moveaxis(hot, -1, _axis(ctx.attr("axis", -1), indices.ndim + 1))


@register_op_semantics("sliding_windows")
def _sliding_windows(ctx: OpContext) -> np.ndarray:
    x = ctx.array("x")
    axis = _axis(ctx.attr("axis"), x.ndim)
    size, stride = int(ctx.attr("size")), int(ctx.attr("stride", 1))
    windows = np.lib.stride_tricks.sliding_window_view(x, size, axis=axis)
    windows = np.take(windows, np.arange(0, windows.shape[axis], stride), axis=axis)
    return np.moveaxis(windows, -1, axis + 1)


@register_op_semantics("depth_to_space")
def _depth_to_space(ctx: OpContext) -> np.ndarray:
    # Depth-column-row order (TensorFlow's depth_to_space, which the TF frontend maps to this op).
    x = ctx.array("x")
    b = int(ctx.attr("block_size"))
    n, c, h, w = x.shape
    y = x.reshape(n, b, b, c // (b * b), h, w).transpose(0, 3, 4, 1, 5, 2)
    return y.reshape(n, c // (b * b), h * b, w * b)


@register_op_semantics("space_to_depth")
def _space_to_depth(ctx: OpContext) -> np.ndarray:
    x = ctx.array("x")
    b = int(ctx.attr("block_size"))
    n, c, h, w = x.shape
    y = x.reshape(n, c, h // b, b, w // b, b).transpose(0, 3, 5, 1, 2, 4)
    return y.reshape(n, c * b * b, h // b, w // b)


@register_op_semantics("pixel_shuffle")
def _pixel_shuffle(ctx: OpContext) -> np.ndarray:
    # PyTorch's PixelShuffle (channel-row-column order).
    x = ctx.array("x")
    f = int(ctx.attr("upscale_factor"))
    n, c, h, w = x.shape
    y = x.reshape(n, c // (f * f), f, f, h, w).transpose(0, 1, 4, 2, 5, 3)
    return y.reshape(n, c // (f * f), h * f, w * f)


@register_op_semantics("pixel_unshuffle")
def _pixel_unshuffle(ctx: OpContext) -> np.ndarray:
    x = ctx.array("x")
    f = int(ctx.attr("downscale_factor"))
    n, c, h, w = x.shape
    y = x.reshape(n, c, h // f, f, w // f, f).transpose(0, 1, 3, 5, 2, 4)
    return y.reshape(n, c * f * f, h // f, w // f)


@register_op_semantics("upsample_nearest_neighbor")
def _upsample_nearest_neighbor(ctx: OpContext) -> np.ndarray:
    x = ctx.array("x")
    scale_h = ctx.attr("scale_factor_height", 1)
    scale_w = ctx.attr("scale_factor_width", 1)
    if float(scale_h) != int(scale_h) or float(scale_w) != int(scale_w):
        raise ctx.unsupported(f"fractional scale factors ({scale_h}, {scale_w})")
    return np.repeat(np.repeat(x, int(scale_h), axis=-2), int(scale_w), axis=-1)


# Image resizing. The definitions (``ops/defs/iOS15/image_resizing.py``) describe each sampling mode by
# the grid of input coordinates it samples along one axis: output i of Xout reads input coordinate
# grid[i], clamped to [0, Xin - 1], interpolated linearly between its two neighbours. Each axis is
# resampled on its own (separable), height first.

_SAMPLING_MODES: Final = (
    "STRICT_ALIGN_CORNERS",
    "ALIGN_CORNERS",
    "DEFAULT",
    "OFFSET_CORNERS",
    "UNALIGN_CORNERS",
)


def _sampling_grid(ctx: OpContext, mode: str, size_in: int, size_out: int) -> np.ndarray:
    """The input coordinates ``resize_bilinear``'s ``sampling_mode`` samples, as its definition gives them."""
    i = np.arange(size_out, dtype=np.float64)
    if mode in ("STRICT_ALIGN_CORNERS", "ALIGN_CORNERS"):
        if size_out == 1:
            if mode == "STRICT_ALIGN_CORNERS" and size_in > 1:
                raise ctx.unsupported(
                    "STRICT_ALIGN_CORNERS to one output sample (a spacing of (Xin - 1) / 0)"
                )
            grid = np.full(1, (size_in - 1) / 2)
        else:
            grid = i * ((size_in - 1) / (size_out - 1))
    elif mode == "DEFAULT":
        # (Xin - Xin / Xout) / (Xout - 1) is Xin / Xout (and any spacing for one sample, which reads 0).
        grid = i * (size_in / size_out)
    elif mode == "OFFSET_CORNERS":
        delta = max(1, size_in - 1) / size_out
        grid = 0.5 * delta + i * delta
    elif mode == "UNALIGN_CORNERS":
        spacing = size_in / size_out
        grid = i * spacing + 0.5 * spacing - 0.5
    else:
        raise ctx.unsupported(f"sampling_mode {mode!r}; the definition has {list(_SAMPLING_MODES)}")
    return np.clip(grid, 0, size_in - 1)


def _interpolate_axis(x: np.ndarray, axis: int, grid: np.ndarray) -> np.ndarray:
    """Linear interpolation of ``x`` along ``axis`` at the (clamped) coordinates ``grid``."""
    low = np.floor(grid).astype(np.int64)
    high = np.minimum(low + 1, x.shape[axis] - 1)
    shape = [1] * x.ndim
    shape[axis] = grid.size
    weight = (grid - low).reshape(shape)
    return np.take(x, low, axis=axis) * (1 - weight) + np.take(x, high, axis=axis) * weight


def _resize_linear(ctx: OpContext, x: np.ndarray, sizes: Sequence[int], mode: str) -> np.ndarray:
    """Resample the last ``len(sizes)`` axes of ``x`` to ``sizes`` with ``sampling_mode`` ``mode``."""
    for k, size_out in enumerate(sizes):
        axis = x.ndim - len(sizes) + k
        x = _interpolate_axis(x, axis, _sampling_grid(ctx, mode, x.shape[axis], int(size_out)))
    return x


def _nearest_integer_upsample(ctx: OpContext, x: np.ndarray, sizes: Sequence[int]) -> np.ndarray:
    """Nearest-neighbour resize of the last axes to ``sizes``, each a whole multiple of its input size.

    Every convention (``floor(i * Xin / Xout)``, the half-pixel ``floor((i + 0.5) * Xin / Xout)``) reads
    the same input there: each input repeated ``Xout / Xin`` times. Other ratios differ between them and
    the definitions do not say which one the op is, so they are refused.
    """
    for k, size_out in enumerate(sizes):
        axis = x.ndim - len(sizes) + k
        size_in = x.shape[axis]
        if int(size_out) % size_in:
            raise ctx.unsupported(
                f"nearest-neighbour resize of {size_in} to {size_out} samples (not a whole multiple: the "
                "definition does not say which input each output reads)"
            )
        x = np.repeat(x, int(size_out) // size_in, axis=axis)
    return x


@register_op_semantics("upsample_bilinear")
def _upsample_bilinear(ctx: OpContext) -> np.ndarray:
    # The output size is floor(X * scale); the grid is recomputed from the sizes (the definition says it
    # is PyTorch's recompute_scale_factor=True). align_corners=True samples as ALIGN_CORNERS (PyTorch's
    # align_corners=True: one output sample reads input 0, which is (Xin - 1) / 2 only for Xin = 1);
    # align_corners=False with half_pixel_centers (iOS16, default: not align_corners) as UNALIGN_CORNERS
    # (PyTorch's align_corners=False, TensorFlow's half_pixel_centers=True), without as DEFAULT
    # (TensorFlow's legacy ResizeBilinear). Both True: TensorFlow refuses it, so does the evaluator.
    x = ctx.array("x")
    align_corners = bool(ctx.attr("align_corners", True))
    half_pixel = bool(ctx.attr("half_pixel_centers", not align_corners))
    if align_corners and half_pixel:
        raise ctx.unsupported("align_corners and half_pixel_centers both True")
    scales = (float(ctx.attr("scale_factor_height", 1)), float(ctx.attr("scale_factor_width", 1)))
    sizes = [int(np.floor(n * s)) for n, s in zip(x.shape[-2:], scales)]
    if not align_corners:
        return _resize_linear(ctx, x, sizes, "UNALIGN_CORNERS" if half_pixel else "DEFAULT")
    for k, size_out in enumerate(sizes):
        axis = x.ndim - 2 + k
        size_in = x.shape[axis]
        spacing = (size_in - 1) / (size_out - 1) if size_out > 1 else 0.0
        grid = np.clip(np.arange(size_out) * spacing, 0, size_in - 1)
        x = _interpolate_axis(x, axis, grid)
    return x


@register_op_semantics("resize_bilinear")
def _resize_bilinear(ctx: OpContext) -> np.ndarray:
    sizes = (int(ctx.attr("target_size_height", 1)), int(ctx.attr("target_size_width", 1)))
    return _resize_linear(ctx, ctx.array("x"), sizes, str(ctx.attr("sampling_mode", "DEFAULT")))


@register_op_semantics("resize_nearest_neighbor")
def _resize_nearest_neighbor(ctx: OpContext) -> np.ndarray:
    sizes = (int(ctx.attr("target_size_height")), int(ctx.attr("target_size_width")))
    return _nearest_integer_upsample(ctx, ctx.array("x"), sizes)


@register_op_semantics("resize")
def _resize(ctx: OpContext) -> np.ndarray:
    # iOS17: the last resized_dims axes take their sizes from the end of `shape` (0 keeps x's size).
    # NEAREST_NEIGHBOR with the DEFAULT sampling mode is resize_nearest_neighbor (the TensorFlow frontend
    # emits either for the same half-pixel resize); the definition gives the other modes for LINEAR only.
    x = ctx.array("x")
    shape = [int(s) for s in np.asarray(ctx.array("shape")).reshape(-1)]
    count = int(ctx.attr("resized_dims"))
    targets = shape[len(shape) - count :]
    sizes = [x.shape[x.ndim - count + k] if s == 0 else s for k, s in enumerate(targets)]
    interpolation = str(ctx.attr("interpolation_mode", "LINEAR"))
    mode = str(ctx.attr("sampling_mode", "DEFAULT"))
    if interpolation == "NEAREST_NEIGHBOR" and mode == "DEFAULT":
        return _nearest_integer_upsample(ctx, x, sizes)
    if interpolation != "LINEAR":
        raise ctx.unsupported(f"interpolation_mode {interpolation!r} with sampling_mode {mode!r}")
    if not np.issubdtype(x.dtype, np.floating):
        raise ctx.unsupported("a LINEAR resize of an integer tensor (the rounding is not defined)")
    return _resize_linear(ctx, x, sizes, mode)


# --------------------------------------------------------------------------------------------------
# Gather and scatter
# --------------------------------------------------------------------------------------------------


@register_op_semantics("gather")
def _gather(ctx: OpContext) -> np.ndarray:
    # out[b..., i..., rest] = x[b..., indices[b..., i...], rest] with b the batch_dims leading axes.
    x = ctx.array("x")
    axis = _axis(ctx.attr("axis", 0), x.ndim)
    batch_dims = int(ctx.attr("batch_dims", 0))
    indices = _normalize_indices(ctx.array("indices"), x.shape[axis])
    if batch_dims == 0:
        return np.take(x, indices, axis=axis)
    batch_shape = x.shape[:batch_dims]
    parts = [np.take(x[b], indices[b], axis=axis - batch_dims) for b in np.ndindex(*batch_shape)]
    stacked = np.stack(parts)
    return stacked.reshape(*batch_shape, *stacked.shape[1:])


@register_op_semantics("gather_along_axis")
def _gather_along_axis(ctx: OpContext) -> np.ndarray:
    x = ctx.array("x")
    axis = _axis(ctx.attr("axis", 0), x.ndim)
    return np.take_along_axis(x, _normalize_indices(ctx.array("indices"), x.shape[axis]), axis=axis)


@register_op_semantics("gather_nd")
def _gather_nd(ctx: OpContext) -> np.ndarray:
    x, indices = ctx.array("x"), ctx.array("indices")
    batch_dims = int(ctx.attr("batch_dims", 0))
    depth = indices.shape[-1]

    def lookup(data: np.ndarray, idx: np.ndarray) -> np.ndarray:
        coords = tuple(_normalize_indices(idx[..., j], data.shape[j]) for j in range(depth))
        return data[coords]

    if batch_dims == 0:
        return lookup(x, indices)
    batch_shape = x.shape[:batch_dims]
    stacked = np.stack([lookup(x[b], indices[b]) for b in np.ndindex(*batch_shape)])
    return stacked.reshape(*batch_shape, *stacked.shape[1:])


_SCATTER_MODES: Final[dict[str, np.ufunc]] = {
    "add": np.add,
    "sub": np.subtract,
    "mul": np.multiply,
    "div": np.divide,
    "max": np.maximum,
    "min": np.minimum,
}


def _scatter_into(ctx: OpContext, coords: tuple[np.ndarray, ...], updates: np.ndarray) -> np.ndarray:
    """Apply ``mode`` at ``coords`` (duplicates accumulate in order); ``update`` needs unique targets."""
    out = np.array(ctx.array("data"), copy=True)
    mode = ctx.attr("mode", "add")  # the definitions' default_inputs (their docstrings say "update")
    if mode == "update":
        flat = np.ravel_multi_index(tuple(np.broadcast_arrays(*coords)), out.shape[: len(coords)])
        if np.unique(flat).size != flat.size:
            raise ctx.unsupported("mode 'update' with duplicate indices (which write wins is undefined)")
        out[coords] = updates
        return out
    if mode not in _SCATTER_MODES:
        raise ctx.unsupported(f"scatter mode {mode!r}")
    _SCATTER_MODES[mode].at(out, coords, updates)
    return out


@register_op_semantics("scatter")
def _scatter(ctx: OpContext) -> np.ndarray:
    data, updates = ctx.array("data"), ctx.array("updates")
    axis = _axis(ctx.attr("axis", 0), data.ndim)
    indices = _normalize_indices(ctx.array("indices"), data.shape[axis])
    grid: list[np.ndarray] = list(np.indices(updates.shape, sparse=True))
    grid[axis] = indices.reshape([-1 if d == axis else 1 for d in range(updates.ndim)])
    return _scatter_into(ctx, tuple(grid), updates)


@register_op_semantics("scatter_along_axis")
def _scatter_along_axis(ctx: OpContext) -> np.ndarray:
    data, updates = ctx.array("data"), ctx.array("updates")
    axis = _axis(ctx.attr("axis", 0), data.ndim)
    grid: list[np.ndarray] = list(np.indices(updates.shape, sparse=True))
    grid[axis] = _normalize_indices(ctx.array("indices"), data.shape[axis])
    return _scatter_into(ctx, tuple(grid), updates)


@register_op_semantics("scatter_nd")
def _scatter_nd(ctx: OpContext) -> np.ndarray:
    data, indices = ctx.array("data"), ctx.array("indices")
    coords = tuple(_normalize_indices(indices[..., j], data.shape[j]) for j in range(indices.shape[-1]))
    return _scatter_into(ctx, coords, ctx.array("updates"))


# --------------------------------------------------------------------------------------------------
# Quantization and compressed constants
# --------------------------------------------------------------------------------------------------


def _per_axis(param: np.ndarray, rank: int, axis: int | None) -> np.ndarray:
    if param.ndim == 0 or axis is None:
        return param
    shape = [1] * rank
    shape[_axis(axis, rank)] = -1
    return param.reshape(shape)


@register_op_semantics("quantize")
def _quantize(ctx: OpContext) -> np.ndarray:
    x = ctx.array("input")
    axis = ctx.attr("axis", None)
    quantized = np.round(x / _per_axis(ctx.array("scale"), x.ndim, axis))
    if ctx.has("zero_point"):
        quantized = quantized + _per_axis(ctx.array("zero_point").astype(np.float64), x.ndim, axis)
    limits = np.iinfo(ctx.out_dtype())
    return np.clip(quantized, limits.min, limits.max)


@register_op_semantics("dequantize")
def _dequantize(ctx: OpContext) -> np.ndarray:
    x = ctx.array("input").astype(np.float64)
    axis = ctx.attr("axis", None)
    if ctx.has("zero_point"):
        x = x - _per_axis(ctx.array("zero_point").astype(np.float64), x.ndim, axis)
    return x * _per_axis(ctx.array("scale"), x.ndim, axis)


@register_op_semantics(
    "constexpr_affine_dequantize",
    "constexpr_cast",
    "constexpr_lut_to_sparse",
    "constexpr_sparse_blockwise_shift_scale",
    "constexpr_sparse_to_dense",
)
def _constexpr(ctx: OpContext) -> Any:
    # Compressed weights: the decompression coremltools defines is the definition of these ops.
    value = ctx.op.materialized_val_inference()
    return tuple(value) if isinstance(value, (tuple, list)) else value


def _repeat_blocks(block_values: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    """Per-block values (each axis dividing ``shape``'s) repeated to one per element of ``shape``."""
    for axis, size in enumerate(shape):
        block_values = np.repeat(block_values, size // block_values.shape[axis], axis=axis)
    return block_values


@register_op_semantics("constexpr_blockwise_shift_scale")
def _constexpr_blockwise_shift_scale(ctx: OpContext) -> np.ndarray:
    # iOS18: output[i] = scale[i // block] * (data[i] - offset[i // block]), block = data.shape / scale.shape.
    # The inputs are evaluated, so ``data`` (or ``scale``) may come from another constexpr op.
    dtype = ctx.out_dtype()
    data = ctx.array("data").astype(dtype)
    if ctx.has("offset"):
        data = data - _repeat_blocks(ctx.array("offset").astype(dtype), data.shape)
    return _repeat_blocks(ctx.array("scale").astype(dtype), data.shape) * data


@register_op_semantics("constexpr_lut_to_dense")
def _constexpr_lut_to_dense(ctx: OpContext) -> np.ndarray:
    if ctx.has("shape"):  # iOS16: packed indices, one LUT for the whole tensor
        return ctx.op.materialized_val_inference()
    # iOS18: lut [I0/B0, ..., I(r-1)/B(r-1), 2^nbits, V]; element i of the output (V consecutive ones
    # along vector_axis when V > 1) is lut[i // B, indices[i], :]. ``lut`` may come from another constexpr.
    indices = ctx.array("indices").astype(np.int64)
    lut = ctx.array("lut")
    blocks = tuple(
        grid // (size // lut.shape[k])
        for k, (grid, size) in enumerate(zip(np.indices(indices.shape), indices.shape))
    )
    values = lut[blocks + (indices,)]  # indices.shape + (V,)
    if lut.shape[-1] == 1:
        return values[..., 0]
    axis = _axis(ctx.attr("vector_axis"), indices.ndim)
    out_shape = list(indices.shape)
    out_shape[axis] *= lut.shape[-1]
    return np.moveaxis(values, -1, axis + 1).reshape(out_shape)


# --------------------------------------------------------------------------------------------------
# Control flow
# --------------------------------------------------------------------------------------------------


@register_op_semantics("cond")
def _cond(ctx: OpContext) -> tuple[Any, ...]:
    branch = ctx.op.blocks[0] if bool(ctx.array("pred")) else ctx.op.blocks[1]
    return tuple(ctx.run_block(branch, ()))


@register_op_semantics("while_loop")
def _while_loop(ctx: OpContext) -> tuple[Any, ...]:
    cond_block, body_block = ctx.op.blocks
    values = list(ctx.arrays("loop_vars"))
    for _ in range(_MAX_WHILE_ITERATIONS):
        (keep_going,) = ctx.run_block(cond_block, values)
        if not bool(keep_going):
            return tuple(values)
        values = ctx.run_block(body_block, values)
    raise EvaluationError(
        f"while_loop '{ctx.op.name}' did not stop after {_MAX_WHILE_ITERATIONS} iterations."
    )


del _op_type, _fn, _fn2, _fn3
