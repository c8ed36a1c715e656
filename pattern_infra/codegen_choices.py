"""The generator's half that writes choice nodes (``one_of``, ``optional``, ``equivalences=``):
:class:`ChoiceWriter`, mixed into ``codegen._Generator`` like :class:`~pattern_infra.codegen_checks.CheckWriter`.

Each alternative's search is written into the search holding the choice (:meth:`ChoiceWriter.inline_alternatives`),
its locals renamed apart (:func:`rename`), alternative after alternative; where it finds a sub-match it
hands it on to the rest of the outer search (:mod:`~pattern_infra.codegen_rests`: a function called
there, or its body written there), so the choices' order, laziness and bind attempts are the
interpreter's (``choice_search.choice_matches`` / ``entered_matches``), without a call per alternative.

A sub-match is handed on as a **row**: the choice node's slot variables, then its ops, last op,
alternative, parts and constant variables (``choice_search.ROW_FIELDS``). For the choices
:meth:`ChoiceWriter.expandable` picks (nested ones included, up to :data:`MAX_WRITTEN_MATCHES` spellings)
the parts are the alternative's locals and the match is written once per spelling, their entries in
place (:meth:`ChoiceWriter.expanded_success`); for the others, the dicts a Pattern of the alternative
would hold, merged as ``binding.merged`` merges them (:meth:`ChoiceWriter.match_parts`). An alternative
the generator cannot write (:class:`~pattern_infra.codegen_checks.NotCompilable`) leaves its choice to
those helpers, which hand on :class:`~pattern_infra.choice_search.SubMatch` objects, turned into rows.
"""

from __future__ import annotations

import ast
import math
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Union

from . import choice_search
from .codegen_checks import NotCompilable, set_literal
from .codegen_rests import leaves_early
from .spelling import locates, spelling_of

__all__ = ["MAX_WRITTEN_MATCHES", "ChoiceWriter", "rename"]

MAX_WRITTEN_MATCHES = 16
"""The most matches a search writes out, one per spelling of its expanded choices (:meth:`ChoiceWriter.expandable`)."""


