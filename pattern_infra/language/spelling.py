"""``pattern.choices`` of a match of a pattern with choices: one :class:`Spelling` per spelling, shared
by its matches.

A choice (:func:`~pattern_infra.language.choices.one_of`, or an op with ``equivalences=``) binds the op that
computes its variable, and its slots are the outside variables its alternatives read. Which operand of
which op holds each slot depends only on which alternatives matched (the *spelling*), never on the
program: the :class:`Spelling` records it (:attr:`Spelling.slots`), and ``pattern.operand(<choice>,
<slot>)`` reads the operand it names.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, NoReturn

from .graph import CompiledPattern, PatternNode

__all__ = ["Spelling", "spelling_of"]


class Spelling(dict):  # type: ignore[type-arg]
    """``pattern.choices``: choice name (nested ones included) to the index of the alternative that
    matched. Shared by every match of one spelling, so it cannot be changed (copy it with
    ``dict(pattern.choices)``)."""

    slots: dict[str, dict[str, tuple[str, str, int]]]
    """Per choice: its slot to the operand holding that variable in a match of this spelling (op name,
    the op's slot, position in a tuple slot or -1), for ``Pattern.operand``."""

    def _refuse(self, *args: Any, **kwargs: Any) -> NoReturn:
        raise TypeError("pattern.choices is shared by every match of the same spelling and cannot be "
                        "changed; copy it first: dict(pattern.choices)")

    __setitem__ = __delitem__ = clear = pop = popitem = setdefault = update = __ior__ = _refuse  # type: ignore[assignment]

    def __reduce__(self) -> tuple[Any, ...]:  # copy, deepcopy and pickle: a Spelling again
        return _restored, (dict(self), self.slots)


def _restored(chosen: dict[str, int], slots: dict[str, dict[str, tuple[str, str, int]]]) -> Spelling:
    spelling = Spelling(chosen)
    spelling.slots = slots
    return spelling


def spelling_of(compiled: CompiledPattern, chosen: Mapping[str, int]) -> Spelling:
    """The :class:`Spelling` of ``compiled`` whose choices took the alternatives ``chosen``, built once.

    Raises:
        KeyError: ``chosen`` names no alternative of a choice of the spelling.
    """
    key = frozenset(chosen.items())
    found = compiled.spellings.get(key)
    if found is None:
        found = compiled.spellings[key] = _build(compiled, chosen)
    return found


def _build(compiled: CompiledPattern, chosen: Mapping[str, int]) -> Spelling:
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
        """The operand holding ``slot`` of ``node``: its own, or through a nested choice the one holding that."""
        return held(*readers[node.name][slot]) if node.choice is not None else (node.name, slot, pos)

    walk(compiled)
    return _restored(dict(chosen), {choice: {slot: held(*reader) for slot, reader in slots.items()}
                                    for choice, slots in readers.items()})
