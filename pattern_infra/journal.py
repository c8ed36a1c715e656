"""Undo journal: puts a program back as it was before a pass, copying only what the pass changes.

A pass that fails must leave the program as it was. Copying every op and variable up front costs a
walk over the whole program (cold memory, about a microsecond per object) for every pass that rewrites
anything. The journal copies *on write* instead, at the level of MIL objects:

1. When it opens, it saves what is small and shared: every block's fields and op list (a list of
   references), and it starts observing the MIL API on the thread that opened it.
2. The first change to an existing variable or op saves that object's state (a shallow copy of its
   fields, with its consumer list, input map and output bookkeeping copied one level deep). The object
   is hot in the cache at that moment: the transform is about to touch it anyway.
3. ``restore()`` writes every saved state back, then the blocks' fields and op lists. Objects created
   during the pass are never saved (the first hooked call in their constructor finds an op without
   outputs, or a variable with unset slots) and stay as they are: once the blocks and the objects the pass touched
   are back, nothing in the program reaches them.

Which changes are seen. coremltools 9.0's MIL changes existing objects only through these methods,
and the journal hooks each one (class-level, while a journal is open):

* ``Var.add_child_op`` / ``remove_child_op`` / ``set_name``, and the setters of
  ``Var.nonreplaceable_vars_upstream`` and ``Var.scopes`` (the latter writes its producer op);
* ``Operation._validate_and_set_inputs`` (an op's input map and its input attributes, from
  ``set_inputs``) and ``Operation.type_value_inference`` (re-inferred output types and values);
* ``Block.set_outputs`` / ``Block.replace_block_output_var`` (``consuming_blocks`` of the variables
  involved, and an output's name) and ``Block.remove_ops`` (``enclosing_block`` of the removed ops).

Plain attribute assignments are not hooked (the builder makes dozens per new op; hooking them costs more
than it saves), so a transform that writes ``op.name = ...`` or ``op._input_vars[...] = v`` by hand on
an op the journal never saw is not undone. The driver therefore also saves every op and variable of a
match, and the users of its outputs, before calling the transform (:meth:`Journal.keep_match`): that
covers what a transform reaches without searching the program.

Hooks only record for the thread that opened the journal; other threads run coremltools unchanged
(apart from one dictionary lookup per hooked call).
"""

from __future__ import annotations

import functools
import operator
import threading
from collections.abc import Callable, Iterable
from typing import Any

from coremltools.converters.mil.mil import Block, Operation, Var
from coremltools.converters.mil.mil.utils import CacheDoublyLinkedList

__all__ = ["Journal"]

_get_ident = threading.get_ident
_object_setattr = object.__setattr__

_ACTIVE: dict[int, list[Journal]] = {}
"""Thread id to the journals open on it, innermost last."""
_LOCK = threading.Lock()
_originals: dict[tuple[type, str], Any] = {}
"""(class, attribute) to what the class itself defined there before the hooks (``_ABSENT`` if
nothing): put back when the last journal closes."""
_ABSENT = object()

_VAR_SLOTS: tuple[str, ...] = tuple(
    name for name in Var.__slots__ if name not in ("_child_ops", "consuming_blocks", "_nonreplaceable_vars_upstream")
)
_var_slots = operator.attrgetter(*_VAR_SLOTS)
_CONTAINERS = (list, dict, set)


