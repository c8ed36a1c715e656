"""A trace of every rewrite: which pass and pattern, in which block, the ops matched and what replaced them.

``with trace() as rewrites:`` records, for each rewrite the driver makes while the block runs (inside a
``coremltools.convert`` too), one :class:`Rewrite`. Each is plain data (names and op types, no MIL
object), JSON-serialisable with :meth:`Rewrite.to_dict`; :mod:`pattern_infra.inspecting.report` draws them::

    with pattern_infra.trace() as rewrites:
        mlmodel = ct.convert(exported_program, convert_to="mlprogram")
    json.dumps([r.to_dict() for r in rewrites])

Nothing is recorded, and nothing is paid beyond one test per rewrite, when no trace is open: the driver
calls its ``rewrite_listeners``, to which an open trace adds :func:`record`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np
from coremltools.converters.mil.mil import Block, Operation

from ..rewriting import driver

__all__ = ["OpRecord", "Rewrite", "Trace", "record", "recording", "trace"]

recording = False
"""Whether a trace is open: the driver calls :func:`record` after each rewrite only then."""

_open: list[Trace] = []


@dataclass
class OpRecord:
    """One op, as plain data: enough to draw it and its edges."""

    name: str
    """The op's name."""
    type: str
    """Its op type."""
    inputs: list[str]
    """The variables it reads, in slot order (names; a constant is shown by its value, see ``consts``)."""
    outputs: list[str]
    """The variables it produces."""
    consts: dict[str, str] = field(default_factory=dict)
    """Variable name to a short text of its value, for the inputs that are constants."""


@dataclass
class Rewrite:
    """One rewrite made by a generic pass."""

    pass_id: str
    """The pass (``namespace::name``) or, outside a registered pass, the caller's label."""
    pattern: str
    """The sub-pass's pattern name."""
    function: str
    """The function of the program holding the block."""
    block: str
    """The block's name (``block0`` for a function's body)."""
    matched: list[str]
    """Names of the matched ops, in the pattern's order."""
    replaced_by: list[str]
    """Names of the non-const ops the transform created (empty when it only redirected outputs)."""
    removed: list[str]
    """Names of the ops taken out of the block: the matched ops left dead, and any the transform removed."""
    before: list[OpRecord]
    """The matched ops."""
    after: list[OpRecord]
    """The non-const ops created and the matched ops that stayed (constants appear as input values)."""

    def to_dict(self) -> dict[str, Any]:
        """The rewrite as JSON-serialisable data."""
        return asdict(self)


class Trace(list):
    """The rewrites recorded while a :func:`trace` block ran, in the order they were made."""

    def to_dicts(self) -> list[dict[str, Any]]:
        """Every rewrite as JSON-serialisable data."""
        return [rewrite.to_dict() for rewrite in self]


@contextlib.contextmanager
def trace() -> Iterator[Trace]:
    """Records every rewrite of every generic pass run inside the ``with`` block.

    Traces nest: each open trace receives every rewrite made while it is open.

    Yields:
        A :class:`Trace`, a list of :class:`Rewrite` filled as rewrites happen.
    """
    global recording
    rewrites = Trace()
    _open.append(rewrites)
    if not recording:
        driver.rewrite_listeners.append(_record)
    recording = True
    try:
        yield rewrites
    finally:
        _open[:] = [t for t in _open if t is not rewrites]  # by identity: two traces may hold equal lists
        recording = bool(_open)
        if not recording:
            driver.rewrite_listeners.remove(_record)


def _record(*args: Any) -> None:
    record(*args)  # looked up at each call: a test may replace it


def record(
    prog: Any,
    pass_id: str,
    pattern: str,
    block: Block,
    matched: list[Operation],
    created: list[Operation],
    removed: list[Operation],
) -> None:
    """Adds one rewrite to every open trace (called by the driver right after a rewrite).

    Args:
        prog: The program rewritten.
        pass_id: The pass's id (or label).
        pattern: The pattern's name.
        block: The block rewritten.
        matched: The matched ops, in the pattern's order.
        created: The ops the transform inserted into the block.
        removed: The ops taken out of the block by the rewrite.
    """
    gone = {id(op) for op in removed}
    created = [op for op in created if op.enclosing_block is not None]
    kept = [op for op in matched if id(op) not in gone]
    entry = Rewrite(
        pass_id=pass_id,
        pattern=pattern,
        function=_function_name(prog, block),
        block=block.name,
        matched=[op.name for op in matched],
        replaced_by=[op.name for op in created if op.op_type != "const"],
        removed=[op.name for op in removed],
        before=[_op_record(op) for op in matched],
        after=[_op_record(op) for op in created + kept if op.op_type != "const"],
    )
    for rewrites in _open:
        rewrites.append(entry)


def _function_name(prog: Any, block: Block) -> str:
    while block.outer_op is not None and block.outer_op.enclosing_block is not None:
        block = block.outer_op.enclosing_block
    for name, function in getattr(prog, "functions", {}).items():  # a Function does not know its name
        if function is block:
            return name
    return ""


def _op_record(op: Operation) -> OpRecord:
    inputs: list[str] = []
    consts: dict[str, str] = {}
    for value in op._input_vars.values():
        for var in value if isinstance(value, (list, tuple)) else [value]:
            if var is None:
                continue
            inputs.append(var.name)
            if var.op is not None and var.op.op_type == "const":
                consts[var.name] = _short(var.val)
    return OpRecord(op.name, op.op_type, inputs, [v.name for v in op.outputs], consts)


def _short(value: Any) -> str:
    """A constant's value in a few characters: the number, or the shape of a tensor."""
    array = np.asarray(value)
    if array.size == 1:
        item = array.reshape(()).item()
        return f"{item:.4g}" if isinstance(item, float) else str(item)
    return f"{array.dtype}{list(array.shape)}"
