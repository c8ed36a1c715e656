"""Undo journal: puts a program back as it was before a pass, copying only what the pass changes.

On opening, it saves every block's fields and op list and starts observing, on its thread, the methods
by which coremltools 9.0's MIL changes an existing variable, op or output relation (:data:`_HOOKS`).
The first change to an existing variable or op saves that object's state (containers copied one level
deep); a variable gaining or losing a user saves only its user list. Objects created during the pass are
never saved: once the touched objects are back, nothing in the program reaches them.

Not hooked: ``Block.__exit__``, which recomputes ``nonreplaceable_vars_upstream`` (the driver calls
:meth:`Journal.keep_block` before leaving a nested block, and closes the journal before leaving a
function's block); plain attribute assignments (the builder makes dozens per new op), so a transform's
writes by hand are not undone, except renames (:meth:`Journal.keep_match`); the driver's removal of dead
ops, which records itself (:meth:`Journal.unlinked`). The hooks never read an op's ``__dict__`` unless
they save it: CPython keeps attributes inline until it is asked for, and reads stay slower after.
"""
from __future__ import annotations

import functools
import inspect
import operator
import threading
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from coremltools.converters.mil.mil import Block, Operation, Var
from coremltools.converters.mil.mil.utils import CacheDoublyLinkedList
from coremltools.converters.mil.mil.var import InternalVar

__all__ = ["Journal", "journals_on_this_thread"]

_get_ident = threading.get_ident
_object_setattr = object.__setattr__

_ACTIVE: dict[int, list[Journal]] = {}  # thread id to the journals open on it, innermost last
_LOCK = threading.Lock()
_originals: dict[tuple[type, str], Any] = {}
"""(class, attribute) to what the class itself defined there before the hooks (``_ABSENT``: nothing)."""
_ABSENT = object()

_VAR_SLOTS: tuple[str, ...] = tuple(
    n for n in Var.__slots__ if n not in ("_child_ops", "consuming_blocks", "_nonreplaceable_vars_upstream"))
_var_slots = operator.attrgetter(*_VAR_SLOTS)
_CONTAINERS = (list, dict, set)


def journals_on_this_thread() -> list[Journal]:
    """The journals open on this thread, innermost last: each must record a change made without the
    hooked methods (see :meth:`Journal.unlinked`)."""
    return _ACTIVE.get(_get_ident()) or []


