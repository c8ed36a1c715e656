"""The text of :func:`~pattern_infra.suggest`'s candidates: the pattern program (``source``) and
the module ``mil-patterns suggest --out`` writes (the pattern, a transform stub, its registration)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
from coremltools.converters.mil.mil import Operation, Program, Var

__all__ = ["candidate_module", "literal", "pattern_source"]


def _number(x: Any) -> str:
    if isinstance(x, float) and not np.isfinite(x):
        return f"float('{x}')"
    return repr(x)


def _nested_list(values: Any) -> str:
    if isinstance(values, list):
        return "[" + ", ".join(_nested_list(v) for v in values) + "]"
    return _number(values)


def literal(value: np.ndarray) -> str:
    """Python source for a constant, keeping its dtype."""
    if value.dtype.kind in "US":
        return repr(value.item()) if value.ndim == 0 else repr(value.tolist())
    if value.dtype == np.bool_:
        return repr(bool(value)) if value.ndim == 0 else f"np.array({value.tolist()!r}, dtype=np.bool_)"
    if value.ndim == 0:
        return f"np.{value.dtype.name}({_number(value.item())})"
    return f"np.array({_nested_list(value.tolist())}, dtype=np.{value.dtype.name})"


def _spec(var: Var) -> str:
    from coremltools.converters.mil.mil import types

    shape = ", ".join(str(d) if isinstance(d, (int, np.integer)) else "get_new_symbol()" for d in var.shape)
    shape = f"({shape},)" if len(var.shape) == 1 else f"({shape})"
    dtype = types.builtin_to_string(var.dtype)
    return f"mb.TensorSpec(shape={shape}, dtype=types.{dtype})"


def pattern_source(
    ops: Sequence[Operation],
    names: list[str],
    roots: list[Var],
    literal: dict[tuple[int, str, int], str],
    options: dict[str, Any],
    prog: Program,
) -> str:
    """The pattern program's text: ``pattern`` and ``OPTIONS``."""
    position = {id(op): k for k, op in enumerate(ops)}
    root_of = {id(v): k for k, v in enumerate(roots)}
    args = [f"x{k}" for k in range(len(roots))]

    def operand(v: Var, key: tuple[int, str, int]) -> str:
        if key in literal:
            return literal[key]
        if id(v) in root_of:
            return args[root_of[id(v)]]
        name = names[position[id(v.op)]]
        return name if len(v.op.outputs) == 1 else f"{name}[{v.op.outputs.index(v)}]"

    body = []
    for k, op in enumerate(ops):
        kwargs = []
        for slot in sorted(op.inputs):
            value = op.inputs[slot]
            if isinstance(value, (list, tuple)):
                text = "[" + ", ".join(operand(v, (k, slot, j)) for j, v in enumerate(value)) + "]"
            else:
                text = operand(value, (k, slot, 0))
            kwargs.append(f"{slot}={text}")
        call = f"mb.{op.op_type}({', '.join(kwargs)}, name={names[k]!r})"
        body.append(f"    return {call}" if k == len(ops) - 1 else f"    {names[k]} = {call}")
    opset = getattr(prog.functions["main"], "opset_version", None) if "main" in prog.functions else None
    opset_arg = f", opset_version=ct.target.{opset.name}" if opset is not None else ""
    specs = ", ".join(_spec(v) for v in roots)
    return "\n".join(
        [
            "import coremltools as ct",
            "import numpy as np",
            "from coremltools.converters.mil import Builder as mb",
            "from coremltools.converters.mil.mil import get_new_symbol, types",
            "",
            f"OPTIONS = {options!r}",
            "",
            "",
            f"@mb.program(input_specs=[{specs}]{opset_arg})",
            f"def pattern({', '.join(args)}):",
            *body,
            "",
        ]
    )


def candidate_module(candidate: Any, rank: int, model: str) -> str:
    """A module for ``--out``: the candidate's pattern, a transform stub to write and its registration;
    run as a script on a saved model, it prints the matches.

    Args:
        candidate: The :class:`~pattern_infra.inspecting.suggest.Candidate`.
        rank: Its place in the ranking.
        model: The name of the model it was found in (for the docstring).

    Returns:
        The module's text.
    """
    last = candidate.source.rsplit("name=", 1)[1].split(")")[0]
    pass_name = "fuse_" + "_".join(dict.fromkeys(candidate.op_types))
    header = (
        f'"""Candidate {rank} of mil-patterns suggest on {model}: {" -> ".join(candidate.op_types)}, '
        f"{candidate.count} occurrences, {candidate.saved} ops saved.\n\nFirst occurrence: "
        f'{", ".join(candidate.where[0])}.\n"""\n\n'
    )
    tail = f'''

def transform(pattern):
    """Builds the fused op in place of the match (to write)."""
    last = pattern.{last[1:-1]}
    raise NotImplementedError(
        "build the fused op with mb.<op>(..., name=last.outputs[0].name, before_op=last), "
        "then call pattern.replace_output(new_var)"
    )


def register():
    """Registers the pass (call it once ``transform`` is written)."""
    from pattern_infra import register_generic_pass

    return register_generic_pass(pattern, None, transform, {pass_name!r}, "mine", **OPTIONS)


if __name__ == "__main__":  # python this_file.py MODEL.mlpackage: the matches in a saved model
    import sys

    from pattern_infra import find_matches
    from pattern_infra.cli.mlpackage import load_mlpackage

    matches = list(find_matches(pattern, load_mlpackage(sys.argv[1]).program, **OPTIONS))
    print(len(matches), "match(es)")
    for match in matches:
        print("  " + ", ".join(op.name for op in match.op_list()))
'''
    return header + candidate.source + tail
