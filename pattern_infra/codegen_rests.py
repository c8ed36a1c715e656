"""The generator's half that writes what a search does after a choice: the **rest functions**
(:class:`RestWriter`, mixed into ``codegen._Generator`` like the other writers).

A choice's alternatives are searched inline (:mod:`~pattern_infra.codegen_choices`); each sub-match they
find is handed on the moment it is found, as the interpreter's ``choice_search`` helpers hand it to
their ``take``: the rest of the search (the choice node's checks, the steps after it, the final checks,
the match) is written once, as the module-level function ``_rest<n>``, called from every point where an
alternative finds a sub-match with the sub-match's row (the choice node's slot variables, then
``choice_search.ROW_FIELDS``) and the locals of the calling search it reads. It returns the match taken,
or None: the alternative's search then goes on. So no alternative is searched further than the first
match taken needs, and the bind attempts are the interpreter's.

The locals a rest function reads are found once its body is written (:func:`resolve_rests`, with
:mod:`symtable`), so its call sites are written with a marker, ``FREE(_rest<n>)``, filled in then. A
rest function whose body, times its call sites, stays within :data:`INLINED_LINES` is not defined but
written into each call site, specialised to it (:func:`_specialised`: no call, no row, the match of the
alternative taken only); ``codegen.build`` writes none in when that would nest deeper than CPython
compiles.
"""

from __future__ import annotations

import ast
import builtins
import functools
import re
import symtable
from typing import Any

from . import choice_search

__all__ = ["RestWriter", "leaves_early", "resolve_rests"]


class RestWriter:
    """The generator's rest functions (state: ``frames`` and ``functions``, set by ``init_choice_state``)."""

    def call_helper(self, n: int, call: str, entered: bool) -> None:
        """Choice node ``n`` left to ``choice_search``'s helper (``call``, its arguments up to ``take``):
        it calls ``_rest<n>`` with each sub-match's row; ``entered``: the row's last op is ``o<n>``."""
        node = self.nodes[n]
        self.line(f"_p = {call}, _each_row(_rest{n}, {tuple(node.inputs)!r}, [FREE(_rest{n})]), None, {node.is_final})")
        self.line("if _p is not None:")
        self.line("    return _p")
        self.open_rest(n, entered)

    def open_rest(self, n: int, entered: bool) -> None:
        """What the search does after a sub-match of choice node ``n`` (its checks, the steps after it,
        the match) is written from here on into the function ``_rest<n>``, which the alternatives call
        with each sub-match's row (the choice node's slot variables, then ``choice_search.ROW_FIELDS``;
        ``entered``: the row's last op is ``o<n>``, else ``o<n>`` is bound already) and the locals it
        reads of this search (``FREE(_rest<n>)``: :func:`resolve_rests`). Its failed checks return None:
        the alternative's search goes on to its next sub-match."""
        node = self.nodes[n]
        params = [self.value(n, slot) for slot in node.inputs] + [f"_ops{n}", f"o{n}" if entered else "_", f"_k{n}",
                                                                  f"_pt{n}", f"_cv{n}"]
        self.frames.append((f"_rest{n}", params, self.lines, self.depth, self.loops))
        self.lines, self.depth, self.loops = [], 2, 0

    def close_rests(self) -> None:
        """Ends the functions :meth:`open_rest` opened, innermost first (each held the rest of the search)."""
        while self.frames:
            name, params, lines, depth, loops = self.frames.pop()
            self.functions.append((name, params, self.lines))
            self.lines, self.depth, self.loops = lines, depth, loops

    def call_rest(self, fields: list[str] | str) -> None:
        """An inline alternative's sub-match (``fields``, the row's expressions, or one expression that
        is the row): the rest of the enclosing search (``_FOUND``, named by it) is called with it and a
        match it returns is returned. For a final choice entered from a variable (``wrap_maximal``) the
        sub-match is first noted (``_FOUND_A``) and left out when it ends inside an earlier alternative's
        sub-match (``_FOUND_IN``: the longest spelling wins)."""
        if isinstance(fields, str):
            self.line(f"_x = {fields}")
            ops, end, args = f"_x[{choice_search.ROW_OPS}]", f"_x[{choice_search.ROW_END}]", "*_x, "
        else:
            k = len(self.wrap_outer_slots)
            ops, end = fields[k], fields[k + 1]
            if self.wrap_maximal:
                self.line(f"_x = {ops}")
                ops = fields[k] = "_x"
            args = "".join(f + ", " for f in fields)
        if self.wrap_maximal:
            self.line(f"_FOUND_A.append(({ops}, {end}))")
            self.guard(f"_FOUND_IN and id({end}) in _FOUND_IN", "ends inside an earlier alternative's sub-match")
        if self.wrap_taken:
            self.guard("_FOUND_TK is not None and _FOUND_TK()", "an earlier alternative matches further down")
        self.line(f"_p = _FOUND({args}FREE(_FOUND))  # failing: {self.fail_lines()[0]}")
        self.line("if _p is not None:")
        self.line("    return _p")