class ChoiceWriter:
    """The generator's choice nodes (state as in ``codegen._Generator``, and :meth:`init_choice_state`)."""

    def init_choice_state(self) -> None:
        """The state of writing choices, and of being an inline alternative's search."""
        # as an inline alternative: the names of its Alternative and matcher and its choice's name; its
        # index, slots and the choice node's slots; whether its anchor is the choice node's op, checked
        # already; the enclosing search's bound ops to compare with; whether its rows are written out,
        # with its locals (an expanded choice's alternative) and its own choices' too, what they hold
        self.wrap: tuple[str, str, str] | None = None
        self.wrap_index, self.wrap_slots, self.wrap_outer_slots = 0, [], []
        self.anchor_placed = False
        self.clash_with: list[tuple[str, frozenset[str]]] | None = None
        self.built = self.emit_locals = self.expand_nested = self.wrap_maximal = self.wrap_taken = False
        self.row_locals: tuple[list[str], Tree] = ([], ())
        # a count of the alternatives written inline so far, shared with theirs (each gets its own tag);
        # the choice nodes whose alternatives compare their ops, whose rows hold their parts, whose op
        # type the type check kept in _t<n>; the expanded choices (expandable: with their nested ones?)
        # and what their rows hold
        self.counter = [0]
        self.clashes_checked: set[int] = set()
        self.parts_built: set[int] = set()
        self.typed: set[int] = set()
        self.expanded: dict[int, bool] = {}
        self.expansion: dict[int, list[tuple[int, list[str], Tree]]] = {}
        self.lean_parts = locates(self.compiled)  # a Pattern without choices' operands (an alternative: its pattern's)
        # the rest functions being written (name, row parameters, the enclosing lines, depth and loops)
        # and the ones written (name, row parameters, body)
        self.frames: list[tuple[str, list[str], list[str], int, int]] = []
        self.functions: list[tuple[str, list[str], list[str]]] = []

    def bind_choice(self, n: int, via: tuple[int, str, int] | None) -> None:
        """A choice node: a loop over the sub-matches of its alternatives ending at ``o<n>`` (the helper
        the interpreter calls, :func:`~pattern_infra.choice_search.choice_matches`), its slots read from each."""
        node = self.nodes[n]
        if not self.inline_alternatives(n, None):
            self.comment(f"choice {node.name!r}: every match of each alternative ending at o{n}")
            self.call_helper(n, f"_choice_matches(_m, {self.constant('choice', node.choice)}, o{n}, block", entered=False)
        self.sub_match_checks(n, via, entered=False)

    def single(self, n: int) -> bool:
        """Every alternative of choice node ``n`` is one op: its sub-match's ops are ``[o<n>]``."""
        return all(len(a.compiled.nodes) == 1 and a.compiled.nodes[0].choice is None
                   for a in self.nodes[n].choice.alternatives)

    def slots_dict(self, n: int) -> str:
        """The expression of choice node ``n``'s slots as a sub-match holds them (absent ones left out)."""
        node = self.nodes[n]
        if all(slot in node.choice.full_slots for slot in node.inputs):
            return self.operands_display(n, node.inputs)
        return f"_present({tuple(node.inputs)!r}, ({', '.join(self.value(n, slot) for slot in node.inputs)},))"

    def parts_of(self, n: int) -> str:
        """The expression of choice node ``n``'s sub-match's dicts (``SubMatch.parts``)."""
        return f"_pt{n}" if n in self.parts_built else f"_pt{n}.parts()"

    def sub_object(self, n: int) -> str:
        """The expression of choice node ``n``'s sub-match as a :class:`~pattern_infra.choice_search.SubMatch`
        (for what derives a match from the search state)."""
        if n not in self.parts_built:
            return f"_pt{n}"
        return (f"_SMB(_k{n}, {self.slots_dict(n)}, _ops{n}, o{n}, {self.nodes[n].choice.name!r}, "
                f"_pt{n}, _cv{n})")

    def sub_match_checks(self, n: int, via: tuple[int, str, int] | None, entered: bool, entry: str = "") -> None:
        """Choice node ``n`` bound to ``o<n>`` with its sub-match's row: injectivity, then its slots
        checked like any operands (``Search.bind_sub``), but the slot ``entry`` its inline alternatives were
        entered from (their root there is the very variable: nothing to compare)."""
        node = self.nodes[n]
        types = choice_search.choice_types(node.choice)
        clash = []
        for j in self.bound:  # compared where the op types overlap (the same op has the same type)
            other = self.nodes[j].choice
            if other is not None and choice_search.choice_types(other) & types:
                if self.single(j):
                    clash.append(f"o{j} is o{n}" if self.single(n) else f"o{j} in _ops{n}")
                elif self.single(n):
                    clash.append(f"o{n} in _ops{j}")
                else:
                    clash.append(f"not {{*map(id, _ops{j})}}.isdisjoint(map(id, _ops{n}))")
            elif other is None and n not in self.clashes_checked and self.nodes[j].op_types & types:
                if not self.single(n):
                    clash.append(f"o{j} in _ops{n}")  # an op list: compared by identity
                elif entered:  # else the choice node's own binding compared o<n>
                    clash.append(f"o{j} is o{n}")
        if clash:
            self.guard(" or ".join(clash), "an op of the alternative is already matched")
        self.consumer_edge_checks(n, via)
        slots = [slot for slot in node.inputs if slot != entry]
        self.op_edge_checks(n, slots)
        self.root_checks(n, slots)
        self.const_checks(n, slots)
        self.bound.append(n)

    def inline_alternatives(self, m: int, entry: tuple[str, str] | None) -> bool:
        """Writes the searches of choice node ``m``'s alternatives into this search, each calling
        ``_rest<m>`` (:meth:`open_rest`, opened here) with each of its sub-matches the moment it finds
        it, as ``choice_search.choice_matches`` or, with ``entry`` (slot, variable expression),
        ``entered_matches`` offers them: the same order, laziness and bind attempts. False, writing
        nothing, when an alternative's search cannot be generated.
        """
        node = self.nodes[m]
        choice = node.choice
        # The alternatives compare their ops with the bound ones as they find a sub-match, where the
        # interpreter compares when it takes one: the same matches and bind attempts, unless the choice
        # is final (the longest-spelling rule reads every sub-match, clashing ones included).
        bound = None if node.is_final else [(f"o{j}", self.nodes[j].op_types) for j in self.bound
                                            if self.nodes[j].choice is None]
        maximal = entry is not None and node.is_final and not choice.fallback
        written = self.alternative_bodies(m, entry, bound, m in self.expanded, maximal)
        if m in self.expanded and (written is None or not written[2]):  # not inline, or a row not written out
            del self.expanded[m]  # the match merges this choice's dicts like the others'
            if written is not None:
                written = self.alternative_bodies(m, entry, bound, False, maximal)
        if written is None:
            return False
        bodies, checked, built = written
        if bound is not None and checked:
            self.clashes_checked.add(m)
        if built:
            self.parts_built.add(m)
        if entry is not None:
            self.line(f"_ent{m} = {entry[1]}")
            if maximal:
                self.line(f"_in{m}, _a{m} = (), []  # ops inside an earlier alternative's sub-match (a set once any); this one's")
        elif m not in self.typed:  # the dispatch on the op type reads it
            self.line(f"_t{m} = {self.op_type(f'o{m}')}")
        self.comment(f"choice {node.name!r}: each alternative's search, written out, calls _rest{m} with each sub-match")
        alternatives = self.constant("alternatives", tuple(choice.alternatives)) if entry is None and node.is_final else ""
        for k, (alternative, body) in enumerate(zip(choice.alternatives, bodies)):
            depth = self.depth
            types = alternative.compiled.nodes[alternative.compiled.final_nodes[0]].op_types
            if entry is None and not node.op_types <= types:  # a dispatch: the alternatives ending with its type
                self.line(f"if _t{m} {'== ' + repr(next(iter(types))) if len(types) == 1 else 'in ' + set_literal(types)}:")
                self.depth += 1
            if maximal and k:  # the longest-spelling rule (choice_search.entered_matches), written out
                self.line(f"if _a{m}:  # the ops inside the previous alternative's sub-matches, their last ops aside")
                self.line(f"    _in{m} = {{*_in{m}, *(id(_o) for _ops, _e in _a{m} for _o in _ops if _o is not _e)}}")
                self.line(f"    _a{m}.clear()")
            elif alternatives:  # the rule of choice_search.choice_matches, checked at the first sub-match
                self.line(f"_tk{m} = " + (f"_Taken(_m, {self.constant('choice', choice)}, {alternatives}[{k}], o{m}, block)"
                                          if k else "None"))
            if leaves_early(body):
                self.line(f"for _ in _ONCE:  # alternative {k}; a failed check leaves it")
            else:  # no check of its own before its first loop: a block, no loop (`if True` compiles to nothing)
                self.line(f"if True:  # alternative {k}")
            for text in body:
                self.lines.append("    " * (self.depth + 1) + text)
            self.depth = depth
        self.open_rest(m, entry is not None)
        return True

    def alternative_bodies(self, m: int, entry: tuple[str, str] | None, bound: list[tuple[str, frozenset[str]]] | None,
                           expand: bool, maximal: bool) -> tuple[list[list[str]], bool, bool] | None:
        """The lines of each alternative's search of choice node ``m`` (:meth:`alternative_body`), whether
        they all compare their ops with the ``bound`` ones and whether all write their rows out; None
        when one cannot be generated. With ``expand``, the rows hold the alternatives' locals and
        :attr:`expansion` what the match's dicts read of them (:meth:`expanded_success`)."""
        bodies, checked, built = [], True, True
        self.expansion[m] = []  # read for an expanded choice only
        for alternative in self.nodes[m].choice.alternatives:
            root = alternative.slots.index(entry[0]) if entry is not None else None
            start = (f"r{{tag}}{root} = _ent{m}" if entry is not None
                     else f"o{{tag}}{alternative.compiled.final_nodes[0]} = o{m}")
            inner = self.alternative_body(m, alternative, root, start, bound, expand, maximal)
            if inner is None:
                return None
            bodies.append(inner[0])
            checked, built = checked and inner[1], built and inner[2]
        return bodies, checked, built

    def alternative_body(self, m: int, alternative: Any, root: int | None, start: str,
                         bound: list[tuple[str, frozenset[str]]] | None,
                         expand: bool = False, maximal: bool = False) -> tuple[list[str], bool, bool] | None:
        """The lines of ``alternative``'s collecting search, anchored at its last op (``root`` None) or
        entered from its input ``root``, with its locals renamed apart (``start`` binds the first one);
        whether they compare its ops with the ``bound`` ones (name, op types) and whether its
        sub-matches have every field written out (with ``expand``: its locals, the dicts' expressions
        appended to :attr:`expansion`). None when it cannot be generated."""
        matcher = choice_search.alternative_matcher(self.m, alternative)
        if root is not None and matcher.root_plans[root] is None:
            return None
        inner = type(self)(matcher, alternative.compiled.final_nodes[0], collect=True, root=root,
                           namespace=self.namespace)
        inner.counter = self.counter  # tags unique across every alternative written into this search
        inner.depth = 0
        inner.loops = 1  # inside `for _ in _ONCE`
        inner.wrap_maximal, inner.wrap_taken = maximal, root is None and self.nodes[m].is_final
        inner.wrap = (self.constant("alternative", alternative), self.constant("matcher", matcher),
                      repr(self.nodes[m].choice.name))
        inner.wrap_index, inner.wrap_slots = alternative.index, alternative.slots
        inner.wrap_outer_slots = list(self.nodes[m].inputs)
        # anchored at o<m>: its type is one the alternative's last op accepts (the dispatch table), its
        # block and (when the numbers agree) its number of outputs were checked by this search
        end = alternative.compiled.nodes[alternative.compiled.final_nodes[0]]
        inner.anchor_placed = root is None and end.num_outputs == self.nodes[m].num_outputs
        inner.clash_with = bound
        inner.emit_locals = expand
        inner.lean_parts = self.lean_parts
        inner.expand_nested = expand and self.expanded.get(m, False)
        try:
            inner.prepare()
            inner.steps()
        except NotCompilable:
            return None
        self.counter[0] += 1
        tag = f"q{self.counter[0]}q"

        def named(text: str) -> str:  # the alternative's names tagged, the enclosing search's put in
            text = rename(text, tag).replace("OUTER_", "").replace("_FOUND_A", f"_a{m}")
            text = text.replace("_FOUND_IN", f"_in{m}").replace("_FOUND_TK", f"_tk{m}")
            return text.replace("_FOUND", f"_rest{m}")

        lines = [start.format(tag=tag)] + [named(text) for text in inner.lines]
        self.functions.extend((named(name), [named(p) for p in params], [named(text) for text in body])
                              for name, params, body in inner.functions)
        if expand and inner.built:
            names, tree = inner.row_locals
            self.expansion[m].append((alternative.index, [rename(v, tag) for v in names],
                                      _graft(tree, lambda parts: tuple(rename(text, tag) for text in parts),
                                             lambda text: rename(text, tag))))
        return lines, inner.clash_with is not None and not inner.choice_nodes, inner.built

    def subs_final_checks(self) -> None:
        """No constant slot of a sub-match computed inside the match (``choice_search.consts_outside``),
        called only when some sub-match has a constant slot variable an op other than ``const``
        computes: the only ones a match can hold (a row written out lists only those)."""
        suspects = " or ".join(f"_cv{n}" for n in self.choice_nodes)
        ops = ", ".join(f"o{n}" for n in range(len(self.nodes)))
        lists = "".join(f"_ops{n}, " for n in self.choice_nodes)
        consts = ", ".join(f"*_cv{n}" for n in self.choice_nodes)
        self.guard(f"({suspects}) and not _consts_outside(({ops},), ({lists}), [{consts}])",
                   "no constant slot of an alternative computed inside the match")

    def outer_clash_checks(self) -> None:
        """In an inline alternative's search (``clash_with``: the ops the enclosing search had bound), a
        guard that none of this sub-match's ops is one of them (compared where the op types overlap)."""
        if self.clash_with is None or self.choice_nodes:
            return
        same = [f"o{n} is OUTER_{name}" for n, node in enumerate(self.nodes)
                for name, types in self.clash_with if node.op_types & types
                and not (n == self.anchor and self.root is None)]  # o<m>, compared by the enclosing search
        if same:
            self.guard(" or ".join(same), "an op of the alternative is already matched")

    def sub_match_fields(self, state: str) -> list[str] | str:
        """The row of an inline alternative's match ``state`` (ops, operands, roots, sub-matches): the
        outer choice node's slot variables, then ``choice_search.ROW_FIELDS``, every field written out
        when it can be (:meth:`match_parts`), else one expression deriving the row from the state as
        ``choice_search`` derives it."""
        alternative, matcher, name = self.wrap
        outer = self.wrap_outer_slots
        if not self.parts_writable() or self.optional_roots:
            return f"_SM({alternative}, {matcher}, {state}, {name}).row({tuple(outer)!r})"
        slots = [f"r{self.wrap_slots.index(slot)}" if slot in self.wrap_slots else "None" for slot in outer]
        flat = [f"o{n}" for n in range(len(self.nodes)) if n not in self.choice_nodes]
        flat += [f"*_ops{n}" for n in self.choice_nodes]
        consts = []  # the variables of constant slots an op other than const computes, only
        for n, slot, pos in self.m.const_slots:
            var = self.value(n, slot, pos)
            consts.append(f"(({var},) if (_q := {var}._op) is not None and {self.op_type('_q')} != 'const' else ())")
        consts += [f"_cv{n}" for n in self.choice_nodes]
        # tuples (an empty one is a constant): one of them as it is, several joined
        held_consts = consts[0] if len(consts) == 1 else f"({''.join(f'*{c}, ' for c in consts)})"
        end = f"o{self.compiled.final_nodes[0]}"
        self.built = True
        if self.emit_locals:  # the match's dicts written where the outer search succeeds, from these
            names = [f"o{n}" for n in range(len(self.nodes))]
            names += [self.slot_names[n][slot] for n in range(len(self.nodes)) for slot in self.nodes[n].inputs]
            names += [f"{local}{n}" for n in self.choice_nodes for local in ("_pt", "_k")]  # nested rows
            self.row_locals = (names, self.match_tree())
            held = f"({''.join(v + ', ' for v in names)})"
        else:
            held = f"({', '.join(self.match_parts())})"  # type: ignore[arg-type]
        return [*slots, f"({''.join(f + ', ' for f in flat)})", end, str(self.wrap_index), held, held_consts]

    def expandable(self) -> dict[int, bool]:
        """The choice nodes whose alternatives' entries a whole match writes per alternative (no dicts
        per sub-match of them, none merged), each with whether its nested choices are too: the ones
        whose alternatives hold the most ops first (:func:`_size`), each with its nested choices when
        the matches written out (the product of the spellings, :func:`_leaves`) stay within
        :data:`MAX_WRITTEN_MATCHES`, else alone when its alternatives do; none when the match's dicts
        cannot be written out at all (:meth:`match_parts`). An inline alternative's search expands
        every choice of its own when the enclosing search expands its choice with the nested ones."""
        if not self.parts_writable() or (self.collect and (not self.expand_nested or self.optional_roots)):
            return {}
        if self.collect:
            return dict.fromkeys(self.choice_nodes, True)
        chosen, product = {}, 1
        for n in sorted(self.choice_nodes, key=lambda n: -_size(self.nodes[n].choice)):
            for count, deep in ((_leaves(self.nodes[n].choice), True), (len(self.nodes[n].choice.alternatives), False)):
                if product * count <= MAX_WRITTEN_MATCHES:
                    chosen[n] = deep
                    product *= count
                    break
        return chosen

    def match_tree(self, i: int = 0, taken: dict[int, tuple[int, tuple[str, ...]]] | None = None) -> Tree:
        """The dicts' expressions of the match (:meth:`match_parts`) per alternative of each choice of
        :attr:`expanded` from the ``i``-th on, ``taken`` (choice node: alternative, its dicts'
        expressions) those of the earlier ones: a :class:`Branch` per choice, nested."""
        taken = taken or {}
        if i == len(self.expanded):
            return self.match_parts(taken, lean=True)  # type: ignore[return-value]
        e = list(self.expanded)[i]
        return Branch(f"_k{e}", f"_pt{e}", tuple(
            (k, tuple(names), _graft(tree, lambda parts, k=k: self.match_tree(i + 1, {**taken, e: (k, parts)})))
            for k, names, tree in self.expansion[e]))

    def expanded_success(self, roots: str) -> None:
        """The match built per alternative of each choice of :attr:`expanded` (nested ``if``s on
        ``_k<e>``; the other choices' sub-matches merged in): their locals unpacked from the rows, their
        entries written into the dicts' displays where the merge would put them."""
        names = ", ".join(repr(self.nodes[e].name) for e in self.expanded)
        self.comment(f"a match: the dicts of binding.build_pattern, per alternative of {names}")
        self._write_tree(self.match_tree(), roots)
        self.line("if accept is None or accept(_p) is True:")
        self.line("    return _p")

    def _write_tree(self, tree: Tree, roots: str) -> None:
        """Writes ``tree``: per arm of a :class:`Branch`, an ``if`` and its row unpacked; at a leaf, the Pattern."""
        if not isinstance(tree, Branch):
            self.write_pattern(tree, roots)
            return
        for j, (k, names, sub) in enumerate(tree.arms):  # the last arm an else, when there are several
            self.line("else:" if 0 < j == len(tree.arms) - 1 else ("elif" if j else "if") + f" {tree.alternative} == {k}:")
            self.depth += 1
            self.line(f"{', '.join(names)}, = {tree.row}")
            self._write_tree(sub, roots)
            self.depth -= 1

    def write_pattern(self, parts: tuple[str, ...], roots: str) -> None:
        """``_p = ...``: the Pattern of a match with choices from its dicts' expressions (:meth:`match_parts`),
        ``pattern.choices`` a :class:`~pattern_infra.spelling.Spelling`: a constant of the search where every
        choice's alternative is known where the line is written (an arm of the match tree per
        alternative), else looked up from the choices dict at run time (``binding.pattern_of``)."""
        by_name, operands, consts, chosen = parts
        try:
            known = ast.literal_eval(chosen)
        except (ValueError, SyntaxError):  # an alternative taken at run time (_k<n>), nested rows' choices
            self.line(f"_p = _pattern_of(_m.compiled, block, {by_name}, [{roots}], {operands}, {consts}, order, "
                      f"{chosen})")
            return
        spelling = self.constant("S", spelling_of(self.compiled, known))
        self.line(f"_p = _of_search(_m.compiled, block, {by_name}, [{roots}], {operands}, {consts}, order, "
                  f"_FINALS, {spelling})")

    def parts_writable(self) -> bool:
        """Whether the match's dicts can be written out (:meth:`match_parts`): not with a wildcard slot
        that may be absent, a constant slot of a choice node, or a name an alternative shares with the
        rest of the pattern (``merged`` keeps the first of two equal keys, a dict display the last)."""
        if any(self.skippable) or any(self.nodes[n].choice is not None for n, _, _ in self.m.const_slots):
            return False
        names, keys = set(self.compiled.node_names), set(self.compiled.const_keys) | set(self.compiled.const_names)
        for n in self.choice_nodes:
            inner_names, inner_keys = _all_names(self.nodes[n].choice)
            if names & inner_names or keys & inner_keys:
                return False
            names |= inner_names
            keys |= inner_keys
        return True

    def match_parts(self, expanded: dict[int, tuple[int, tuple[str, ...]]] | None = None, lean: bool = False
                    ) -> tuple[str, str, str, str] | None:
        """Expressions of the dicts ``binding.match_dicts`` gives for this match (ops, operands,
        constants, choices), the choices' sub-matches merged in as ``binding.merged`` merges them; None
        when they must be built at run time (:meth:`parts_writable`). ``expanded``: choice node to the
        alternative taken and its dicts' expressions, whose entries are written in instead. ``lean``:
        for a Pattern (not a sub-match's row), without the choices' own operands where the pattern's
        spellings locate them (``binding.lean``)."""
        if not self.parts_writable():
            return None
        lean = lean and self.lean_parts
        ops, operands, chosen = [], [], []
        parts = {n: self.parts_of(n) for n in self.choice_nodes}
        spliced = {n: [text[1:-1] for text in texts]  # the items of "{...}"
                   for n, (_, texts) in (expanded or {}).items()}
        for node in self.nodes:
            n = node.index
            if n in spliced:
                k = expanded[n][0]  # type: ignore[index]
                ops.append(spliced[n][0])
                if not lean:
                    read = node.choice.alternatives[k].slots  # the slots this alternative has a variable in
                    operands.append(f"{node.name!r}: " + self.operands_display(n, [s for s in node.inputs if s in read]))
                chosen.append(f"{node.choice.name!r}: {k}")
                chosen.append(spliced[n][3])
            elif node.choice is not None:
                ops.append(f"**{parts[n]}[0]")
                if not lean:
                    operands.append(f"{node.name!r}: {self.slots_dict(n)}")
                flat = all(x.choice is None for a in node.choice.alternatives for x in a.compiled.nodes)
                chosen.append(f"{node.choice.name!r}: _k{n}" + ("" if flat else f", **({parts[n]}[3] or {{}})"))
            else:
                operands.append(f"{node.name!r}: " + self.operands_display(n, node.inputs))
            ops.append(f"{node.name!r}: o{n}")
        consts = [f"{k!r}: {v}" for k, v in self.played_consts().items()]
        for n in self.choice_nodes:
            operands.append(spliced[n][1] if n in spliced else f"**{parts[n]}[1]")
            consts.append(spliced[n][2] if n in spliced else f"**{parts[n]}[2]")
        return tuple("{" + ", ".join(item for item in items if item) + "}"  # type: ignore[return-value]
                     for items in (ops, operands, consts, chosen))


