"""Apply-and-check helpers shared by every pass test.

One helper runs a pass id both ways on copies of one program (coremltools' own pass with the override
off, ours with it on) so a test can compare the results op for op, count ops and check numerics;
:func:`check_fused` and :func:`check_not_fused` are the checks the pass tests make with it. The
samplers and :func:`sampled_conv` build the tests' data from a generator each test module seeds.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import numpy as np
import sympy as sp
from coremltools.converters.mil import Builder as mb
from coremltools.converters.mil.mil import Program, Var
from coremltools.converters.mil.mil.passes.pass_registry import PASS_REGISTRY

from ..authoring.clone import clone_program
from ..passes.container import PassContainer
from ..verification.symbolic import ProofStatus, prove_equivalent, to_sympy
from ..verification.verify import assert_programs_equivalent
from .convert import experimental_passes, iter_ops

__all__ = [
    "PassOutcome",
    "override",
    "run_pass",
    "run_both",
    "same_name_counters",
    "op_types",
    "assert_same_program",
    "check_fused",
    "check_not_fused",
    "check_new_pass",
    "prove_by_sign_of_input",
    "Sampler",
    "normal_f32",
    "near_one_f32",
    "dyadic_f32",
    "conv_weight_shape",
    "sampled_conv",
    "relu_exp",
    "to_softplus",
]

_T = TypeVar("_T")


override = experimental_passes
"""Sets ``ENABLE_EXPERIMENTAL_PASSES`` for the duration (alias of :func:`.convert.experimental_passes`)."""


def op_types(prog: Program, include_const: bool = False) -> list[str]:
    """Op types of the main function's block, in program order (consts left out unless asked)."""
    ops = prog.functions["main"].operations
    return [op.op_type for op in ops if include_const or op.op_type != "const"]


def run_pass(pass_id: str, prog: Program, *, generic: bool = True, followers: bool = False) -> Program:
    """Applies ``pass_id`` to a deep copy of ``prog`` and returns the copy.

    Args:
        pass_id: e.g. ``"common::fuse_gelu_exact"``.
        prog: Left untouched.
        generic: Run our generic pass (override on) or coremltools' own (override off).
        followers: Also run the generic passes registered ``run_after`` it, as the pipeline does
            (override on); by default the pass runs alone.
    """
    result = clone_program(prog)
    graph_pass = PASS_REGISTRY[pass_id]
    if generic and not isinstance(graph_pass, PassContainer):
        raise AssertionError(f"{pass_id} is not a generic pass; import generic_passes first")
    with override(generic):
        graph_pass.set_options(None)
        if generic and not followers:
            graph_pass.apply(result)
        else:
            graph_pass(result)
    result.validate()
    return result


@dataclass(frozen=True)
class PassOutcome:
    """A program before a pass, after coremltools' pass, and after ours."""

    before: Program
    """The input program (untouched)."""
    coremltools: Program
    """After coremltools' own pass."""
    ours: Program
    """After the generic pass."""

    def counts(self) -> tuple[Counter, Counter, Counter]:
        """Op-type counts before, after coremltools' pass, after ours."""
        return (
            Counter(op_types(self.before)),
            Counter(op_types(self.coremltools)),
            Counter(op_types(self.ours)),
        )

    def same(self) -> bool:
        """Whether both passes produced the same program text (ops, order, names, constants)."""
        return str(self.coremltools) == str(self.ours)


def same_name_counters(*runs: Callable[[], _T]) -> list[_T]:
    """Calls each of ``runs`` in turn, each from the builder's name counters as they were at the start.

    coremltools' builder names unnamed ops and constants from global counters (``<op>_weight_0``, then
    ``<op>_weight_1`` the next time the same name is built), so the second of two identical rewrites
    would get other names. Starting every run from the same counters makes identical rewrites print
    identically. The counters are left as the last run leaves them.

    Args:
        *runs: Callables taking no argument, e.g. two conversions of one program.

    Returns:
        The results of ``runs``, in order.
    """
    saved = dict(mb.name_count)
    results = []
    for run in runs:
        mb.name_count.clear()
        mb.name_count.update(saved)
        results.append(run())
    return results