INLINED_LINES = 2500
"""A rest function is written into its call sites instead of called (:func:`resolve_rests`) when its
body, times its call sites, is at most this many lines: the 12-spelling RMSNorm's searches are written
whole (about 2,000 lines each); the registered passes' 486 searches hold 10% more text than with 600
lines, 59% more than with none (alternatives: ``docs/LANGUAGE.md``; their cost: ``docs/BENCHMARKS.md``)."""

_FREE = re.compile(r"FREE\((\w+)\)")
_WORD = re.compile(r"\w+")
_CALL = re.compile(r"( *)_p = (_rest\w+)\((.*)\)  # failing: (continue|return None)")


def resolve_rests(functions: list[tuple[str, list[str], list[str]]], search: list[str],
                  namespace: dict[str, Any], inline: bool = True) -> list[str]:
    """The rest functions' source (:meth:`RestWriter.open_rest`), their parameters completed with the
    locals of the calling search their body reads (found by :mod:`symtable`: the names it neither binds
    nor finds among the globals), and ``search`` with every ``FREE(_rest<n>)`` at a call replaced by
    those locals. A function calling another is completed after it.

    With ``inline``, a function called only directly, whose body times its call sites is at most
    :data:`INLINED_LINES` lines, is written into each call site instead (:func:`_spliced`) and not
    defined: no call, no arguments passed.
    """
    free: dict[str, list[str]] = {}
    inlined: dict[str, tuple[list[str], list[str]]] = {}
    calls: dict[str, set[str]] = {}  # function -> the functions it calls
    sites: dict[str, int | None] = {}  # function -> its direct call sites (None: called otherwise too)
    for caller, lines in [(f[0], f[2]) for f in functions] + [("search", search)]:
        calls[caller] = set()
        for line in lines:
            for callee in _FREE.findall(line):
                calls[caller].add(callee)
                mo = _CALL.fullmatch(line)
                direct = mo is not None and mo[2] == callee and not any(isinstance(arg, ast.Starred)
                                                                        for arg in _call(line)[1])
                known = sites.get(callee, 0)
                sites[callee] = known + 1 if direct and known is not None else None

    def filled(text: str) -> str:
        return _FREE.sub(lambda mo: "".join(name + ", " for name in free[mo[1]]), text) if "FREE(" in text else text

    out: list[str] = []
    pending = list(functions)
    while pending:
        name, params, body = next(f for f in pending if calls[f[0]] <= free.keys())
        pending.remove((name, params, body))
        body = list(map(filled, _spliced(body, inlined)))
        if inline and (count := sites.get(name)) is not None and count * len(body) <= INLINED_LINES:
            inlined[name], free[name] = (params, body), []  # no call left to fill in
            continue
        text = [f"def {name}({', '.join(params)}):", "    nb = 0", "    try:", *body,
                "    finally:", "        _m.bind_attempts += nb"]
        table = symtable.symtable("\n".join(text) + "\n", "<rest>", "exec").get_children()[0]
        free[name] = sorted(n for n in _globals_read(table) if n not in namespace and not hasattr(builtins, n))
        text[0] = f"def {name}({', '.join(params + free[name])}):"
        out += [*text, ""]
    search[:] = map(filled, _spliced(search, inlined))
    return out