class Journal:
    """Saved states of the blocks, ops and variables a pass touched; see the module docstring.

    Use as a context manager around the pass (or call :meth:`close`); :meth:`restore` before closing
    puts the program back.
    """

    def __init__(self, blocks: Iterable[Block]) -> None:
        self.thread = _get_ident()
        self.saved: set[int] = set()
        """Ids of the objects whose state is saved (or that were created after the journal opened)."""
        self.ops: list[tuple[Operation, dict[str, Any], dict[str, Any]]] = []
        self.vars: list[tuple[Var, tuple[Any, ...], list[Any], list[Any], set[Any]]] = []
        self.others: list[tuple[Any, dict[str, Any]]] = []
        self.blocks: list[tuple[Block, list[Operation], dict[str, Any]]] = [
            (block, list(block.operations), _fields(block, skip=("operations",))) for block in blocks
        ]
        self.closed = False
        _open(self)

    # -- saving ---------------------------------------------------------------------------------------

    def keep_op(self, op: Operation) -> None:
        """Saves ``op``'s state, unless it is saved already."""
        if id(op) in self.saved:
            return
        self.saved.add(id(op))
        fields = op.__dict__
        inputs = fields.get("_input_vars")
        if type(inputs) is not dict or fields.get("_output_vars") is None:
            return  # an op under construction: created after the journal opened, nothing to restore
        self.ops.append((op, fields.copy(), inputs.copy()))

    def keep_var(self, var: Any) -> None:
        """Saves a variable's state, unless it is saved already (or is still being constructed)."""
        if id(var) in self.saved:
            return
        self.saved.add(id(var))
        if type(var) is not Var:
            self.others.append((var, _fields(var)))
            return
        try:
            self.vars.append(
                (
                    var,
                    _var_slots(var),
                    var._child_ops.copy(),
                    var.consuming_blocks.copy(),
                    var._nonreplaceable_vars_upstream.copy(),
                )
            )
        except AttributeError:
            pass  # a variable under construction: created after the journal opened

    def keep_match(self, ops: Iterable[Operation], users: Iterable[Operation]) -> None:
        """Saves the ops of a match, the variables they read and write, and the users of its outputs."""
        keep_op, keep_var = self.keep_op, self.keep_var
        for op in ops:
            keep_op(op)
            for value in op._input_vars.values():
                if isinstance(value, (list, tuple)):
                    for var in value:
                        keep_var(var)
                elif value is not None:
                    keep_var(value)
            for var in op._output_vars or ():
                keep_var(var)
        for op in users:
            keep_op(op)

    # -- restoring ------------------------------------------------------------------------------------

    def restore(self) -> None:
        """Puts every saved op, variable and block back as it was when the journal opened."""
        for op, state, inputs in self.ops:
            fields = op.__dict__
            fields.clear()
            fields.update(state)
            fields["_input_vars"] = inputs.copy()
        for var, values, child_ops, consuming_blocks, upstream in self.vars:
            for name, value in zip(_VAR_SLOTS, values):
                _object_setattr(var, name, value)
            _object_setattr(var, "_child_ops", child_ops.copy())
            _object_setattr(var, "consuming_blocks", consuming_blocks.copy())
            _object_setattr(var, "_nonreplaceable_vars_upstream", upstream.copy())
        for obj, saved in self.others:
            _set_fields(obj, saved)
        for block, ops, saved in self.blocks:
            _set_fields(block, saved)
            block.operations = CacheDoublyLinkedList(ops)

    def close(self) -> None:
        """Stops recording; the hooks go away with the last open journal."""
        if not self.closed:
            self.closed = True
            _close(self)

    def __enter__(self) -> Journal:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# -- the hooks ----------------------------------------------------------------------------------------


