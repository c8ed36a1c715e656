"""Patterns written as PyTorch code: ``pattern_from_torch(fn, example_inputs)``.

A pass author knows the PyTorch he wrote, not the MIL it becomes. :func:`pattern_from_torch` runs the
real conversion on a small function and hands back the MIL it produced, as a pattern program::

    gelu = pattern_from_torch(lambda x: x * torch.sigmoid(1.702 * x), (torch.randn(2, 8),),
                              before="common::fuse_gelu_exact")
    register_generic_pass(gelu, None, transform, "fuse_quick_gelu", "mine", constants="value")

How (numbered as it happens):

1. ``fn`` (a function or an ``nn.Module``) is exported with ``torch.export.export(...)
   .run_decompositions({})``, exactly as :func:`pattern_infra.testing.convert.convert_torch` and the
   README's recipe convert models.
2. ``coremltools.convert(..., convert_to="milinternal")`` runs coremltools' own PyTorch frontend (and its
   ``frontend_pytorch`` passes) and then the part of coremltools' default pipeline that runs *before the
   capture point* (see below); ``mil_backend::`` passes as capture points also run the backend passes
   before them.
3. The program is read op by op into a fresh pattern program: every non-const op is renamed
   ``<op type>_<k>`` (``k`` counting that type in program order: ``mul_0``, ``sigmoid_0``, ``mul_1``),
   every const ``<consumer>_<slot>`` (``mul_0_y``); the pattern's inputs take the names of ``fn``'s
   parameters and, with ``dynamic=True``, a symbolic size for every dimension. Names are deterministic:
   the same function gives the same names on every run.

The capture point:

* ``before="common::fuse_gelu_tanh_approximation"``: every pass of ``ct.PassPipeline.DEFAULT`` before the
  first occurrence of that pass ran (what that pass, or the generic pass replacing it, sees).
* ``after="common::fuse_linear_bias"``: that pass ran too (what a pass registered with
  ``run_after="common::fuse_linear_bias"`` sees). A generic pass id registered with ``run_after`` may be
  named in ``before=``: it means after its leader.
* ``after="frontend"``: only coremltools' PyTorch frontend and its own passes (nothing of the default
  pipeline).
* Neither: :data:`DEFAULT_BEFORE`, the pipeline's first fusion pass: canonicalisation has run
  (``const_elimination``, ``noop_elimination``, ``divide_to_multiply``: a ``x / c`` is already
  ``x * (1/c)`` there) and no fusion has.

:attr:`TorchCapture.passes` lists the passes that ran, frontend included.

Limits, on purpose:

* **Passes before the point.** The pattern is what coremltools produced at that point *for these
  example inputs*, with the override state (``ENABLE_EXPERIMENTAL_PASSES``) of the moment: generic passes
  replacing earlier pipeline passes run when it is set. A pattern captured at one point and registered at
  another may not match: capture where the pass runs.
* **Shapes.** The matcher never compares shapes, so the pattern's inputs are symbolic (``dynamic=True``);
  but shape-dependent work was done by torch.export and coremltools on the *example* shapes: a size-1
  dimension may have removed a broadcast or a ``squeeze``, ``x.shape[-1]`` became a constant, a reshape
  target is concrete. Use example inputs whose dimensions are distinct and larger than 1; if the replay
  with symbolic dimensions fails type inference, the concrete shapes are kept (``capture.dynamic`` says
  which).
* **Constants.** Python numbers and parameters become ``const`` ops of the pattern (``1.702`` in the
  example). Under the default ``constants="any"`` they match anything not computed in the match; under
  ``constants="value"`` the program must hold the same value (e.g. ``const_rules={"mul_0.y": "value"}``
  for just one). Parameters of an ``nn.Module`` (a layer norm's weight) are constants too: pass them as
  function inputs to make them pattern inputs.
* **One function, no control flow.** Data-dependent control flow becomes ``cond``/``while_loop`` blocks,
  which a pattern cannot contain (refused). Only tensor arguments; only the ``main`` function.
* torch is imported when this module's functions are called, never by ``import pattern_infra``.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from coremltools.converters.mil import Builder as mb
from coremltools.converters.mil.mil import Function, Program, Var, get_new_symbol
from coremltools.converters.mil.mil.passes.pass_pipeline import PassPipeline, PassPipelineManager

from ..cli.quiet import no_progress_bars
from ..language.errors import PatternDefinitionError

__all__ = ["DEFAULT_BEFORE", "TorchCapture", "capture_torch", "pattern_from_torch", "capture_passes"]

logger = logging.getLogger(__name__)

DEFAULT_BEFORE = "common::fuse_matmul_weight_bias"
"""Capture point when none is given: the first fusion pass of coremltools' default pipeline."""

