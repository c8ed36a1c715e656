"""The checks and the match-building code the generator (:mod:`~pattern_infra.codegen`) writes for each
bound op: :class:`CheckWriter`, the half of the generator that writes what a step checks once its op is
bound (types, operand orders, edges, constants, choices' sub-matches), the final checks and the code
that builds the match; plus the constants both halves use.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import numpy as np

from .choice_search import choice_types
from .compiler import COMMUTATIVE_OPS, Edge, PatternNode, edge_positions

__all__ = ["DIRECT_COMPARISONS", "FLOAT_TYPES", "PLAIN_VALUES", "CheckWriter", "NotCompilable", "is_const_edge", "set_literal"]

DIRECT_COMPARISONS = 4
"""Up to this many matched ops, "is the producer one of them" compares identities without a type test."""

FLOAT_TYPES: frozenset[type] = frozenset({float, np.float16, np.float32, np.float64})
"""Types of a constant's ``val`` for which ``float(val)`` is what ``ConstRule.accepts`` compares."""

PLAIN_VALUES: frozenset[type] = FLOAT_TYPES | {
    int, bool, np.bool_, np.int8, np.int16, np.int32, np.int64, np.uint8, np.uint16, np.uint32, np.uint64
}
"""Types of a constant's raw value that coremltools never considers symbolic: for them ``var.val`` (which
runs ``any_symbolic``) is the raw ``var._sym_val.val``. So is a numpy array of a non-object dtype."""


class NotCompilable(Exception):
    """The plan has a feature the generator leaves to the interpreter."""


def set_literal(values: frozenset[str]) -> str:
    """A set display of constants: CPython folds ``x in {...}`` into a frozenset constant."""
    return "{" + ", ".join(repr(v) for v in sorted(values)) + "}"


def is_const_edge(edge: Edge | tuple[Edge, ...]) -> bool:
    return isinstance(edge, Edge) and edge.kind == "const"


