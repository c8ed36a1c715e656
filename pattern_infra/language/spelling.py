"""``pattern.choices``: one :class:`Spelling` per spelling of a pattern, shared by its matches.

Which operand of which op holds each slot of a choice (an outside variable its alternatives read)
depends only on the alternatives that matched, never on the program: :attr:`Spelling.slots` records it
for ``pattern.operand(<choice>, <slot>)``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, NoReturn

from .graph import CompiledPattern, PatternNode

__all__ = ["Spelling", "spelling_of"]


class Spelling(dict):  # type: ignore[type-arg]
    """Choice name (nested ones included) to the index of the alternative that matched; shared by every
    match of one spelling, so read-only (copy it with ``dict(pattern.choices)``)."""

    slots: dict[str, dict[str, tuple[str, str, int]]]
    """Per choice: slot to the operand holding it (op name, the op's slot, position in a tuple slot or -1)."""

    def _refuse(self, *args: Any, **kwargs: Any) -> NoReturn:
        raise TypeError("pattern.choices is shared by every match of the same spelling and cannot be "
                        "changed; copy it first: dict(pattern.choices)")

    __setitem__ = __delitem__ = clear = pop = popitem = setdefault = update = __ior__ = _refuse  # type: ignore

    def __reduce__(self) -> tuple[Any, ...]:  # copy, deepcopy and pickle: a Spelling again
        return _restored, (dict(self), self.slots)


def _restored(chosen: dict[str, int], slots: dict[str, dict[str, tuple[str, str, int]]]) -> Spelling:
    spelling = Spelling(chosen)
    spelling.slots = slots
    return spelling


def spelling_of(compiled: CompiledPattern, chosen: Mapping[str, int]) -> Spelling:
    """The :class:`Spelling` of ``compiled`` whose choices took the alternatives ``chosen``.

    Raises:
        KeyError: ``chosen`` names no alternative of a choice of the spelling.
    """
    readers: dict[str, dict[str, tuple[PatternNode, str, int]]] = {}  # choice -> slot -> the op reading it

    def walk(level: CompiledPattern) -> None:
        for node in level.nodes:
            if node.choice is not None:
                alternative = node.choice.alternatives[chosen[node.name]]
                inner = alternative.compiled
                readers[node.name] = {slot: (inner.nodes[m], op_slot, pos)
                                      for root, slot in enumerate(alternative.slots)
                                      for m, op_slot, pos in inner.root_consumers[root][:1]}
                walk(inner)

    def held(node: PatternNode, slot: str, pos: int) -> tuple[str, str, int]:
        # its own operand, or through a nested choice the one holding it
        return held(*readers[node.name][slot]) if node.choice is not None else (node.name, slot, pos)

    walk(compiled)
    return _restored(dict(chosen), {choice: {slot: held(*reader) for slot, reader in slots.items()}
                                    for choice, slots in readers.items()})