class Journal:
    """Saved states of the blocks, ops and variables a pass touched (see the module docstring).

    :meth:`restore` before :meth:`close` puts the program back."""

    def __init__(self, blocks: Iterable[Block], op_lists: Mapping[int, list[Operation]] | None = None) -> None:
        """``op_lists``: block id to the block's ops in program order, where the caller has them (kept,
        not copied: they must not change afterwards)."""
        self.thread = _get_ident()
        self.saved: set[Any] = set()  # objects saved, or created since it opened (they hash by identity)
        self.users_saved: set[Var] = set()  # variables whose user list alone is saved (in users)
        # Flat lists, no tuple per entry: (variable, user list); (op, fields, input map);
        # (op unlinked before anything saved it, its block); (match op or variable, its name).
        self.users: list[Any] = []
        self.ops: list[Any] = []
        self.vars: list[tuple[Var, tuple[Any, ...], list[Any], list[Any] | None, set[Any] | None]] = []
        self.others: list[tuple[Any, dict[str, Any]]] = []
        self.enclosing: list[Any] = []
        self.names: list[Any] = []
        listed = op_lists or {}
        self.blocks: list[tuple[Block, list[Operation], dict[str, Any]]] = [
            (block, listed.get(id(block)) or list(block.operations), _fields(block, skip=("operations",)))
            for block in blocks]
        self.closed = False
        _open(self)

    def keep_op(self, op: Operation) -> None:
        """Saves ``op``'s state, unless it is saved already."""
        saved = self.saved
        if op in saved:
            return
        saved.add(op)
        if getattr(op, "_output_vars", None) is None:
            return  # an op under construction: created after the journal opened, nothing to restore
        fields = op.__dict__
        inputs = fields.get("_input_vars")
        if type(inputs) is dict:
            self.ops += (op, fields.copy(), inputs.copy())

    def keep_var(self, var: Any) -> None:
        """Saves a variable's state, unless it is saved already (or is still being constructed)."""
        if var in self.saved:
            return
        self.saved.add(var)
        if type(var) is not Var:
            if type(var) is InternalVar and not var._child_ops:
                return  # a constant's value the builder just made (or one nothing reads): unreachable
            self.others.append((var, _fields(var)))
            return
        try:  # its slots, and copies of its users, output relations and upstream set (None: empty)
            blocks, upstream = var.consuming_blocks, var._nonreplaceable_vars_upstream
            self.vars.append((var, _var_slots(var), var._child_ops.copy(), blocks.copy() if blocks else None,
                              upstream.copy() if upstream else None))
        except AttributeError:
            pass  # a variable under construction: created after the journal opened

    def keep_users(self, var: Var) -> None:
        """Saves a variable's user list, unless the variable or its user list is saved already."""
        if var in self.saved or var in self.users_saved:
            return
        if type(var) is not Var:
            self.keep_var(var)
            return
        self.users_saved.add(var)
        self.users += (var, var._child_ops.copy())

    def keep_block(self, block: Block) -> None:
        """Saves every variable of ``block`` and its nested blocks, which ``Block.__exit__`` rewrites."""
        for var in _block_vars(block):
            self.keep_var(var)

    def keep_match(self, ops: Iterable[Operation]) -> None:
        """Saves the names of a match's ops and of their outputs, which transforms may write by hand
        (``op.name = ...``); every other change to them goes through the hooks."""
        saved, names = self.saved, self.names
        for op in ops:
            if op not in saved:
                names += (op, op.name)
            for var in op._output_vars or ():
                if var not in saved:
                    names += (var, var.name)

    def unlinked(self, block: Block, removal: list[tuple[Operation, list[Var]]]) -> None:
        """Records that the driver is about to take each op of ``removal`` out of ``block`` without the
        hooked methods (``enclosing_block`` set to None, the op taken off its inputs' user lists)."""
        saved, enclosing, keep_users = self.saved, self.enclosing, self.keep_users
        for op, inputs in removal:
            if op not in saved:
                enclosing += (op, block)
            for var in inputs:
                keep_users(var)

    def restore(self) -> None:
        """Puts every saved op, variable and block back as it was when the journal opened."""
        ops = self.ops
        for op, state, inputs in zip(ops[0::3], ops[1::3], ops[2::3]):
            fields = op.__dict__
            fields.clear()
            fields.update(state)
            fields["_input_vars"] = inputs.copy()
        for var, values, child_ops, consuming_blocks, upstream in self.vars:
            for name, value in zip(_VAR_SLOTS, values):
                _object_setattr(var, name, value)
            _object_setattr(var, "_child_ops", child_ops.copy())
            _object_setattr(var, "consuming_blocks", consuming_blocks.copy() if consuming_blocks else [])
            _object_setattr(var, "_nonreplaceable_vars_upstream", upstream.copy() if upstream else set())
        for obj, saved in self.others:
            _set_fields(obj, saved)
        # Recorded only for objects not saved whole at the time, so older: applied after those.
        for op, block in zip(self.enclosing[0::2], self.enclosing[1::2]):
            op.enclosing_block = block
        for obj, name in zip(self.names[0::2], self.names[1::2]):
            _object_setattr(obj, "name", name)
        for var, users in zip(self.users[0::2], self.users[1::2]):
            _object_setattr(var, "_child_ops", users.copy())
        for block, ops, saved in self.blocks:
            _set_fields(block, saved)
            block.operations = CacheDoublyLinkedList(ops)

    def close(self) -> None:
        """Stops recording; the hooks go away with the last open journal."""
        if not self.closed:
            self.closed = True
            _close(self)


# Each hook has the hooked method's exact signature (``*args`` would cost more than the hook): some run
# dozens of times per rewrite, so the three hottest (a user list, an op's inputs) write _keep's loop out.


def _keep(obj: Any, keep: Callable[[Journal, Any], None]) -> None:
    """``keep(journal, obj)`` for each journal open on this thread that has not saved ``obj``."""
    for journal in _ACTIVE.get(_get_ident(), ()):
        if obj not in journal.saved:
            keep(journal, obj)


def _hook_add_child_op(original: Callable[..., Any]) -> Callable[..., Any]:
    def add_child_op(self: Var, new_op: Operation) -> Any:
        for journal in _ACTIVE.get(_get_ident(), ()):
            if self not in journal.saved:
                journal.keep_users(self)
        return original(self, new_op)
    return add_child_op


def _hook_remove_child_op(original: Callable[..., Any]) -> Callable[..., Any]:
    def remove_child_op(self: Var, target_op: Operation, no_check: bool = False) -> Any:
        for journal in _ACTIVE.get(_get_ident(), ()):
            if self not in journal.saved:
                journal.keep_users(self)
        return original(self, target_op, no_check)
    return remove_child_op


def _hook_set_name(original: Callable[..., Any]) -> Callable[..., Any]:
    def set_name(self: Var, name: str) -> Any:
        _keep(self, Journal.keep_var)
        return original(self, name)
    return set_name


def _hook_scopes(prop: property) -> property:
    """``var.scopes = ...`` writes the scopes of the variable's producer op."""
    setter = prop.fset

    def set_scopes(self: Var, scopes: Any) -> None:
        if _ACTIVE and self.op is not None:
            _keep(self.op, Journal.keep_op)
        setter(self, scopes)  # type: ignore[misc]
    return property(prop.fget, set_scopes, prop.fdel, prop.__doc__)


