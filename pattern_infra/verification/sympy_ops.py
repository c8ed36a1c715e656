"""What each MIL op computes, as sympy: the semantics :mod:`~pattern_infra.verification.symbolic` builds
its expressions from (elementwise ops only; :func:`symbolic_semantics` is None for any other op)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, Final

import numpy as np
import sympy as sp
from coremltools.converters.mil.mil import types

from pattern_infra.verification.errors import NotElementwiseError

__all__ = ["SymOp", "sym_value", "symbolic_semantics"]


def _number(value: Any) -> sp.Basic:
    """An exact sympy number for a numpy/python scalar (floats keep their exact binary value)."""
    if isinstance(value, (bool, np.bool_)):
        return sp.true if bool(value) else sp.false
    if isinstance(value, (int, np.integer)):
        return sp.Integer(int(value))
    return sp.Rational(float(value))


class SymOp:
    """What a symbolic translation sees: the op and sympy expressions for its inputs."""

    __slots__ = ("op", "_env")

    def __init__(self, op: Any, env: Mapping[Any, sp.Basic]) -> None:
        self.op = op
        self._env = env

    def has(self, name: str) -> bool:
        return name in self.op.inputs

    def arg(self, name: str) -> sp.Basic:
        return sym_value(self.op.inputs[name], self._env, f"op '{self.op.name}' ({self.op.op_type})")

    def attr(self, name: str, default: Any = None) -> Any:
        var = self.op.inputs.get(name)
        if var is None:
            return default
        value = var.val
        if value is None:
            raise NotElementwiseError(
                f"Op '{self.op.name}' ({self.op.op_type}): parameter '{name}' is not a compile-time value."
            )
        return value.item() if isinstance(value, np.generic) else value


def sym_value(var: Any, env: Mapping[Any, sp.Basic], consumer: str) -> sp.Basic:
    if var in env:
        return env[var]
    value = var.val
    if value is None:
        raise NotElementwiseError(f"Var '{var.name}' used by {consumer} has no symbolic value.")
    array = np.asarray(value)
    if array.size == 0 or not np.all(array == array.reshape(-1)[0]):
        raise NotElementwiseError(
            f"The program is not purely elementwise: {consumer} uses constant '{var.name}' of shape "
            f"{array.shape} whose elements differ, so one symbol per input element cannot describe "
            "the output."
        )
    return _number(array.reshape(-1)[0])


def _default_epsilon(sym: SymOp, default: float) -> sp.Basic:
    if sym.has("epsilon"):
        return sym.arg("epsilon")
    dtype = types.nptype_from_builtin(sym.op.inputs["x"].dtype)
    return _number(np.asarray(default, dtype=dtype).item())


def _sigmoid_expr(x: sp.Basic) -> sp.Basic:
    return 1 / (1 + sp.exp(-x))


def _truncate(x: sp.Basic) -> sp.Basic:
    return sp.Piecewise((sp.floor(x), x >= 0), (sp.ceiling(x), True))


_SYM_UNARY: Final[dict[str, Callable[[sp.Basic], sp.Basic]]] = {
    "abs": sp.Abs,
    "acos": sp.acos,
    "asin": sp.asin,
    "atan": sp.atan,
    "atanh": sp.atanh,
    "ceil": sp.ceiling,
    "cos": sp.cos,
    "cosh": sp.cosh,
    "erf": sp.erf,
    "exp": sp.exp,
    "exp2": lambda x: sp.Integer(2) ** x,
    "floor": sp.floor,
    "identity": lambda x: x,
    "logical_not": sp.Not,
    "relu": lambda x: sp.Max(x, 0),
    "relu6": lambda x: sp.Min(sp.Max(x, 0), 6),
    "sigmoid": _sigmoid_expr,
    "sign": sp.sign,
    "silu": lambda x: x * _sigmoid_expr(x),
    "sin": sp.sin,
    "sinh": sp.sinh,
    "softplus": lambda x: sp.log(1 + sp.exp(x)),
    "softsign": lambda x: x / (1 + sp.Abs(x)),
    "sqrt": sp.sqrt,
    "square": lambda x: x**2,
    "tan": sp.tan,
    "tanh": sp.tanh,
}

_SYM_BINARY: Final[dict[str, Callable[[sp.Basic, sp.Basic], sp.Basic]]] = {
    "add": lambda x, y: x + y,
    "sub": lambda x, y: x - y,
    "mul": lambda x, y: x * y,
    "real_div": lambda x, y: x / y,
    "pow": lambda x, y: x**y,
    "floor_div": lambda x, y: sp.floor(x / y),
    "mod": sp.Mod,
    "maximum": sp.Max,
    "minimum": sp.Min,
    "equal": sp.Eq,
    "not_equal": sp.Ne,
    "less": sp.Lt,
    "less_equal": sp.Le,
    "greater": sp.Gt,
    "greater_equal": sp.Ge,
    "logical_and": sp.And,
    "logical_or": sp.Or,
    "logical_xor": sp.Xor,
}


def _gelu_expr(sym: SymOp) -> sp.Basic:
    x = sym.arg("x")
    mode = sym.attr("mode", "EXACT")
    if mode == "EXACT":
        return x / 2 * (1 + sp.erf(x / sp.sqrt(2)))
    if mode == "TANH_APPROXIMATION":
        return x / 2 * (1 + sp.tanh(sp.sqrt(2 / sp.pi) * (x + sp.Rational(44715, 10**6) * x**3)))
    if mode == "SIGMOID_APPROXIMATION":
        return x * _sigmoid_expr(sp.Rational(1702, 1000) * x)
    raise NotElementwiseError(f"Op '{sym.op.name}': unknown gelu mode {mode!r}.")


def _cast_expr(sym: SymOp) -> sp.Basic:
    x = sym.arg("x")
    target = sym.op.outputs[0].dtype
    if types.is_float(target):
        return x
    if types.is_int(target):
        return _truncate(x)
    if types.is_bool(target):
        return sp.Ne(x, 0)
    raise NotElementwiseError(f"Op '{sym.op.name}': cast to {types.builtin_to_string(target)}.")


_SYM_OTHER: Final[dict[str, Callable[[SymOp], sp.Basic]]] = {
    "inverse": lambda s: 1 / (s.arg("x") + _default_epsilon(s, 1e-4)),
    "log": lambda s: sp.log(s.arg("x") + _default_epsilon(s, 1e-45)),
    "rsqrt": lambda s: 1 / sp.sqrt(s.arg("x") + _default_epsilon(s, 1e-12)),
    "clip": lambda s: sp.Min(sp.Max(s.arg("x"), s.arg("alpha")), s.arg("beta")),
    "threshold": lambda s: sp.Max(s.arg("x"), s.arg("alpha")),
    "leaky_relu": lambda s: sp.Piecewise((s.arg("x"), s.arg("x") >= 0), (s.arg("alpha") * s.arg("x"), True)),
    "prelu": lambda s: sp.Piecewise((s.arg("x"), s.arg("x") > 0), (s.arg("alpha") * s.arg("x"), True)),
    "elu": lambda s: sp.Piecewise(
        (s.arg("x"), s.arg("x") > 0), (s.arg("alpha") * (sp.exp(s.arg("x")) - 1), True)
    ),
    "thresholded_relu": lambda s: sp.Piecewise((s.arg("x"), s.arg("x") >= s.arg("alpha")), (0, True)),
    "clamped_relu": lambda s: sp.Piecewise(
        (sp.Min(s.arg("beta"), s.arg("x")), s.arg("x") >= 0),
        (sp.Min(s.arg("beta"), s.arg("alpha") * s.arg("x")), True),
    ),
    "linear_activation": lambda s: s.arg("alpha") * s.arg("x") + s.arg("beta"),
    "scaled_tanh": lambda s: s.arg("alpha") * sp.tanh(s.arg("beta") * s.arg("x")),
    "sigmoid_hard": lambda s: sp.Min(sp.Max(s.arg("alpha") * s.arg("x") + s.arg("beta"), 0), 1),
    "softplus_parametric": lambda s: s.arg("alpha") * sp.log(1 + sp.exp(s.arg("beta") * s.arg("x"))),
    "gelu": _gelu_expr,
    "cast": _cast_expr,
    "select": lambda s: sp.Piecewise((s.arg("a"), s.arg("cond")), (s.arg("b"), True)),
}


def symbolic_semantics(op_type: str) -> Callable[[SymOp], sp.Basic] | None:
    if op_type in _SYM_UNARY:
        fn = _SYM_UNARY[op_type]
        return lambda s: fn(s.arg("x"))
    if op_type in _SYM_BINARY:
        fn2 = _SYM_BINARY[op_type]
        return lambda s: fn2(s.arg("x"), s.arg("y"))
    return _SYM_OTHER.get(op_type)