def run_both(pass_id: str, prog: Program, *, reference_cleanup: Sequence[str] = ()) -> PassOutcome:
    """Runs coremltools' pass and ours on separate copies of ``prog``, from the same name counters.

    Args:
        pass_id: e.g. ``"common::fuse_gelu_exact"``.
        prog: Left untouched.
        reference_cleanup: coremltools passes run after coremltools' own ``pass_id`` on its result, e.g.
            ``"common::dead_code_elimination"`` where coremltools leaves dead ops that ours removes.

    Returns:
        ``prog`` and both results.
    """

    def reference() -> Program:
        result = run_pass(pass_id, prog, generic=False)
        for cleanup in reference_cleanup:
            result = run_pass(cleanup, result, generic=False)
        return result

    theirs, ours = same_name_counters(reference, lambda: run_pass(pass_id, prog, generic=True))
    return PassOutcome(prog, theirs, ours)


AXIS_SLOTS = frozenset({"perm", "axes", "axis"})
"""Integer constants naming axes; ``-1`` and ``rank - 1`` mean the same axis, so they compare modulo
the rank of the op's ``x`` (coremltools' passes rewrite some of them to negative axes in place)."""


def _normalized(op, slot: str, value: np.ndarray) -> np.ndarray:
    x = op.inputs.get("x")
    if slot in AXIS_SLOTS and value.dtype.kind == "i" and x is not None and x.shape is not None:
        return np.mod(value, max(len(x.shape), 1))
    return value


def _const_inputs(prog: Program) -> list[tuple[str, str, str, np.ndarray]]:
    return [
        (op.name, slot, var.name, _normalized(op, slot, np.asarray(var.val)))
        for op in iter_ops(prog)
        if op.op_type != "const"
        for slot, value in op.inputs.items()
        for var in (value if isinstance(value, (list, tuple)) else (value,))
        if var.op is not None and var.op.op_type == "const"
    ]


def assert_same_program(expected: Program, actual: Program) -> None:
    """Fails unless both programs print the same and every constant an op reads has the same value.

    The printed form shows large constants by name only, so values and dtypes are compared too (axis
    constants modulo rank, see :data:`AXIS_SLOTS`).
    """
    a, b = str(expected), str(actual)
    if a != b:
        raise AssertionError(f"programs differ\n--- expected ---\n{a}\n--- actual ---\n{b}")
    for (op, slot, name, x), (_, _, _, y) in zip(_const_inputs(expected), _const_inputs(actual), strict=True):
        if x.dtype != y.dtype or not np.array_equal(x, y):
            raise AssertionError(f"constant {op}.{slot} ({name}) differs: {x!r} vs {y!r}")


def _assert_op_types(prog: Program, expected: list[str], which: str) -> None:
    actual = op_types(prog)
    if actual != expected:
        raise AssertionError(f"{which}: op types {actual}, expected {expected}")