def _spliced(lines: list[str], inlined: dict[str, tuple[list[str], list[str]]]) -> list[str]:
    """``lines`` with each call of an ``inlined`` rest function (name -> parameters, body) replaced by its
    body (:func:`_specialised` to the call's arguments), indented to the call's level, a failed check's
    ``return None`` turned into what a failure is at the call (noted on its line: ``continue`` inside the
    alternative's loops: its search goes on), and the call's ``if _p is not None: return _p`` left out
    (a match taken is returned where the body finds it)."""
    out: list[str] = []
    skip = 0
    for line in lines:
        if skip:
            skip -= 1
            continue
        mo = _CALL.fullmatch(line) if "_p = _rest" in line else None
        if mo is None or mo[2] not in inlined:
            out.append(line)
            continue
        params, body = inlined[mo[2]]
        body = [text[8:] for text in body]  # from the function's body (two levels in) to the call's level
        body = [text.replace("return None", mo[4], 1) if text.strip().startswith("return None") else text
                for text in body]
        out += [mo[1] + text for text in _specialised(body, params, *_call(line))]
        skip = 2
    return out


def _specialised(body: list[str], params: list[str], source: str, args: list[ast.expr]) -> list[str]:
    """``body`` preceded by its parameters' assignments from ``args``, specialised to them: the ``if``s on
    an alternative given as a number keep only its arm (:func:`_arm`), an unpacking of a row's locals
    passed under their own names is left out, and so is an assignment nothing reads any more."""
    assigned = []
    encoded = source.encode()  # the offsets count bytes
    for param, arg in zip(params, args):
        value = encoded[arg.col_offset:arg.end_col_offset].decode()  # type: ignore[index]
        if param == "_" or param == value:
            continue
        if isinstance(arg, ast.Constant) and isinstance(arg.value, int):
            body = _arm(body, param, arg.value)
        elif isinstance(arg, ast.Tuple) and all(isinstance(e, ast.Name) for e in arg.elts):
            same = f"{''.join(e.id + ', ' for e in arg.elts)}= {param}"  # type: ignore[attr-defined]
            body = [text for text in body if text.strip() != same]
        assigned.append((param, value))
    read = set(_WORD.findall("\n".join(body)))
    return [f"{param} = {value}" for param, value in assigned if param in read] + body


def _arm(body: list[str], name: str, value: int) -> list[str]:
    """``body`` with each ``if``/``elif``/``else`` chain on ``name == <number>`` (a match written per
    alternative, ``ChoiceWriter._write_tree``) replaced by the lines of the arm ``value`` takes."""
    if not any(f"if {name} == " in text for text in body):
        return body
    out: list[str] = []
    i = 0
    while i < len(body):
        indent = len(body[i]) - len(body[i].lstrip())
        if body[i].strip().startswith(f"if {name} == "):
            start, taken, heads = i, None, (f"if {name} == ",)
            while i < len(body) and len(body[i]) - len(body[i].lstrip()) == indent and (
                    head := body[i].strip()).startswith(heads):
                end = i + 1
                while end < len(body) and len(body[end]) - len(body[end].lstrip()) > indent:
                    end += 1
                if taken is None and (head == "else:" or head.endswith(f" == {value}:")):
                    taken = [text[4:] for text in body[i + 1:end]]
                i, heads = end, (f"elif {name} == ", "else:")
                if head == "else:":
                    break
            out += body[start:i] if taken is None else taken  # no arm for it: the chain as it was
            continue
        out.append(body[i])
        i += 1
    return out


@functools.lru_cache(maxsize=256)
def _call(line: str) -> tuple[str, list[ast.expr]]:
    """The text of a line ``_p = _rest<n>(...)`` and its call's arguments, parsed."""
    text = line.strip()
    return text, ast.parse(text).body[0].value.args  # type: ignore[attr-defined]


def _globals_read(table: symtable.SymbolTable) -> set[str]:
    """The names a function (nested scopes included) reads without binding them."""
    names = {sym.get_name() for sym in table.get_symbols() if sym.is_global() and sym.is_referenced()}
    for child in table.get_children():
        names |= _globals_read(child)
    return {name for name in names if not name.startswith("_rest")}


_LOOP = re.compile(r"(for|while)\b.*:\s*(#.*)?$")
_LEAVE = re.compile(r"(continue|break)\s*(#.*)?$")


def leaves_early(body: list[str]) -> bool:
    """Whether a line of ``body`` (an alternative's search, indented from 0) continues or breaks the loop
    written around it, outside every loop of its own."""
    loops: list[int] = []  # the indentation of the loops holding the line
    for text in body:
        code = text.lstrip()
        if not code or code.startswith("#"):
            continue
        indent = len(text) - len(code)
        while loops and loops[-1] >= indent:
            loops.pop()
        if not loops and _LEAVE.match(code):
            return True
        if _LOOP.match(code):
            loops.append(indent)
    return False