def _for_journals(keep: Callable[[Journal, Any], None]) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Hook factory: before the method runs, ``keep(journal, receiver)`` for each journal open on
    this thread."""

    def make(method: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(method)
        def hooked(self: Any, *args: Any, **kwargs: Any) -> Any:
            journals = _ACTIVE.get(_get_ident())
            if journals:
                for journal in journals:
                    keep(journal, self, *args, **kwargs)
            return method(self, *args, **kwargs)

        return hooked

    return make


def _setter_for_journals(keep: Callable[[Journal, Any], None]) -> Callable[[property], property]:
    """Hook factory for a property: its setter first keeps the receiver."""

    def make(prop: property) -> property:
        setter = prop.fset

        def hooked(self: Any, value: Any) -> None:
            journals = _ACTIVE.get(_get_ident())
            if journals:
                for journal in journals:
                    keep(journal, self)
            setter(self, value)  # type: ignore[misc]

        return property(prop.fget, hooked, prop.fdel, prop.__doc__)

    return make


def _keep_var(journal: Journal, var: Var, *_: Any, **__: Any) -> None:
    journal.keep_var(var)


def _keep_op(journal: Journal, op: Operation, *_: Any, **__: Any) -> None:
    journal.keep_op(op)


def _keep_op_and_outputs(journal: Journal, op: Operation, *_: Any, **__: Any) -> None:
    journal.keep_op(op)
    for var in op.__dict__.get("_output_vars") or ():
        journal.keep_var(var)


def _keep_producer(journal: Journal, var: Var, *_: Any, **__: Any) -> None:
    if var.op is not None:
        journal.keep_op(var.op)


def _keep_output_relations(journal: Journal, block: Block, *args: Any, **kwargs: Any) -> None:
    """``set_outputs`` / ``replace_block_output_var`` change ``consuming_blocks`` of the block's
    outputs and of the variables they are given, in place."""
    involved: list[Any] = list(block._outputs)
    for value in list(args) + list(kwargs.values()):
        involved.extend(value if isinstance(value, (list, tuple)) else [value])
    for var in involved:
        if isinstance(var, Var):
            journal.keep_var(var)


def _keep_removed_ops(journal: Journal, block: Block, *args: Any, **kwargs: Any) -> None:
    for op in list(args[0] if args else kwargs.get("ops_to_remove", ())):
        journal.keep_op(op)


_HOOKS: list[tuple[type, str, Callable[[Any], Any]]] = [
    (Var, "add_child_op", _for_journals(_keep_var)),
    (Var, "remove_child_op", _for_journals(_keep_var)),
    (Var, "set_name", _for_journals(_keep_var)),
    (Var, "nonreplaceable_vars_upstream", _setter_for_journals(_keep_var)),
    (Var, "scopes", _setter_for_journals(_keep_producer)),
    (Operation, "_validate_and_set_inputs", _for_journals(_keep_op)),
    (Operation, "type_value_inference", _for_journals(_keep_op_and_outputs)),
    (Block, "set_outputs", _for_journals(_keep_output_relations)),
    (Block, "replace_block_output_var", _for_journals(_keep_output_relations)),
    (Block, "remove_ops", _for_journals(_keep_removed_ops)),
]
"""(class, attribute, hook factory taking the attribute as the class resolves it): every way
coremltools 9.0's MIL changes an existing variable, op or output relation (see the module docstring)."""


def _open(journal: Journal) -> None:
    with _LOCK:
        if not _ACTIVE:
            for cls, name, make in _HOOKS:
                _originals[(cls, name)] = cls.__dict__.get(name, _ABSENT)
                setattr(cls, name, make(_resolve(cls, name)))
        _ACTIVE.setdefault(journal.thread, []).append(journal)


def _resolve(cls: type, name: str) -> Any:
    """``cls``'s attribute ``name`` as stored (a property stays a property, not its value)."""
    for klass in cls.__mro__:
        if name in klass.__dict__:
            return klass.__dict__[name]
    raise AttributeError(f"{cls.__name__} has no attribute {name!r}")


def _close(journal: Journal) -> None:
    with _LOCK:
        stack = _ACTIVE.get(journal.thread, [])
        if journal in stack:
            stack.remove(journal)
        if not stack:
            _ACTIVE.pop(journal.thread, None)
        if not _ACTIVE:
            for cls, name, _ in _HOOKS:
                original = _originals.pop((cls, name), _ABSENT)
                if original is _ABSENT:
                    delattr(cls, name)
                else:
                    setattr(cls, name, original)


# -- generic field copies (blocks and unusual variable kinds) ----------------------------------------


@functools.cache
def _slot_names(cls: type) -> tuple[str, ...]:
    names: list[str] = []
    for klass in cls.__mro__:
        slots = klass.__dict__.get("__slots__", ())
        names.extend([slots] if isinstance(slots, str) else slots)
    return tuple(n for n in names if n != "__dict__")


_MISSING = object()


def _fields(obj: Any, skip: tuple[str, ...] = ()) -> dict[str, Any]:
    """Every attribute of ``obj`` (dict and slots), containers copied one level deep."""
    saved: dict[str, Any] = {}
    state = getattr(obj, "__dict__", None)
    if state is not None:
        for key, value in state.items():
            saved[key] = value.copy() if isinstance(value, _CONTAINERS) else value
    for key in _slot_names(type(obj)):
        value = getattr(obj, key, _MISSING)
        if value is not _MISSING:
            saved[key] = value.copy() if isinstance(value, _CONTAINERS) else value
    for key in skip:
        saved.pop(key, None)
    return saved


def _set_fields(obj: Any, saved: dict[str, Any]) -> None:
    if hasattr(obj, "__dict__"):
        for key in [k for k in vars(obj) if k not in saved and k != "operations"]:
            del vars(obj)[key]
    for key, value in saved.items():
        _object_setattr(obj, key, value.copy() if isinstance(value, _CONTAINERS) else value)