FRONTEND = "frontend"
"""``after=FRONTEND`` captures what coremltools' PyTorch frontend alone produced."""


@dataclass
class TorchCapture:
    """What :func:`capture_torch` produced."""

    pattern: Program
    """The pattern program: renamed ops, inputs named after ``fn``'s parameters."""
    converted: Program
    """The program coremltools produced at the capture point, unchanged (its own op names)."""
    passes: list[str]
    """The passes that ran before the capture, in order (``frontend_pytorch`` passes first)."""
    point: str
    """The capture point in words, e.g. ``"before common::fuse_gelu_exact"``."""
    names: dict[str, str] = field(default_factory=dict)
    """Pattern op name to the name coremltools gave the op."""
    dynamic: bool = True
    """Whether the pattern's inputs have symbolic dimensions (False: the example shapes were kept)."""


def capture_passes(before: str | None = None, after: str | None = None) -> tuple[list[str], list[str], str]:
    """The pipeline passes that run before a capture point.

    Args:
        before: Capture just before the first occurrence of this pass id.
        after: Capture just after the first occurrence of this pass id, or ``"frontend"``.

    Returns:
        ``(default pipeline passes, backend passes, point in words)``: the prefix of
        ``ct.PassPipeline.DEFAULT`` to run, the prefix of the ``backend_mlprogram`` pipeline to run after
        it (non-empty only for a ``mil_backend::`` point), and the description.

    Raises:
        PatternDefinitionError: Both or an unknown pass id given.
    """
    if before is not None and after is not None:
        raise PatternDefinitionError(
            f"pattern_from_torch: give either before= or after=, not both (got before={before!r}, "
            f"after={after!r})."
        )
    if after == FRONTEND:
        return [], [], "after coremltools' PyTorch frontend"
    target, include = (after, True) if after is not None else (before or DEFAULT_BEFORE, False)
    default = list(PassPipeline.DEFAULT.passes)
    backend = list(PassPipeline.get_pipeline("backend_mlprogram").passes)
    point = f"{'after' if include else 'before'} {target}"
    if target in default:
        return default[: default.index(target) + include], [], point
    if target in backend:
        return default, backend[: backend.index(target) + include], point
    leader = _leader_of(target)
    if leader is not None and not include:
        return default[: default.index(leader) + 1], [], f"before {target} (right after {leader})"
    raise PatternDefinitionError(
        f"pattern_from_torch: {target!r} is not a pass of coremltools' default or backend pipeline "
        f"(nor a generic pass registered with run_after=). Name one of ct.PassPipeline.DEFAULT.passes, "
        f"e.g. before={DEFAULT_BEFORE!r}, or after={FRONTEND!r} for the frontend's output."
    )


def _leader_of(pass_id: str) -> str | None:
    from ..passes.registry import generic_passes  # the registry imports the driver; keep this module light

    default = PassPipeline.DEFAULT.passes
    for leader_id, container in generic_passes().items():
        if leader_id in default and any(f.pass_id == pass_id for f in container.followers):
            return leader_id
    return None