def _hook_set_inputs(original: Callable[..., Any]) -> Callable[..., Any]:
    def _validate_and_set_inputs(self: Operation, input_kvs: Any, no_check_var_types: bool = False) -> Any:
        for journal in _ACTIVE.get(_get_ident(), ()):
            if self not in journal.saved:
                journal.keep_op(self)
        return original(self, input_kvs, no_check_var_types)
    return _validate_and_set_inputs


def _hook_type_value_inference(original: Callable[..., Any]) -> Callable[..., Any]:
    """Re-inference rewrites the op's output variables (types, values, upstream sets)."""

    def type_value_inference(self: Operation, overwrite_output: bool = False) -> Any:
        outputs = getattr(self, "_output_vars", None)
        if outputs is None:  # a new op creating its outputs: new variables, nothing to restore
            result = original(self, overwrite_output)
            for journal in _ACTIVE.get(_get_ident(), ()):
                journal.saved.update(self._output_vars)
            return result
        _keep(self, Journal.keep_op)
        for var in outputs:
            _keep(var, Journal.keep_var)
        return original(self, overwrite_output)
    return type_value_inference


def _hook_set_outputs(original: Callable[..., Any]) -> Callable[..., Any]:
    """Changes ``consuming_blocks`` of the old and the new outputs in place."""

    def set_outputs(self: Block, outputs: Any) -> Any:
        for var in [*self._outputs, *outputs]:
            if isinstance(var, Var):
                _keep(var, Journal.keep_var)
        return original(self, outputs)
    return set_outputs


def _hook_replace_block_output_var(original: Callable[..., Any]) -> Callable[..., Any]:
    """Changes ``consuming_blocks`` (and an output's name) of both variables, when ``old_var`` is an output."""

    def replace_block_output_var(self: Block, old_var: Var, new_var: Var) -> Any:
        if old_var in self._outputs:
            _keep(old_var, Journal.keep_var)
            _keep(new_var, Journal.keep_var)
        return original(self, old_var, new_var)
    return replace_block_output_var


def _hook_remove_ops(original: Callable[..., Any]) -> Callable[..., Any]:
    """Sets ``enclosing_block`` of every removed op to None."""

    def remove_ops(self: Block, ops_to_remove: Any) -> Any:
        for op in ops_to_remove:
            _keep(op, Journal.keep_op)
        return original(self, ops_to_remove)
    return remove_ops


_HOOKS: list[tuple[type, str, Callable[[Any], Any]]] = [
    (Var, "add_child_op", _hook_add_child_op),
    (Var, "remove_child_op", _hook_remove_child_op),
    (Var, "set_name", _hook_set_name),
    (Var, "scopes", _hook_scopes),
    (Operation, "_validate_and_set_inputs", _hook_set_inputs),
    (Operation, "type_value_inference", _hook_type_value_inference),
    (Block, "set_outputs", _hook_set_outputs),
    (Block, "replace_block_output_var", _hook_replace_block_output_var),
    (Block, "remove_ops", _hook_remove_ops),
]
"""(class, attribute, hook factory taking the attribute as defined): every way coremltools 9.0's MIL
changes an existing variable, op or output relation."""


def _open(journal: Journal) -> None:
    with _LOCK:
        if not _ACTIVE:
            for cls, name, make in _HOOKS:
                _originals[(cls, name)] = cls.__dict__.get(name, _ABSENT)
                setattr(cls, name, make(inspect.getattr_static(cls, name)))  # a property stays a property
        _ACTIVE.setdefault(journal.thread, []).append(journal)


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


def _block_vars(block: Block) -> Iterable[Any]:
    for op in block.operations:
        yield from op._output_vars or ()
        for inner in op.blocks:
            yield from _block_vars(inner)


@functools.cache
def _slot_names(cls: type) -> tuple[str, ...]:
    names: list[str] = []
    for klass in cls.__mro__:
        slots = klass.__dict__.get("__slots__", ())
        names.extend([slots] if isinstance(slots, str) else slots)
    return tuple(n for n in names if n != "__dict__")


def _copied(value: Any) -> Any:
    """``value``, a copy if it is a container."""
    return value.copy() if isinstance(value, _CONTAINERS) else value


def _fields(obj: Any, skip: tuple[str, ...] = ()) -> dict[str, Any]:
    """Every attribute of ``obj`` (dict and slots), containers copied one level deep."""
    state = dict(getattr(obj, "__dict__", None) or {})
    for key in _slot_names(type(obj)):
        value = getattr(obj, key, _ABSENT)
        if value is not _ABSENT:
            state[key] = value
    return {key: _copied(value) for key, value in state.items() if key not in skip}


def _set_fields(obj: Any, saved: dict[str, Any]) -> None:
    if hasattr(obj, "__dict__"):
        for key in [k for k in vars(obj) if k not in saved and k != "operations"]:
            del vars(obj)[key]
    for key, value in saved.items():
        _object_setattr(obj, key, _copied(value))