def check_fused(
    pass_id: str,
    prog: Program,
    expected: list[str],
    *,
    same_as_coremltools: bool = True,
    prove: bool = False,
    reference_cleanup: Sequence[str] = (),
    **equivalence: Any,
) -> Program:
    """Fails unless our pass turns ``prog`` into op types ``expected``, computing what ``prog`` computes.

    Args:
        pass_id: e.g. ``"common::fuse_gelu_exact"``.
        prog: Left untouched.
        expected: Op types of the result, ``const`` left out (``op_types(prog)`` for a refusal).
        same_as_coremltools: Also run coremltools' pass (:func:`run_both`) and demand the very same
            program (:func:`assert_same_program`); when False coremltools' pass is not run at all.
        prove: Also demand a symbolic proof (:func:`~pattern_infra.verification.symbolic.prove_equivalent`).
        reference_cleanup: See :func:`run_both`.
        **equivalence: Passed to :func:`~pattern_infra.verification.verify.assert_programs_equivalent`
            (default tolerances rtol 1e-5, atol 1e-6).

    Returns:
        Our program.

    Raises:
        AssertionError: A program, an op type or the proof differs.
        VerificationError: Our program computes something else than ``prog``.
    """
    if same_as_coremltools:
        outcome = run_both(pass_id, prog, reference_cleanup=reference_cleanup)
        assert_same_program(outcome.coremltools, outcome.ours)
        ours = outcome.ours
    else:
        ours = run_pass(pass_id, prog)
    _assert_op_types(ours, expected, f"{pass_id} (ours)")
    assert_programs_equivalent(prog, ours, **equivalence)
    if prove and not (proof := prove_equivalent(prog, ours)).proven:
        raise AssertionError(f"{pass_id}: no symbolic proof\n{proof}")
    return ours


def check_new_pass(pass_id: str, prog: Program, expected: list[str], **equivalence: Any) -> Program:
    """Fails unless a pass coremltools has no twin of turns ``prog`` into op types ``expected``: a program
    left as it was (``expected == op_types(prog)``) must be the very same program, any other must compute
    what ``prog`` computes.

    Args:
        pass_id: e.g. ``"generic::fuse_linear_scale"``.
        prog: Left untouched.
        expected: Op types of the result, ``const`` left out.
        **equivalence: Passed to :func:`~pattern_infra.verification.verify.assert_programs_equivalent`
            (default tolerances rtol 1e-5, atol 1e-6; ``rtol=0.0, atol=0.0`` for exact data movement).

    Returns:
        Our program.
    """
    ours = run_pass(pass_id, prog)
    assert op_types(ours) == expected, op_types(ours)
    if expected == op_types(prog):
        assert_same_program(prog, ours)
    else:
        assert_programs_equivalent(prog, ours, **equivalence)
    return ours


def check_not_fused(
    pass_id: str,
    prog: Program,
    *,
    same_as_coremltools: bool = True,
    reference_cleanup: Sequence[str] = (),
) -> PassOutcome:
    """Fails unless our pass leaves the op types of ``prog`` as they are (and, if asked, coremltools' too).

    Args:
        pass_id: e.g. ``"common::fuse_gelu_exact"``.
        prog: Left untouched.
        same_as_coremltools: Demand that coremltools' pass gives the very same program
            (:func:`assert_same_program`); when False the caller checks ``outcome.coremltools`` itself.
        reference_cleanup: See :func:`run_both`.

    Returns:
        Both results (:func:`run_both`).

    Raises:
        AssertionError: Our op types, or coremltools' program, differ.
    """
    outcome = run_both(pass_id, prog, reference_cleanup=reference_cleanup)
    _assert_op_types(outcome.ours, op_types(prog), f"{pass_id} (ours)")
    if same_as_coremltools:
        assert_same_program(outcome.coremltools, outcome.ours)
    return outcome


def prove_by_sign_of_input(prog: Program, other: Program) -> None:
    """Fails unless two one-input, one-output elementwise programs are proven equal case by case.

    For piecewise functions (``relu``, ``prelu``, ``leaky_relu``) :func:`prove_equivalent` may answer
    ``NOT_PROVEN`` after agreeing samples; it must at least find no counterexample. Then the proof splits
    on the sign of the input ``x``: on ``x = p``, ``x = -p`` (``p > 0``) and ``x = 0`` every ``Max`` and
    ``Piecewise`` resolves, and the difference must simplify to 0.

    Args:
        prog: The program before the pass.
        other: The program after it.

    Raises:
        AssertionError: A counterexample, or a case whose difference does not simplify to 0.
    """
    if (proof := prove_equivalent(prog, other)).status is ProofStatus.COUNTEREXAMPLE:
        raise AssertionError(f"counterexample\n{proof}")
    (before,), (after,) = to_sympy(prog).values(), to_sympy(other).values()
    (x,) = before.free_symbols
    p = sp.Symbol("p", positive=True)
    for value in (p, -p, sp.Integer(0)):
        if (residual := sp.simplify((before - after).subs(x, value))) != 0:
            raise AssertionError(f"at {x} = {value} the programs differ by {residual}")