class CheckWriter:
    """The generator's checks (mixed into ``codegen._Generator``, which holds the state they use: the
    matcher ``m``, ``compiled``, ``nodes``, ``plan``, ``lines``, ``namespace``, the bound ops)."""

    def already_matched(self, n: int) -> str:
        """The condition that ``o<n>`` is a program op the search bound already: one of the bound pattern
        ops (compared where the types overlap) or an op of a bound choice's sub-match (the interpreter's
        ``used`` holds those too); empty when no bound op can be one."""
        types = self.nodes[n].op_types
        same = [f"o{n} is o{j}" for j in self.bound if self.nodes[j].op_types & types]
        same += [f"o{n} in _ops{j}" for j in self.bound  # an op list: compared by identity
                 if self.nodes[j].choice is not None and choice_types(self.nodes[j].choice) & types
                 and not self.single(j)]  # else [o<j>], compared above
        return " or ".join(same)

    # -- binding one op -----------------------------------------------------------------------------

    def bind(
        self, n: int, via: tuple[int, str, int] | None, filtered: bool, outputs: str = "", placed: bool = False
    ) -> None:
        """Checks ``o<n>`` against pattern op ``n`` and sets its operand locals (opens a loop if it may swap).

        Args:
            n: The pattern op.
            via: For an up-step, the consumer edge it came along (already checked).
            filtered: Type and injectivity were checked by the enclosing down-step loop.
            outputs: A local already holding ``o<n>._output_vars``, if any.
            placed: The number of outputs and the block were checked too (an inline alternative's last
                op is the choice node's op, checked by the enclosing search).
        """
        node = self.nodes[n]
        o = f"o{n}"
        if not filtered:
            self.guard(self.type_mismatch(o, node), "type")
        if not placed:
            self.guard(f"len({outputs or o + '._output_vars'}) != {node.num_outputs}", "number of outputs")
            self.guard(f"{o}.enclosing_block is not block", "another block")
        if not filtered and (same := self.already_matched(n)):
            self.guard(same, "already matched")
        if node.choice is not None:
            self.bind_choice(n, via)
            return
        swap = self.swap_mode(node)
        swapped = {"x", "y"} if swap else set()
        # x and y checked per order when the pattern has a tuple in one of them (an order may move it)
        xy_later = bool(swap) and any(isinstance(node.inputs[s], tuple) for s in ("x", "y"))
        self.line(f"_iv = {o}._input_vars")
        for slot, edge in node.inputs.items():
            name = self.raw(n, slot) if slot in swapped else self.value(n, slot)
            self.line(f"{name} = _iv.get({slot!r})")
            if slot in self.skippable[n]:
                self.line(f"if type({name}) is not _Var:")
                self.depth += 1
                self.line(f"if {name} is None or isinstance({name}, _InternalVar):")
                self.depth += 1
                self.guard(f"{self.op_type(o)} == {node.op_type!r}", f"missing operand {slot!r}")
                self.line(f"{name} = None  # an alternative op type without this wildcard constant")
                self.depth -= 1
                self.line(f"elif isinstance({name}, _SEQ):  # {node.name}.{slot} is a single value")
                self.depth += 1
                for text in self.fail_lines():
                    self.line(text)
                self.depth -= 2
            elif slot in swapped and xy_later:
                self.guard(f"{name} is None or isinstance({name}, _InternalVar)", f"missing operand {slot!r}")
            elif isinstance(edge, tuple):
                self.guard(f"not isinstance({name}, _SEQ) or len({name}) != {len(edge)}",
                           f"missing operand {slot!r}, or not {len(edge)} values")
            else:  # a plain Var is neither missing, internal nor a tuple
                self.guard(
                    f"type({name}) is not _Var and ({name} is None or isinstance({name}, _NOT_A_VALUE))",
                    f"missing operand {slot!r}, or a tuple",
                )
        if swap:
            self.operand_orders(n, swap)
        self.consumer_edge_checks(n, via)  # independent of the operand order
        fixed = [slot for slot in node.inputs if slot not in swapped]
        self.op_edge_checks(n, fixed)
        if swap:
            self.const_checks(n, fixed)
            self.open_loop(f"for {self.value(n, 'x')}, {self.value(n, 'y')} in _ord{n}:")
            if xy_later:
                self.structure_checks(n, ["x", "y"])
            self.op_edge_checks(n, ["x", "y"])
            self.root_checks(n)
            self.const_checks(n, ["x", "y"])
        else:
            self.root_checks(n)
            self.const_checks(n, fixed)
        self.bound.append(n)

    def consumer_edge_checks(self, n: int, via: tuple[int, str, int] | None) -> None:
        """Bound consumers of op ``n`` read its very outputs (the edge ``via`` was checked already)."""
        node = self.nodes[n]
        for consumer, slot, pos, out in node.consumers:
            if consumer not in self.bound or via == (consumer, slot, pos):
                continue
            self.guard(
                f"{self.value(consumer, slot, pos)} is not o{n}._output_vars[{out}]",
                f"{self.nodes[consumer].name}.{slot} reads {node.name}",
            )

    def swap_mode(self, node: PatternNode) -> str:
        """``""`` (never swapped), ``"always"`` or ``"by_type"`` (only for commutative program op types)."""
        if not node.commutative:
            return ""
        if node.swap_any_type or node.op_types <= COMMUTATIVE_OPS:
            return "always"
        if not node.op_types & COMMUTATIVE_OPS:
            return ""
        return "by_type"

    def operand_orders(self, n: int, swap: str) -> None:
        """``_ord<n>``: the operand orders to try, in the interpreter's order (``Search.assignments``)."""
        node = self.nodes[n]
        ax, ay = self.raw(n, "x"), self.raw(n, "y")
        as_written, swapped = f"(({ax}, {ay}), ({ay}, {ax}))", f"(({ay}, {ax}), ({ax}, {ay}))"
        self.comment(f"operand orders of {node.name}: as written, then swapped")
        single = f"{ax} is {ay}"
        if swap == "by_type":
            commutative = set_literal(node.op_types & COMMUTATIVE_OPS)
            single = f"{self.op_type(f'o{n}')} not in {commutative} or {single}"
        self.line(f"if {single}:")
        self.line(f"    _ord{n} = (({ax}, {ay}),)")
        cx, cy = (is_const_edge(node.inputs[s]) for s in ("x", "y"))
        if cx != cy:
            # The interpreter's rule (_const_fit): swapped first when that puts more compile-time
            # constants where the pattern has its constant. With one constant slot that is when the
            # operand in the other slot (``wrong``) is a constant and the one in it (``right``) is not:
            # ``wrong > right`` on bools, both evaluated as the interpreter does.
            wrong, right = (ax, ay) if cy else (ay, ax)
            self.line(
                f"elif {self.is_const_var(wrong, 'kw')} > {self.is_const_var(right, 'kr')}:"
                f"  # the constant on the wrong side: swapped first"
            )
            self.line(f"    _ord{n} = {swapped}")
        self.line("else:")
        self.line(f"    _ord{n} = {as_written}")

    def is_const_var(self, var: str, tmp: str) -> str:
        """Whether ``var`` is the output of a ``const`` op (``Search._const_fit``)."""
        return f"((_{tmp} := {var}._op) is not None and {self.op_type('_' + tmp)} == 'const')"

    def structure_checks(self, n: int, slots: list[str]) -> None:
        """Tuple slots hold tuples of the pattern's length; other slots hold no tuple."""
        node = self.nodes[n]
        for slot in slots:
            edge = node.inputs[slot]
            name = self.value(n, slot)
            if isinstance(edge, tuple):
                self.guard(f"not isinstance({name}, _SEQ) or len({name}) != {len(edge)}",
                           f"{node.name}.{slot} has {len(edge)} values")
            else:
                self.guard(f"isinstance({name}, _SEQ)", f"{node.name}.{slot} is a single value")

    def op_edge_checks(self, n: int, slots: list[str]) -> None:
        """Operands wired from a bound pattern op are that op's very output."""
        node = self.nodes[n]
        for slot in slots:
            for pos, e in edge_positions(node.inputs[slot]):
                if e.kind == "op" and e.index in self.bound:
                    self.guard(
                        f"{self.value(n, slot, pos)} is not o{e.index}._output_vars[{e.output}]",
                        f"{node.name}.{slot} reads {self.nodes[e.index].name}",
                    )

    def root_checks(self, n: int, slots: list[str] | None = None) -> None:
        """The first edge reaching a root binds it; every later one compares with it (in ``slots``, or all)."""
        node = self.nodes[n]
        for slot, edge in node.inputs.items():
            if slots is not None and slot not in slots:
                continue
            for pos, e in edge_positions(edge):
                if e.kind != "root":
                    continue
                var = self.value(n, slot, pos)
                name = self.compiled.root_names[e.index]
                if (n, slot, pos) in self.root_first:
                    self.line(f"r{e.index} = {var}  # root {name!r}")
                else:
                    self.guard(f"{var} is not r{e.index}", f"root {name!r} bound consistently")

    def const_checks(self, n: int, slots: list[str]) -> None:
        """The constant rules of op ``n``'s constant slots among ``slots``."""
        node = self.nodes[n]
        for slot in slots:
            for pos, e in edge_positions(node.inputs[slot]):
                if e.kind == "const":
                    self.const_check(self.value(n, slot, pos), e.index)

    def const_check(self, var: str, index: int) -> None:
        """The constant rule of ``var``; ``var.val`` is read through its raw value when that is plain."""
        key, expected, rule = self.compiled.consts[index]
        if rule.mode == "any":
            return
        where = f"constant {key}"
        self.line(f"_sv = {var}._sym_val")
        self.guard("_sv is None or (_val := _sv.val) is None", f"{where}: a compile-time constant")
        if rule.mode == "const" or expected is None:
            self.guard(
                f"type(_val) not in PLAIN_VALUES and (type(_val) is not _ndarray or _val.dtype.kind == 'O') "
                f"and {var}.val is None",
                f"{where}: not symbolic",
            )
            return
        accepts = self.constant("accepts", rule.accepts)
        value = self.constant("expected", expected)
        general = f"{accepts}({var}, {value}) is not None"
        if expected.size == 1 and expected.dtype.kind in "biuf":
            # the very floats ConstRule.accepts compares with, per type of value: the pattern's value
            # rounded to it (float16 differs; the others mostly share the float32 bounds)
            groups: dict[tuple[float, float], list[type]] = {}
            for t in sorted(FLOAT_TYPES, key=lambda t: t is not np.float32):  # float32's group first
                groups.setdefault(rule.scalar_bounds(expected, np.dtype(t)), []).append(t)
            test = general
            for k, ((e, tol), types) in reversed(list(enumerate(groups.items()))):
                e_text = repr(e) if math.isfinite(e) else self.constant("e", e)
                tol_text = repr(tol) if math.isfinite(tol) else self.constant("tol", tol)
                these = "FLOAT_TYPES" if len(groups) == 1 else self.constant("float_types", frozenset(types))
                test = f"not (abs(float(_val) - {e_text}) <= {tol_text}) if type(_val) in {these} else {test}"
                if k:
                    test = f"({test})"
            self.guard(test, f"{where} close to {float(expected.reshape(()))!r}")
            return
        self.guard(general, f"{where}: ConstRule.accepts")

    # -- end of the search --------------------------------------------------------------------------

    def final_checks(self) -> None:
        """``Search.final_checks``, written out for the nodes and slots of the pattern."""
        self.comment("final checks: intermediates used only inside the match and not block outputs")
        for node in self.nodes:
            if node.is_final:
                continue
            for j in range(node.num_outputs):
                self.line(f"_w = o{node.index}._output_vars[{j}]")
                self.guard(
                    f"_w.consuming_blocks or len(_w._child_ops) != {node.output_uses[j]}",
                    f"{node.name} output {j}: used {node.output_uses[j]} time(s), inside the match",
                )
        lists = [f"_p in _ops{n}" for n in self.choice_nodes if not self.single(n)]  # an op list: by identity
        matched = " or ".join([f"_p is o{n}" for n in range(len(self.nodes))] + lists)
        if len(self.nodes) > DIRECT_COMPARISONS or lists:  # first rule out by type
            matched = f"{self.op_type('_p')} in {set_literal(self.m.op_types)} and ({matched})"
        elif " or " in matched:  # read as written: `_p is not None and (_p is o0 or _p is o1)`
            matched = f"({matched})"
        self.comment("final checks: no root and no constant slot computed by a matched op")
        for k, name in enumerate(self.compiled.root_names):
            if k in self.optional_roots:  # read by some alternatives only: None when another matched
                self.line(f"_p = r{k}._op if r{k} is not None else None")
                self.guard(f"_p is not None and {matched}", f"root {name!r} computed inside the match")
                continue
            self.line(f"_p = r{k}._op")
            self.guard(f"_p is not None and {matched}", f"root {name!r} computed inside the match")
        for n, slot, pos in self.m.const_slots:
            var = self.value(n, slot, pos)
            optional = slot in self.skippable[n]
            if optional:
                self.line(f"if {var} is not None:")
                self.depth += 1
            self.line(f"_p = {var}._op")
            self.guard(f"_p is not None and {matched}",
                       f"constant slot {self.nodes[n].name}.{slot} computed inside the match")
            if optional:
                self.depth -= 1

    def collected(self) -> None:
        """An inline alternative's search (collect mode): at a match, the rest of the enclosing search goes
        on from it (:meth:`~pattern_infra.codegen_choices.ChoiceWriter.call_rest`), and when that finds
        no match taken, this search goes on (the interpreter's ``Continuing.final_checks``)."""
        if any(self.skippable):
            raise NotCompilable("an alternative op type may lack a wildcard constant (collect mode)")
        if self.choice_nodes:
            self.subs_final_checks()
        self.outer_clash_checks()
        self.comment("a match of the alternative: the enclosing search goes on from it")
        self.call_rest(self.sub_match_fields("({}, {}, {}, {})".format(*self.state_lists())))

    def state_lists(self) -> tuple[str, str, str, str]:
        """The search state of the match as list displays (ops, operands, roots, sub-matches), what
        ``binding.build_pattern`` and ``choice_search.SubMatch`` derive a match from."""
        assign = [self.slots_dict(n) if n in self.choice_nodes else self.operands_display(n, self.nodes[n].inputs)
                  for n in range(len(self.nodes))]
        per_node = [self.sub_object(n) if n in self.choice_nodes else "None" for n in range(len(self.nodes))]
        ops = [f"o{n}" for n in range(len(self.nodes))]
        roots = [f"r{k}" for k in range(len(self.compiled.root_names))]
        return tuple(f"[{', '.join(items)}]" for items in (ops, assign, roots, per_node))  # type: ignore[return-value]

    def operands_display(self, n: int, slots: Iterable[str]) -> str:
        """``{'x': v3_x, ...}``: op ``n``'s operand variables in ``slots``, as a dict display."""
        return "{" + ", ".join(f"{slot!r}: {self.value(n, slot)}" for slot in slots) + "}"

    def played_consts(self) -> dict[str, str]:
        """Constant key, then constant name (unless taken) -> variable: the insertion sequence of
        ``binding.build_pattern``'s constants dict, played at generation time."""
        played: dict[str, str] = {}
        for (n, slot, pos), key, cname in zip(self.m.const_slots, self.compiled.const_keys, self.compiled.const_names):
            var = self.value(n, slot, pos)
            played[key] = var
            played.setdefault(cname, var)
        return played

    def success(self) -> None:
        """Builds the Pattern as ``binding.build_pattern`` would, its dicts written out (for a pattern
        with choices, by calling it: the alternatives' ops, operands and constants are merged in)."""
        if self.choice_nodes:
            self.subs_final_checks()
            roots = ", ".join(f"r{k}" for k in range(len(self.compiled.root_names)))
            if self.expanded:  # set only when the match's dicts can be written out
                self.expanded_success(roots)
                return
            parts = self.match_parts(lean=True)
            if parts is not None:
                self.comment("a match: the dicts of binding.build_pattern, the choices' sub-matches merged in")
                self.write_pattern(parts, roots)
                self.line("if accept is None or accept(_p) is True:")
                self.line("    return _p")
                return
            self.comment("a match: binding.build_pattern, with the sub-matches of the choices")
            ops, assign, roots_list, per_node = self.state_lists()
            self.line(f"_p = _build_pattern(_m, block, {ops}, {assign}, {roots_list}, order, {per_node})")
            self.line("if accept is None or accept(_p) is True:")
            self.line("    return _p")
            return
        self._success_plain()

    def _success_plain(self) -> None:
        """Builds the Pattern as ``binding.build_pattern`` would, its dicts written out.

        Skipped wildcard slots (None) leave their entries out; when every such slot is present, which is
        the common case, the dicts are plain literals.
        """
        compiled = self.compiled
        self.comment("a match: the dicts of binding.build_pattern, written out")
        optional = [self.value(n, slot) for n in range(len(self.nodes)) for slot in self.nodes[n].inputs
                    if slot in self.skippable[n]]
        ops = ", ".join(f"{node.name!r}: o{node.index}" for node in self.nodes)
        roots = ", ".join(f"r{k}" for k in range(len(compiled.root_names)))
        if optional:
            self.line(f"if {' and '.join(f'{v} is not None' for v in optional)}:")
            self.depth += 1
            self.emit_new_pattern(ops, roots, with_skips=False)
            self.depth -= 1
            self.line("else:  # an alternative op type without some wildcard constant")
            self.depth += 1
            self.emit_new_pattern(ops, roots, with_skips=True)
            self.depth -= 1
        else:
            self.emit_new_pattern(ops, roots, with_skips=False)

    def emit_new_pattern(self, ops: str, roots: str, with_skips: bool) -> None:
        """``_p = _of_search(...)`` (``Pattern._of_search``), returned if accepted; ``with_skips`` leaves out the wildcard
        slots that are None."""
        operands = []
        for node in self.nodes:
            n = node.index
            items = ", ".join(f"{slot!r}: {self.value(n, slot)}" for slot in node.inputs)
            if with_skips and self.skippable[n]:
                self.line(f"_d{n} = {{{items}}}")
                for slot in node.inputs:
                    if slot in self.skippable[n]:
                        self.line(f"if {self.value(n, slot)} is None:")
                        self.line(f"    del _d{n}[{slot!r}]")
                operands.append(f"{node.name!r}: _d{n}")
            else:
                operands.append(f"{node.name!r}: {{{items}}}")
        entries = list(zip(self.m.const_slots, self.compiled.consts, self.compiled.const_names))
        if with_skips:
            self.line("_k = {}")
            for (n, slot, pos), (key, _, _), cname in entries:
                var = self.value(n, slot, pos)
                skippable = slot in self.skippable[n]
                if skippable:
                    self.line(f"if {var} is not None:")
                    self.depth += 1
                self.line(f"_k[{key!r}] = {var}")
                self.line(f"_k.setdefault({cname!r}, {var})")
                if skippable:
                    self.depth -= 1
            consts = "_k"
        else:  # the same insertion sequence, played at generation time
            consts = "{" + ", ".join(f"{k!r}: {v}" for k, v in self.played_consts().items()) + "}"
        self.line("_p = _of_search(")
        self.line(f"    _m.compiled, block, {{{ops}}}, [{roots}],")
        self.line(f"    {{{', '.join(operands)}}},")
        self.line(f"    {consts},")
        self.line("    order,")
        self.line("    _FINALS,")
        self.line("    {},")
        self.line(")")
        self.line("if accept is None or accept(_p) is True:")
        self.line("    return _p")
