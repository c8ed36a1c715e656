"""The ``Pattern`` a match hands to the user's callbacks: the design document's surface (``pattern.<name>``,
``root_var``, ``final_op``, ``block``, ``op_set``, ``op_list()``, ``add_attribute``) and its extensions."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import numpy as np
from coremltools.converters.mil import Builder as mb
from coremltools.converters.mil.mil import Block, Operation, Var, types

from .graph import CompiledPattern

__all__ = ["Order", "Pattern"]

Order = Callable[[list[Operation]], list[Operation]]
"""Sorts ops of one block into program order (``Pattern.op_list``)."""


class Pattern:
    """The ops, variables and block of one match.

    Attributes:
        root_var: The program variable at the pattern's (first) input.
        root_vars: The program variables at every pattern input, in the pattern's input order.
        final_op: The program op matched by the pattern's (first) last op.
        final_ops: The program ops matched by every op the pattern returns.
        block: The block holding the match.
        op_set: The captured program ops (a set, as in the design document; see ``op_list()``).
        consts: Pattern constant key (``"<op>.<slot>"`` or const op name) to the program variable there.
        choices: Choice name to the index of the alternative matched (read-only: see ``one_of``).
        pattern_name: Name of the pattern that matched.
    """

    if TYPE_CHECKING:  # for the type checker: __init__ fills the attributes above and pattern.<name> (Any)

        def __getattr__(self, name: str) -> Any: ...

    def __init__(
        self,
        compiled: CompiledPattern | None = None,
        block: Block | None = None,
        ops: dict[str, Any] | None = None,
        roots: list[Var] | None = None,
        operands: dict[str, dict[str, Any]] | None = None,
        consts: dict[str, Var] | None = None,
        order: Order | None = None,
        choices: dict[str, int] | None = None,
    ) -> None:
        """The match the search found (``Pattern()``: an empty one), owning its arguments (no copies)."""
        ops = {} if ops is None else ops
        roots = [] if roots is None else roots
        final_names = compiled.final_names if compiled is not None else ()
        if compiled is not None and not compiled.has_fanout:  # no op is a list
            finals, op_set = [ops[name] for name in final_names], set(ops.values())
        else:
            finals = [o for name in final_names for o in _flat(ops[name])]
            op_set = {o for op in ops.values() for o in _flat(op)}
        fields = self.__dict__
        fields.update(ops)  # pattern.<name>; compile_pattern refuses names Pattern uses
        fields.update(
            _compiled=compiled,
            _ops=ops,
            _operands={} if operands is None else operands,
            _order=order,
            _replacements=[],
            root_vars=roots,
            root_var=roots[0] if roots else None,
            block=block,
            consts={} if consts is None else consts,
            choices={} if choices is None else choices,
            pattern_name=compiled.name if compiled is not None else "",
            final_ops=finals,
            final_op=finals[0] if finals else None,
            op_set=op_set,
        )

    def add_attribute(self, attribute_name: str, attribute: Any) -> None:
        """Adds ``pattern.<attribute_name>`` for later callbacks (e.g. from constraints to transform).

        Raises:
            NameError: The name is a captured op or a reserved attribute of ``Pattern``.
        """
        if attribute_name in self._ops:
            raise NameError(
                f"Pattern attribute {attribute_name!r} would overwrite the captured op of that name in "
                f"pattern {self.pattern_name!r}; choose another name."
            )
        if attribute_name in RESERVED_NAMES or attribute_name.startswith("_"):
            raise NameError(
                f"Pattern attribute {attribute_name!r} is reserved by Pattern; choose another name."
            )
        object.__setattr__(self, attribute_name, attribute)

    def const_like(
        self, value: Any, like: Var, *, name: str | None = None, before_op: Operation | None = None
    ) -> Var:
        """An ``mb.const`` of ``value`` in ``like``'s dtype: float16 in a float16 program, float32 in a
        float32 one, so a transform written with Python floats fits both.

        Args:
            value: A number or an array.
            like: The variable whose dtype the constant takes.
            name: The const's name (default: coremltools').
            before_op: Where to insert it (default: before the first matched op).
        """
        val = np.asarray(value, dtype=types.nptype_from_builtin(like.dtype))
        kwargs = {} if name is None else {"name": name}
        return mb.const(
            val=val[()] if val.ndim == 0 else val, before_op=before_op or self.op_list()[0], **kwargs
        )

    def op_list(self) -> list[Operation]:
        """The captured ops, without duplicates, in program order."""
        ops = list(dict.fromkeys(o for op in self._ops.values() for o in _flat(op)))
        return self._order(ops) if self._order is not None else ops

    @property
    def ops(self) -> dict[str, Any]:
        """Pattern op name to captured op (a list for fan-out nodes: ``Any``, as ``pattern.<name>``)."""
        return dict(self._ops)

    def operand(self, op_name: str, slot: str) -> Any:
        """The program variable in the slot the *pattern* calls ``slot`` of op ``op_name``.

        For a commutative op matched with its operands swapped, ``pattern.mul.x`` is the program's
        ``x``; ``pattern.operand("mul", "x")`` is what the pattern wrote as ``x``.

        Raises:
            KeyError: ``op_name`` or ``slot`` is not in the pattern.
        """
        located = getattr(self.choices, "slots", {})  # a choice's operands: variants.Spelling
        try:
            if op_name in located:
                held, held_slot, pos = located[op_name][slot]
                value = self._operands[held][held_slot]
                return value if pos < 0 else value[pos]
            return self._operands[op_name][slot]
        except KeyError:
            known = {k: sorted(v) for k, v in {**self._operands, **located}.items()}
            raise KeyError(
                f"Pattern {self.pattern_name!r} has no operand {op_name}.{slot}; operands: {known}"
            ) from None

    def replace_output(self, new_var: Var, old_var: Var | None = None, *, force: bool = False) -> None:
        """Makes every user of a final output read ``new_var`` instead (visiting only those users); the
        framework removes the matched ops left without users once the transform returns.

        Args:
            new_var: The replacement, already inserted in the block (e.g. by ``mb.gelu(...,
                before_op=pattern.final_op)``).
            old_var: The output to replace; defaults to the only output of the only final op.
            force: Replace even where ``new_var`` drops a ``constexpr_*`` op ``old_var`` depends on
                (coremltools refuses that by default), for a transform rebuilding a compressed weight.

        Raises:
            ValueError: ``old_var`` is omitted but the match has several outputs.
        """
        if old_var is None:
            outputs = self.output_vars()
            if len(outputs) != 1:
                raise ValueError(
                    f"Pattern {self.pattern_name!r} has {len(outputs)} outputs; name the one to replace: "
                    f"replace_output(new_var, old_var=...)."
                )
            old_var = outputs[0]
        block = old_var.op.enclosing_block if old_var.op is not None else self.block
        try:
            block.replace_uses_of_var_after_op(
                anchor_op=old_var.op, old_var=old_var, new_var=new_var, force_replace=force
            )
        except ValueError as exc:
            if (new_var.dtype, new_var.shape) == (old_var.dtype, old_var.shape):
                raise
            new_type, old_type = (
                f"{tuple(v.shape)} {types.builtin_to_string(v.dtype)}" for v in (new_var, old_var)
            )
            raise ValueError(
                f"replace_output: {new_var.name} is {new_type}, but {old_var.name}, which it replaces, "
                f"is {old_type}; build a replacement of the same shape and dtype (mb.cast, mb.reshape), "
                f"or return False from the transform to leave the match."
            ) from exc
        self._replacements.append(new_var)

    def replacements(self) -> list[Var]:
        """The variables given to :meth:`replace_output` so far (part of the rewrite even with no user)."""
        return self._replacements

    def replace_outputs(self, new_vars: list[Var]) -> None:
        """``replace_output`` for every output of every final op, in ``output_vars()`` order."""
        outputs = self.output_vars()
        if len(new_vars) != len(outputs):
            raise ValueError(
                f"Pattern {self.pattern_name!r} has {len(outputs)} outputs but got {len(new_vars)} "
                f"replacements; give one per output_vars()."
            )
        for old, new in zip(outputs, new_vars):
            self.replace_output(new, old)

    def output_vars(self) -> list[Var]:
        """Every output variable of every final op, in order: what a replacement must provide."""
        return [v for op in self.final_ops for v in op.outputs]

    def __iter__(self) -> Iterator[Operation]:
        return iter(self.op_list())

    def __len__(self) -> int:
        return len(self.op_set)

    def __repr__(self) -> str:
        ops = ", ".join(
            f"{k}=[{', '.join(op.name for op in v)}]" if isinstance(v, list) else f"{k}={v.name}"
            for k, v in self._ops.items()
        )
        return f"Pattern({self.pattern_name!r}: {ops})"

    def _reverse_topological(self) -> list[Operation]:
        """The captured ops once each, consumers first: pattern op order reversed (else program order)."""
        if self._compiled is None:
            return list(reversed(self.op_list()))
        return list(dict.fromkeys(o for op in reversed(self._ops.values()) for o in _flat(op)))


def _flat(op: Operation | list[Operation]) -> list[Operation]:
    return op if isinstance(op, list) else [op]


RESERVED_NAMES: frozenset[str] = frozenset(
    name for name in {*vars(Pattern), *vars(Pattern())} if not name.startswith("_")
)
"""Names a pattern op may not take: public attributes of :class:`Pattern` (``pattern.<name>`` hides it)."""
