"""Declarative replacement: the rewrite written as a second ``mb.program``.

Instead of a hand-written ``transform_pattern``, a fusion can give the program its match becomes::

    @mb.program(input_specs=[mb.TensorSpec(shape=(get_new_symbol(),))])
    def gelu_replacement(x):
        return mb.gelu(x=x, mode="TANH_APPROXIMATION")

    register_generic_pass(gelu_pattern, None, replace_with(gelu_replacement), "fuse_gelu", "mine")

The replacement's inputs are bound by name to the pattern's inputs (or, through ``bind``, to any operand
or constant of the match). Its ops are re-created in the block, before the match's first final op, in
their order; the op producing the replacement's i-th output takes the name of the match's i-th output
variable (so downstream names do not change), the others are named ``<that name>_<op name>``. Scope
information is attached by coremltools' builder under the pass's scope, as for any transform, and the
matched ops left without users are removed by the framework.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from coremltools.converters.mil import Builder as mb
from coremltools.converters.mil.mil import Program, Var

from ..language.errors import PatternDefinitionError
from ..language.pattern import Pattern

__all__ = ["replace_with"]

Binding = str | Callable[[Pattern], Var]


def replace_with(
    replacement: Program, bind: Mapping[str, Binding] | None = None
) -> Callable[[Pattern], None]:
    """Builds a ``transform_pattern`` that splices ``replacement`` in place of each match.

    Args:
        replacement: An ``mb.program`` computing, from its inputs, the match's outputs in
            ``pattern.output_vars()`` order.
        bind: Replacement input name to its source in the match: a pattern input name, an operand key
            ``"<op>.<slot>"`` (the slot as the pattern wrote it), a constant key from
            ``pattern.consts``, or a callable ``f(pattern) -> Var``. Inputs not listed are bound to the
            pattern input of the same name.

    Returns:
        The transform.

    Raises:
        PatternDefinitionError: The replacement is not a one-function program.
    """
    if not isinstance(replacement, Program) or list(replacement.functions) != ["main"]:
        raise PatternDefinitionError(
            f"replace_with() takes an @mb.program with one function 'main', got {type(replacement).__name__}."
        )
    func = replacement.functions["main"]
    input_names = list(func.inputs)
    bindings = dict(bind or {})
    unknown = set(bindings) - set(input_names)
    if unknown:
        raise PatternDefinitionError(
            f"replace_with(): bind names {sorted(unknown)}, which are not inputs of the replacement "
            f"(inputs: {input_names})."
        )
    ops = [op for op in func.operations if op.op_type != "const"]
    outputs = list(func.outputs)

    def transform(pattern: Pattern) -> None:
        targets = pattern.output_vars()
        if len(targets) != len(outputs):
            raise PatternDefinitionError(
                f"Replacement for pattern {pattern.pattern_name!r} returns {len(outputs)} values but "
                f"the match has {len(targets)} outputs."
            )
        env: dict[int, Any] = {
            id(func.inputs[name]): _resolve(pattern, name, bindings.get(name, name)) for name in input_names
        }
        anchor = pattern.final_ops[0]
        out_index = {id(v): i for i, v in enumerate(outputs)}
        for op in ops:
            kwargs = {slot: _value(env, value) for slot, value in op.inputs.items()}
            produced = [out_index[id(v)] for v in op.outputs if id(v) in out_index]
            base = targets[produced[0]].name if produced else f"{targets[0].name}_{op.name}"
            new = getattr(mb, op.op_type)(**kwargs, name=base, before_op=anchor)
            new_vars = list(new) if isinstance(new, (tuple, list)) else [new]
            for old, fresh in zip(op.outputs, new_vars):
                env[id(old)] = fresh
        pattern.replace_outputs([env[id(v)] for v in outputs])

    transform.__name__ = f"replace_with_{ops[-1].name if ops else 'nothing'}"
    return transform


def _resolve(pattern: Pattern, name: str, source: Binding) -> Var:
    if callable(source):
        return source(pattern)
    roots = pattern._compiled.root_names if pattern._compiled is not None else []
    if source in roots:
        return pattern.root_vars[roots.index(source)]
    if source in pattern.consts:
        return pattern.consts[source]
    if "." in source:
        op_name, slot = source.split(".", 1)
        return pattern.operand(op_name, slot)
    raise PatternDefinitionError(
        f"Replacement input {name!r} is bound to {source!r}, which is neither an input of pattern "
        f"{pattern.pattern_name!r} ({roots}), a constant ({sorted(pattern.consts)}) nor an operand "
        f"'<op>.<slot>'. Bind it with replace_with(..., bind={{{name!r}: ...}})."
    )


def _value(env: dict[int, Any], value: Any) -> Any:
    if isinstance(value, (tuple, list)):
        return tuple(_value(env, v) for v in value)
    if id(value) in env:
        return env[id(value)]
    if value.op is not None and value.op.op_type == "const":
        return value.val
    raise PatternDefinitionError(
        f"Replacement op input {value.name!r} is neither a replacement input, a constant nor the output "
        f"of an earlier replacement op."
    )