def _parameter_names(fn: Any, count: int) -> list[str]:
    import torch

    target = fn.forward if isinstance(fn, torch.nn.Module) else fn
    try:
        params = list(inspect.signature(target).parameters.values())
    except (TypeError, ValueError):
        params = []
    names = [p.name for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    if len(names) < count:
        names += [f"x{i}" for i in range(len(names), count)]
    return names[:count]


def capture_torch(
    fn: Callable[..., Any],
    example_inputs: Sequence[Any],
    *,
    before: str | None = None,
    after: str | None = None,
    dynamic: bool = True,
    minimum_deployment_target: Any = None,
    input_names: Sequence[str] | None = None,
    name: str | None = None,
) -> TorchCapture:
    """Converts a small PyTorch function with coremltools and reads the result as a pattern.

    Args:
        fn: A function of tensors, or an ``nn.Module`` (put in ``eval()`` mode).
        example_inputs: One example tensor per positional argument of ``fn``.
        before: Capture point: just before the first occurrence of this pass id (see the module
            docstring); default :data:`DEFAULT_BEFORE`.
        after: Capture point: just after this pass id, or ``"frontend"``.
        dynamic: Give the pattern's inputs a symbolic size in every dimension (falls back to the example
            shapes, with ``dynamic=False`` in the result, when type inference refuses).
        minimum_deployment_target: coremltools target of the conversion (default ``ct.target.iOS16``,
            as :mod:`pattern_infra.testing.convert`); newer targets may produce other ops.
        input_names: Names of the pattern inputs (default: ``fn``'s parameter names).
        name: The pattern's name in messages (default: ``fn``'s name, ``"torch_pattern"`` for a lambda).

    Returns:
        The capture: the pattern, the converted program and the passes that ran.

    Raises:
        PatternDefinitionError: An unknown capture point, or a program a pattern cannot be made of
            (nested blocks, several functions, an output computed from constants alone).
    """
    import coremltools as ct
    import torch

    passes, backend, point = capture_passes(before, after)
    example_inputs = tuple(example_inputs)
    module = fn if isinstance(fn, torch.nn.Module) else _FunctionModule(fn)
    exported = torch.export.export(module.eval(), example_inputs).run_decompositions({})
    target = minimum_deployment_target or ct.target.iOS16
    with no_progress_bars(torch=True):
        prog = ct.convert(
            exported,
            convert_to="milinternal",
            pass_pipeline=PassPipeline(list(passes), "pattern_from_torch"),
            compute_precision=ct.precision.FLOAT32,
            minimum_deployment_target=target,
        )
        if backend:
            PassPipelineManager.apply_pipeline(
                prog, PassPipeline(list(backend), "pattern_from_torch_backend")
            )
    frontend = list(PassPipeline.get_pipeline("frontend_pytorch").passes)
    label = name or _function_label(fn)
    names = list(input_names) if input_names is not None else _parameter_names(fn, len(example_inputs))
    pattern, renamed, is_dynamic = _as_pattern(prog, names, label, dynamic)
    logger.debug("captured %s %s: %d ops", label, point, len(renamed))
    return TorchCapture(
        pattern=pattern,
        converted=prog,
        passes=frontend + list(passes) + list(backend),
        point=point,
        names=renamed,
        dynamic=is_dynamic,
    )


def pattern_from_torch(fn: Callable[..., Any], example_inputs: Sequence[Any], **options: Any) -> Program:
    """The pattern program conversion produces for a PyTorch function (see :func:`capture_torch`).

    The result is an ordinary pattern program (as if written with ``@mb.program``): pass it to
    ``register_generic_pass``, ``find_matches`` or ``explain``. Its ops are named ``<op type>_<k>``
    (``mul_0``, ``sigmoid_0``, ...): ``pattern.mul_0`` in the callbacks, ``"mul_0.y"`` in ``const_rules``.

    Args:
        fn: A function of tensors, or an ``nn.Module``.
        example_inputs: One example tensor per positional argument of ``fn``.
        **options: The keyword arguments of :func:`capture_torch` (``before``, ``after``, ``dynamic``,
            ``minimum_deployment_target``, ``input_names``, ``name``).

    Returns:
        The pattern program.

    Raises:
        PatternDefinitionError: See :func:`capture_torch`.
    """
    return capture_torch(fn, example_inputs, **options).pattern


def _function_label(fn: Any) -> str:
    label = getattr(fn, "__name__", None) or type(fn).__name__
    return "torch_pattern" if label == "<lambda>" else label


def _FunctionModule(fn: Callable[..., Any]) -> Any:
    import torch

    class FunctionModule(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fn = fn

        def forward(self, *args: Any) -> Any:
            return self.fn(*args)

    return FunctionModule()


def _as_pattern(
    prog: Program, input_names: list[str], label: str, dynamic: bool
) -> tuple[Program, dict[str, str], bool]:
    functions = prog.functions
    if list(functions) != ["main"]:
        raise PatternDefinitionError(
            f"pattern_from_torch({label}): the conversion has functions {sorted(functions)}; a pattern "
            f"is made of one function."
        )
    main = functions["main"]
    for op in main.operations:
        if op.blocks:
            raise PatternDefinitionError(
                f"pattern_from_torch({label}): the conversion produced {op.op_type} {op.name!r} with "
                f"nested blocks (data-dependent control flow); a pattern cannot contain control flow. "
                f"Capture the straight-line part around it instead."
            )
    inputs = list(main.inputs.values())
    if len(inputs) != len(input_names):
        raise PatternDefinitionError(
            f"pattern_from_torch({label}): the conversion has {len(inputs)} inputs "
            f"{list(main.inputs)}, but {len(input_names)} names were given ({input_names})."
        )
    if dynamic:
        try:
            return (*_replay(main, input_names, label, symbolic=True), True)
        except PatternDefinitionError:
            raise
        except Exception as exc:  # coremltools' type inference refused a symbolic shape
            logger.debug("%s: symbolic replay failed (%s); keeping the example shapes", label, exc)
    return (*_replay(main, input_names, label, symbolic=False), False)


def _replay(
    main: Function, input_names: list[str], label: str, symbolic: bool
) -> tuple[Program, dict[str, str]]:
    specs = {}
    for name, var in zip(input_names, main.inputs.values()):
        shape = tuple(get_new_symbol() for _ in var.shape) if symbolic else tuple(var.shape)
        specs[name] = mb.TensorSpec(shape=shape, dtype=var.dtype)
    counts: dict[str, int] = {}
    renamed: dict[str, str] = {}
    mapped: dict[int, Var] = {}
    with Function(specs, opset_version=main.opset_version) as func:
        for name, var in zip(input_names, main.inputs.values()):
            mapped[id(var)] = func.inputs[name]
        for op in main.operations:
            if op.op_type == "const":
                continue  # made where it is used, named after its consumer
            k = counts.get(op.op_type, 0)
            counts[op.op_type] = k + 1
            new_name = f"{op.op_type}_{k}"
            renamed[new_name] = op.name
            kwargs = {slot: _mapped(value, mapped, f"{new_name}_{slot}") for slot, value in op.inputs.items()}
            outputs = getattr(mb, op.op_type)(**kwargs, name=new_name)
            outputs = outputs if isinstance(outputs, (list, tuple)) else (outputs,)
            for old, new in zip(op.outputs, outputs):
                mapped[id(old)] = new
        outs = []
        for var in main.outputs:
            if id(var) not in mapped or var.op is None or var.op.op_type == "const":
                raise PatternDefinitionError(
                    f"pattern_from_torch({label}): output {var.name!r} is an input or a constant, not "
                    f"computed by an op; a pattern returns what its ops compute."
                )
            outs.append(mapped[id(var)])
        func.set_outputs(outs)
    pattern = Program()
    pattern.add_function("main", func)
    pattern._pattern_name = label  # read by compiler.pattern_name_of for messages
    return pattern, renamed


def _mapped(value: Any, mapped: dict[int, Var], const_name: str) -> Any:
    if isinstance(value, (list, tuple)):
        return tuple(_mapped(v, mapped, f"{const_name}_{i}") for i, v in enumerate(value))
    got = mapped.get(id(value))
    if got is not None:
        return got
    if value.op is not None and value.op.op_type == "const":
        new = mb.const(val=value.val, name=const_name)
        mapped[id(value)] = new
        return new
    raise PatternDefinitionError(
        f"pattern_from_torch: variable {value.name!r} is neither an input, a constant nor an op output."
    )