def _size(choice: Any) -> int:
    """The ops of all alternatives of ``choice``, nested choices' included."""
    return sum(len(a.compiled.nodes) + sum(_size(node.choice) for node in a.compiled.nodes if node.choice is not None)
               for a in choice.alternatives)


def _leaves(choice: Any) -> int:
    """The spellings of ``choice``: per alternative, the product of its nested choices' spellings."""
    return sum(math.prod(_leaves(node.choice) for node in a.compiled.nodes if node.choice is not None)
               for a in choice.alternatives)


@dataclass(frozen=True)
class Branch:
    """The match's dicts per alternative of an expanded choice (:meth:`ChoiceWriter.match_tree`): an ``if``
    on ``alternative`` (its local ``_k<e>``); per arm, the alternative, the locals its rows hold (unpacked
    from ``row``, ``_pt<e>``) and what follows (a :data:`Tree`)."""

    alternative: str
    row: str
    arms: tuple[tuple[int, tuple[str, ...], Any], ...]


Tree = Union[Branch, tuple[str, ...]]
"""A :class:`Branch`, or the expressions of the match's four dicts (:meth:`ChoiceWriter.match_parts`)."""


def _graft(tree: Tree, leaf: Callable[[tuple[str, ...]], Tree], name: Callable[[str], str] = str) -> Tree:
    """``tree`` with each of its dicts' expressions replaced by ``leaf`` of them, its names by ``name``."""
    if not isinstance(tree, Branch):
        return leaf(tree)
    return Branch(name(tree.alternative), name(tree.row),
                  tuple((k, tuple(map(name, names)), _graft(sub, leaf, name)) for k, names, sub in tree.arms))


def _all_names(choice: Any) -> tuple[set[str], set[str]]:
    """The op names and constant keys of every alternative of ``choice``, nested choices' included."""
    names: set[str] = set()
    keys: set[str] = set()
    for alternative in choice.alternatives:
        compiled = alternative.compiled
        names.update(compiled.node_names)
        keys.update(compiled.const_keys, compiled.const_names)
        for node in compiled.nodes:
            if node.choice is not None:
                inner_names, inner_keys = _all_names(node.choice)
                names, keys = names | inner_names, keys | inner_keys
    return names, keys


_LOCAL = re.compile(r"(?<!')\b([ovar])(\d)|\b_(ord|c|s|a|k|ent|in|ops|pt|cv|t|tk|rest)(\d)")


def rename(text: str, tag: str) -> str:
    """``text`` with the search's numbered locals (``o3``, ``v3_x``, ``r0``, ``_s3``, ...) tagged apart
    (``oq1q3``, ...), for an alternative's search written into another; names already tagged are left."""
    return _LOCAL.sub(lambda mo: f"{mo[1]}{tag}{mo[2]}" if mo[1] else f"_{mo[3]}{tag}{mo[4]}", text)
