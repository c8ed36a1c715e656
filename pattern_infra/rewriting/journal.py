"""Undo journal: puts a program back as it was before a pass, copying only what the pass changes.

What it saves, the methods it hooks and what it leaves alone: docs/ARCHITECTURE.md, "Rewriting".
"""

from __future__ import annotations

import inspect
import threading
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from coremltools.converters.mil.mil import Block, Operation, Var
from coremltools.converters.mil.mil.utils import CacheDoublyLinkedList

__all__ = ["Journal", "journals_on_this_thread"]

_get_ident = threading.get_ident
_object_setattr = object.__setattr__

_ACTIVE: dict[int, list[Journal]] = {}  # thread id to the journals open on it, innermost last
_LOCK = threading.Lock()
_originals: dict[tuple[type, str], Any] = {}
"""(class, attribute) to what the class itself defined there before the hooks (``_ABSENT``: nothing)."""
_ABSENT = object()


def journals_on_this_thread() -> list[Journal]:
    """The journals open on this thread, innermost last, to record a change made without the hooks."""
    return _ACTIVE.get(_get_ident()) or []


class Journal:
    """Saved states of what a pass touched; :meth:`restore` (before :meth:`close`) puts the program back."""

    def __init__(self, op_lists: Mapping[Block, list[Operation]]) -> None:
        """``op_lists``: each block to restore with its ops in program order (kept, not copied)."""
        self.thread = _get_ident()
        self.saved: set[Any] = set()  # objects saved, or created since it opened (they hash by identity)
        self.users_saved: set[Var] = set()  # variables whose user list alone is saved (in attrs)
        self.objects: list[tuple[Any, dict[str, Any]]] = []  # each op and variable saved whole, its fields
        # Flat (object, attribute, value) triples, no tuple per entry, for objects not saved whole: a user
        # list, the enclosing block of an op the driver unlinks, a name a transform may write by hand.
        self.attrs: list[Any] = []
        self.blocks = [(block, ops, _fields(block)) for block, ops in op_lists.items()]
        self.closed = False
        _open(self)

    def keep(self, obj: Operation | Var) -> None:
        """Saves the fields of ``obj``, an op or a variable not saved yet (its callers ask); of an op, which
        the hooked methods change only in its input map, a copy of its dict and of that map."""
        self.saved.add(obj)
        if not isinstance(obj, Operation):
            self.objects.append((obj, _fields(obj)))
        elif getattr(obj, "_output_vars", None) is not None:  # else new (under construction): nothing to keep
            fields = obj.__dict__.copy()
            fields["_input_vars"] = fields["_input_vars"].copy()
            self.objects.append((obj, fields))

    def keep_users(self, var: Var) -> None:
        """Saves a variable's user list, unless the variable or its user list is saved already."""
        if var not in self.saved and var not in self.users_saved:
            self.users_saved.add(var)
            self.attrs += (var, "_child_ops", var._child_ops.copy())

    def keep_block(self, block: Block) -> None:
        """Saves every variable of ``block`` and its nested blocks, which ``Block.__exit__`` rewrites."""
        for op in block.operations:
            for var in op._output_vars or ():
                if var not in self.saved:
                    self.keep(var)
            for inner in op.blocks:
                self.keep_block(inner)

    def keep_match(self, ops: Iterable[Operation]) -> None:
        """Saves the names of a match's ops and of their outputs, which transforms may write by hand
        (``op.name = ...``); every other change to them goes through the hooks."""
        for op in ops:
            if op not in self.saved:
                self.attrs += (op, "name", op.name)
            for var in op._output_vars or ():
                if var not in self.saved:
                    self.attrs += (var, "name", var.name)

    def unlinked(self, block: Block, removal: list[tuple[Operation, list[Var]]]) -> None:
        """Records that the driver is about to take each op of ``removal`` out of ``block`` without the
        hooked methods (``enclosing_block`` set to None, the op taken off its inputs' user lists)."""
        for op, inputs in removal:
            if op not in self.saved:
                self.attrs += (op, "enclosing_block", block)
            for var in inputs:
                self.keep_users(var)

    def restore(self) -> None:
        """Puts every saved op, variable and block back as it was when the journal opened."""
        for obj, fields in self.objects:
            _set_fields(obj, fields)
        # Recorded only for objects not saved whole at the time, so older: applied after those.
        attrs = self.attrs
        for obj, name, value in zip(attrs[0::3], attrs[1::3], attrs[2::3]):
            _object_setattr(obj, name, _copied(value))
        for block, ops, fields in self.blocks:
            _set_fields(block, fields)
            block.operations = CacheDoublyLinkedList(ops)

    def close(self) -> None:
        """Stops recording; the hooks go away with the last open journal."""
        if not self.closed:
            self.closed = True
            _close(self)


def _keep(objects: Iterable[Any]) -> None:
    """Saves each of ``objects`` (ops and variables) in each journal open on this thread."""
    for journal in _ACTIVE.get(_get_ident(), ()):
        for obj in objects:
            if obj not in journal.saved:
                journal.keep(obj)