Sampler = Callable[..., np.ndarray]
"""``sample(*shape)``: a new float32 array of that shape, drawn from the sampler's generator."""


def normal_f32(rng: np.random.Generator) -> Sampler:
    """A :data:`Sampler` of standard normal values drawn from ``rng``."""

    def sample(*shape: int) -> np.ndarray:
        return rng.standard_normal(shape).astype(np.float32)

    return sample


def near_one_f32(rng: np.random.Generator) -> Sampler:
    """A :data:`Sampler` of ``1 + 0.5 * N(0, 1)`` drawn from ``rng``: scales and shifts mostly near 1."""

    def sample(*shape: int) -> np.ndarray:
        return (1.0 + 0.5 * rng.standard_normal(shape)).astype(np.float32)

    return sample


def dyadic_f32(rng: np.random.Generator) -> Sampler:
    """A :data:`Sampler` of multiples of 1/4 in [-2, 2] drawn from ``rng``: exact in fp32, and so are
    their products with powers of two."""

    def sample(*shape: int) -> np.ndarray:
        return (rng.integers(-8, 9, shape) / 4).astype(np.float32)

    return sample


def conv_weight_shape(
    op_type: str, c_in: int, c_out: int, *, groups: int = 1, rank: int = 4
) -> tuple[int, ...]:
    """The weight shape of a 3-wide ``conv`` (``[Cout, Cin/groups, 3, ...]``) or ``conv_transpose``
    (``[Cin, Cout/groups, 3, ...]``) on an input of rank ``rank``.

    Args:
        op_type: ``"conv"`` or ``"conv_transpose"``.
        c_in: Input channels.
        c_out: Output channels.
        groups: Channel groups.
        rank: Rank of the input (3 to 5).

    Returns:
        The shape.
    """
    kernel = (3,) * (rank - 2)
    if op_type == "conv_transpose":
        return (c_in, c_out // groups, *kernel)
    return (c_out, c_in // groups, *kernel)


def sampled_conv(
    x: Var, op_type: str, c_out: int, sample: Sampler, *, bias: bool = True, groups: int = 1
) -> Var:
    """``op_type`` (``conv`` or ``conv_transpose``) of ``x``, named ``"conv"``, with a 3-wide kernel.

    Args:
        x: The input, channels on axis 1.
        op_type: ``"conv"`` or ``"conv_transpose"``.
        c_out: Output channels.
        sample: Draws the weight (:func:`conv_weight_shape`), then the bias.
        bias: Whether the op has a bias.
        groups: Channel groups.

    Returns:
        The op's output.
    """
    shape = conv_weight_shape(op_type, x.shape[1], c_out, groups=groups, rank=x.rank)
    kwargs = {"x": x, "weight": sample(*shape), "groups": groups, "name": "conv"}
    if bias:
        kwargs["bias"] = sample(c_out)
    return getattr(mb, op_type)(**kwargs)


# -- a toy pattern for the framework's own tests ------------------------------------------------------------


@mb.program(input_specs=[mb.TensorSpec(shape=(2, 3))])
def relu_exp(x: Any) -> Any:
    """The driver and journal tests' pattern: ``exp(relu(x))``, ops named ``r`` and ``e``."""
    return mb.exp(x=mb.relu(x=x, name="r"), name="e")


def to_softplus(pattern: Any) -> None:
    """Toy rewrite of :data:`relu_exp`: one ``softplus`` (structure only; numerics are not the point)."""
    out = mb.softplus(x=pattern.root_var, name=pattern.e.outputs[0].name, before_op=pattern.e)
    pattern.replace_output(out)
