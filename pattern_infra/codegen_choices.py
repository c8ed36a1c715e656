"""The generator's half that writes choice nodes (``one_of``, ``optional``, ``equivalences=``):
:class:`ChoiceWriter`, mixed into ``codegen._Generator`` like :class:`~pattern_infra.codegen_checks.CheckWriter`.

Each alternative's search is written into the search holding the choice (:meth:`ChoiceWriter.inline_alternatives`),
its locals renamed apart (:func:`rename`); its sub-matches are collected alternative by alternative and
the rest of the outer search runs in the loop over them, so the choices' order, laziness and bind
attempts are the interpreter's (``choice_search.choice_matches`` / ``entered_matches``), without a call
per alternative. A whole match's dicts are written out too (:meth:`ChoiceWriter.match_parts`), the
sub-matches' merged in as ``binding.merged`` merges them. An alternative the generator cannot write
(see :class:`~pattern_infra.codegen_checks.NotCompilable`) leaves its choice to those helpers, called
from the generated code.
"""

from __future__ import annotations

import re
from typing import Any

from . import choice_search
from .codegen_checks import NotCompilable

__all__ = ["ChoiceWriter", "rename"]


class ChoiceWriter:
    """The generator's choice nodes (state as in ``codegen._Generator``)."""

    def bind_choice(self, n: int, via: tuple[int, str, int] | None) -> None:
        """A choice node: a loop over the sub-matches of its alternatives ending at ``o<n>`` (the helper
        the interpreter calls, :func:`~pattern_infra.choice_search.choice_matches`), its slots read from each."""
        node = self.nodes[n]
        if not self.inline_alternatives(n, None):
            choice = self.constant("choice", node.choice)
            self.comment(f"choice {node.name!r}: every match of each alternative ending at o{n}")
            self.open_loop(f"for _s{n} in _choice_matches(_m, {choice}, o{n}, block, None, {node.is_final}):")
        self.sub_match_checks(n, via)

    def sub_match_checks(self, n: int, via: tuple[int, str, int] | None) -> None:
        """Choice node ``n`` bound to ``o<n>`` with the sub-match ``_s<n>``: injectivity, then its slots
        checked like any operands (``Search.bind_sub``)."""
        node = self.nodes[n]
        types = choice_search.choice_types(node.choice)
        clash = []
        for j in self.bound:  # compared where the op types overlap (the same op has the same type)
            other = self.nodes[j].choice
            if other is not None and choice_search.choice_types(other) & types:
                clash.append(f"not {{*map(id, _s{j}.ops)}}.isdisjoint(map(id, _s{n}.ops))")
            elif other is None and n not in self.clashes_checked and self.nodes[j].op_types & types:
                clash.append(f"o{j} in _s{n}.ops")  # an op list: compared by identity
        if clash:
            self.guard(" or ".join(clash), "an op of the alternative is already matched")
        self.line(f"_sl = _s{n}.slots")
        for slot in node.inputs:
            get = f"_sl[{slot!r}]" if slot in node.choice.full_slots else f"_sl.get({slot!r})"
            self.line(f"{self.value(n, slot)} = {get}")
        self.consumer_edge_checks(n, via)
        slots = list(node.inputs)
        self.op_edge_checks(n, slots)
        self.root_checks(n)
        self.const_checks(n, slots)
        self.bound.append(n)

    def inline_alternatives(self, m: int, entry: tuple[str, str] | None) -> bool:
        """Writes the searches of choice node ``m``'s alternatives into this search and opens the loop
        over their sub-matches ``_s<m>`` (what ``choice_search.choice_matches`` or, with ``entry`` (slot,
        variable expression), ``entered_matches`` yields, in the same order and after the same bind
        attempts); False, writing nothing, when an alternative's search cannot be generated.

        Alternative after alternative (``_k<m>``): its search, written out with names of its own, collects
        its sub-matches into ``_f<m>``; then the loop over them holds the rest of this search, so the next
        alternative is searched only once every sub-match of the previous one was tried, as the
        interpreter's lazy iteration does.
        """
        node = self.nodes[m]
        choice = node.choice
        # The alternatives compare their ops with the bound ones as they collect a sub-match, where the
        # interpreter compares when it takes one: the same matches and bind attempts, unless the choice
        # is final (the longest-spelling rule reads every sub-match, clashing ones included).
        bound = None if node.is_final else [(f"o{j}", self.nodes[j].op_types) for j in self.bound
                                            if self.nodes[j].choice is None]
        bodies, checked, built = [], True, True
        for alternative in choice.alternatives:
            if entry is not None:
                root = alternative.slots.index(entry[0])
                inner = self.alternative_body(m, alternative, root, f"r{{tag}}{root} = _ent{m}", bound)
            else:
                inner = self.alternative_body(m, alternative, None,
                                              f"o{{tag}}{alternative.compiled.final_nodes[0]} = o{m}", bound)
            if inner is None:
                return False
            bodies.append(inner[0])
            checked, built = checked and inner[1], built and inner[2]
        if bound is not None and checked:
            self.clashes_checked.add(m)
        if built:
            self.parts_built.add(m)
        if entry is not None:
            self.line(f"_ent{m} = {entry[1]}")
            maximal = node.is_final and not choice.fallback
            if maximal:
                self.line(f"_in{m} = set()  # ops inside an earlier alternative's sub-match (the longest wins)")
            indices = f"range({len(bodies)})"
        else:
            maximal = False
            dispatch = {}
            for alternative in choice.alternatives:
                end = alternative.compiled.nodes[alternative.compiled.final_nodes[0]]
                for t in sorted(end.op_types):
                    dispatch.setdefault(t, []).append(alternative.index)
            table = self.constant("dispatch", {t: tuple(ks) for t, ks in dispatch.items()})
            indices = f"{table}.get({self.op_type(f'o{m}')}, ())"
        self.comment(f"choice {node.name!r}: each alternative's search, written out; its sub-matches, one by one")
        self.open_loop(f"for _k{m} in {indices}:")
        self.line(f"_f{m} = []")
        for k, body in enumerate(bodies):
            self.line(("if" if k == 0 else "elif") + f" _k{m} == {k}:")
            self.line("    for _ in _ONCE:  # a failed check leaves the alternative")
            for text in body:
                self.lines.append("    " * (self.depth + 2) + text)
        if entry is not None and maximal:
            self.line(f"_f{m} = _kept(_f{m}, _in{m})")
        elif entry is None and node.is_final:
            alternatives = self.constant("alternatives", tuple(choice.alternatives))
            self.guard(f"_f{m} and _k{m} > 0 and _taken(_m, {self.constant('choice', choice)}, "
                       f"{alternatives}[_k{m}], o{m}, block)", "an earlier alternative matches further down")
        self.open_loop(f"for _s{m} in _f{m}:")
        return True

    def alternative_body(self, m: int, alternative: Any, root: int | None, start: str,
                         bound: list[tuple[str, frozenset[str]]] | None) -> tuple[list[str], bool, bool] | None:
        """The lines of ``alternative``'s collecting search, anchored at its last op (``root`` None) or
        entered from its input ``root``, with its locals renamed apart (``start`` binds the first one);
        whether they compare its ops with the ``bound`` ones (name, op types) and whether its
        sub-matches have every field written out. None when it cannot be generated."""
        matcher = choice_search.alternative_matcher(self.m, alternative)
        if root is not None and matcher.root_plans[root] is None:
            return None
        inner = type(self)(matcher, alternative.compiled.final_nodes[0], collect=True, root=root,
                           namespace=self.namespace)
        inner.counter = self.counter  # tags unique across every alternative written into this search
        inner.depth = 0
        inner.loops = 1  # inside `for _ in _ONCE`
        inner.found = "_FOUND"  # this search's _f<m>: named once the alternative's names are tagged
        inner.wrap = (self.constant("alternative", alternative), self.constant("matcher", matcher),
                      repr(self.nodes[m].choice.name))
        inner.wrap_index, inner.wrap_slots = alternative.index, alternative.slots
        inner.clash_with = bound
        try:
            inner.prepare()
            inner.steps()
        except NotCompilable:
            return None
        self.counter[0] += 1
        tag = f"q{self.counter[0]}q"
        lines = [start.format(tag=tag)] + [rename(text, tag).replace("_FOUND", f"_f{m}").replace("OUTER_", "")
                                           for text in inner.lines]
        return lines, inner.clash_with is not None and not inner.choice_nodes, inner.built

    def subs_final_checks(self) -> None:
        """No constant slot of a sub-match computed inside the match (``choice_search.subs_final_ok``),
        called only when some sub-match has a constant slot variable an op other than ``const``
        computes: the only ones a match can hold (a sub-match built here lists only those)."""
        suspects = " or ".join(f"_s{n}._const_vars" if n in self.parts_built else f"_s{n}.const_vars()"
                               for n in self.choice_nodes)
        ops = ", ".join(f"o{n}" for n in range(len(self.nodes)))
        subs = "".join(f"_s{n}, " for n in self.choice_nodes)
        self.guard(f"({suspects}) and not _subs_final_ok(({ops},), ({subs}))",
                   "no constant slot of an alternative computed inside the match")

    def outer_clash_checks(self) -> None:
        """In an inline alternative's search (``clash_with``: the ops the enclosing search had bound), a
        guard that none of this sub-match's ops is one of them (compared where the op types overlap)."""
        if self.clash_with is None or self.choice_nodes:
            return
        same = [f"o{n} is OUTER_{name}" for n, node in enumerate(self.nodes)
                for name, types in self.clash_with if node.op_types & types]
        if same:
            self.guard(" or ".join(same), "an op of the alternative is already matched")

    def sub_match_expression(self, state: str) -> str:
        """The :class:`~pattern_infra.choice_search.SubMatch` an inline alternative's search collects for
        the match ``state`` (ops, operands, roots, sub-matches): every field written out when it can be
        (:meth:`match_parts`), else derived from the state as ``choice_search`` derives it."""
        alternative, matcher, name = self.wrap
        parts = self.match_parts()
        if parts is not None and not self.optional_roots:  # every field written out
            index = self.wrap_index
            slots = ", ".join(f"{slot!r}: r{k}" for k, slot in enumerate(self.wrap_slots))
            flat = [f"o{n}" for n in range(len(self.nodes)) if n not in self.choice_nodes]
            flat += [f"*_s{n}.ops" for n in self.choice_nodes]
            consts = []  # the variables of constant slots an op other than const computes, only
            for n, slot, pos in self.m.const_slots:
                var = self.value(n, slot, pos)
                consts.append(f"*(({var},) if (_q := {var}._op) is not None and {self.op_type('_q')} != 'const' else ())")
            consts += [f"*_s{n}._const_vars" if n in self.parts_built else f"*_s{n}.const_vars()"
                       for n in self.choice_nodes]
            end = f"o{self.compiled.final_nodes[0]}"
            state = (f"_SMB({index}, {{{slots}}}, [{', '.join(flat)}], {end}, {name}, ({', '.join(parts)}), "
                     f"[{', '.join(consts)}])")
            self.built = True
        else:
            state = f"_SM({alternative}, {matcher}, {state}, {name})"
        return state

    def match_parts(self) -> tuple[str, str, str, str] | None:
        """Expressions of the dicts ``binding.match_dicts`` gives for this match (ops, operands,
        constants, choices), the choices' sub-matches merged in as ``binding.merged`` merges them; None
        when they must be built at run time: a wildcard slot that may be absent, a constant slot of a
        choice node, or a name an alternative shares with the rest of the pattern (``merged`` keeps
        the first of two equal keys, a dict display the last)."""
        if any(self.skippable) or any(self.nodes[n].choice is not None for n, _, _ in self.m.const_slots):
            return None
        names, keys = set(self.compiled.node_names), set(self.compiled.const_keys) | set(self.compiled.const_names)
        for n in self.choice_nodes:
            inner_names, inner_keys = _all_names(self.nodes[n].choice)
            if names & inner_names or keys & inner_keys:
                return None
            names |= inner_names
            keys |= inner_keys
        ops, operands, chosen = [], [], []
        parts = {n: f"_s{n}._parts" if n in self.parts_built else f"_s{n}.parts()" for n in self.choice_nodes}
        for node in self.nodes:
            n = node.index
            if node.choice is not None:
                ops.append(f"**{parts[n]}[0]")
                operands.append(f"{node.name!r}: dict(_s{n}.slots)")
                chosen.append(f"{node.choice.name!r}: _s{n}.alternative, **({parts[n]}[3] or {{}})")
            else:
                operands.append(f"{node.name!r}: {{" + ", ".join(f"{slot!r}: {self.value(n, slot)}"
                                                             for slot in node.inputs) + "}")
            ops.append(f"{node.name!r}: o{n}")
        played: dict[str, str] = {}
        for (n, slot, pos), key, cname in zip(self.m.const_slots, self.compiled.const_keys, self.compiled.const_names):
            var = self.value(n, slot, pos)
            played[key] = var
            played.setdefault(cname, var)
        consts = [f"{k!r}: {v}" for k, v in played.items()]
        for n in self.choice_nodes:
            operands.append(f"**{parts[n]}[1]")
            consts.append(f"**{parts[n]}[2]")
        return tuple("{" + ", ".join(items) + "}" for items in (ops, operands, consts, chosen))  # type: ignore[return-value]


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
                names |= inner_names
                keys |= inner_keys
    return names, keys


_LOCAL = re.compile(r"(?<!')\b([ovar])(\d)|\b_(ord|c|s|f|k|ent|in)(\d)")


def rename(text: str, tag: str) -> str:
    """``text`` with the search's numbered locals (``o3``, ``v3_x``, ``r0``, ``_s3``, ...) tagged apart
    (``oq1q3``, ...), for an alternative's search written into another; names already tagged are left."""
    return _LOCAL.sub(lambda mo: f"{mo[1]}{tag}{mo[2]}" if mo[1] else f"_{mo[3]}{tag}{mo[4]}", text)