def _hook(changes: Callable[..., Iterable[Any]]) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """A hook factory for a method no rewrite calls as a rule: the method, after saving what ``changes``
    (given the call's arguments) says the call changes."""

    def make(original: Callable[..., Any]) -> Callable[..., Any]:
        def hook(*args: Any, **kwargs: Any) -> Any:
            _keep(changes(*args, **kwargs))
            return original(*args, **kwargs)

        return hook

    return make


# The methods a rewrite calls have hooks of their signatures (``*args, **kwargs`` cost 37k instructions
# per GELU instance, 2.5k per call), the hottest with _keep's loop written out (a call cost 6k).


def _hook_users(original: Callable[..., Any]) -> Callable[..., Any]:
    """``Var.add_child_op(op)`` and ``Var.remove_child_op(op, no_check)`` change the variable's user list."""

    def change_users(self: Var, op: Operation, *no_check: bool) -> Any:
        for journal in _ACTIVE.get(_get_ident(), ()):
            if self not in journal.saved:
                journal.keep_users(self)
        return original(self, op, *no_check)

    return change_users


def _hook_set_inputs(original: Callable[..., Any]) -> Callable[..., Any]:
    def _validate_and_set_inputs(self: Operation, input_kvs: Any, no_check_var_types: bool = False) -> Any:
        for journal in _ACTIVE.get(_get_ident(), ()):
            if self not in journal.saved:
                journal.keep(self)
        return original(self, input_kvs, no_check_var_types)

    return _validate_and_set_inputs


def _hook_scopes(prop: property) -> property:
    """``var.scopes = ...`` writes the scopes of the variable's producer op."""
    setter = prop.fset

    def set_scopes(self: Var, scopes: Any) -> None:
        if _ACTIVE and self.op is not None:
            _keep((self.op,))
        setter(self, scopes)  # type: ignore[misc]

    return property(prop.fget, set_scopes, prop.fdel, prop.__doc__)


def _hook_replace_block_output_var(original: Callable[..., Any]) -> Callable[..., Any]:
    """Changes both variables' ``consuming_blocks`` (and names) if ``old_var`` is an output."""

    def replace_block_output_var(self: Block, old_var: Var, new_var: Var) -> Any:
        if old_var in self._outputs:
            _keep((old_var, new_var))
        return original(self, old_var, new_var)

    return replace_block_output_var


def _hook_type_value_inference(original: Callable[..., Any]) -> Callable[..., Any]:
    """Re-inference rewrites the op's output variables (types, values, upstream sets)."""

    def type_value_inference(self: Operation, overwrite_output: bool = False) -> Any:
        outputs = getattr(self, "_output_vars", None)
        if outputs is None:  # a new op creating its outputs: new variables, nothing to restore
            result = original(self, overwrite_output)
            for journal in _ACTIVE.get(_get_ident(), ()):
                journal.saved.update(self._output_vars)
            return result
        _keep((self, *outputs))
        return original(self, overwrite_output)

    return type_value_inference


_HOOKS: list[tuple[type, str, Callable[[Any], Any]]] = [
    (Var, "add_child_op", _hook_users),
    (Var, "remove_child_op", _hook_users),
    (Operation, "_validate_and_set_inputs", _hook_set_inputs),
    (Operation, "type_value_inference", _hook_type_value_inference),
    (Var, "scopes", _hook_scopes),
    (Block, "replace_block_output_var", _hook_replace_block_output_var),
    (Var, "set_name", _hook(lambda self, name: (self,))),
    # the old and the new outputs' consuming_blocks
    (
        Block,
        "set_outputs",
        _hook(lambda self, outputs: [v for v in [*self._outputs, *outputs] if isinstance(v, Var)]),
    ),
    (Block, "remove_ops", _hook(lambda self, ops_to_remove: ops_to_remove)),  # each op's enclosing_block
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
        stack = _ACTIVE[journal.thread]
        stack.remove(journal)
        if not stack:
            del _ACTIVE[journal.thread]
        if not _ACTIVE:
            for cls, name, _ in _HOOKS:
                original = _originals.pop((cls, name), _ABSENT)
                if original is _ABSENT:
                    delattr(cls, name)
                else:
                    setattr(cls, name, original)


def _copied(value: Any) -> Any:
    return value.copy() if isinstance(value, (list, dict, set)) else value


def _fields(obj: Any) -> dict[str, Any]:
    """Every attribute of ``obj`` (slots and dict), containers copied one level deep."""
    state = {
        name: getattr(obj, name, _ABSENT)
        for klass in type(obj).__mro__
        for name in klass.__dict__.get("__slots__", ())
        if name != "__dict__"
    }
    state.update(getattr(obj, "__dict__", {}))
    return {name: _copied(value) for name, value in state.items() if value is not _ABSENT}


def _set_fields(obj: Any, fields: dict[str, Any]) -> None:
    getattr(obj, "__dict__", {}).clear()  # attributes set since
    for name, value in fields.items():
        _object_setattr(obj, name, _copied(value))
