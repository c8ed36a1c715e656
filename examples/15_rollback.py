"""Rollback: a transform that raises leaves the program exactly as it was.

Before the first transform of a pass runs, the driver opens an undo journal: from then on, every op
and variable the pass changes is saved the first time it changes (copy-on-write; no tensor is
copied). If ``var_constraints`` or ``transform_pattern`` raises, the
program is restored, including the rewrites the pass had already made, and ``PassExecutionError``
names the pass, the pattern, the matched ops and the original error.

The transform below moves a non-negative scale before a ``relu`` (``relu(x) * s = relu(x * s)`` for
``s >= 0``) and has a bug: it reads the scale with ``float()``, which fails on a vector constant. The
program has two scalar scales (rewritten first) and then a vector one.

Shown: the program, the transform calls, the error message; then the program text identical to what
it was before the pass, a valid program computing the same outputs.
"""

import copy

import _common as ex
import numpy as np
from coremltools.converters.mil import Builder as mb

from pattern_infra import PassExecutionError, register_generic_pass
from pattern_infra import predicates as P

SPEC = [mb.TensorSpec(shape=(2, 3))]


@mb.program(input_specs=SPEC)
def relu_then_scale(x):
    return mb.mul(x=mb.relu(x=x, name="relu"), y=2.0, name="scale")


def buggy_transform(pattern):
    print(f"  transform on {pattern.relu.name} -> {pattern.scale.name}")
    s = float(pattern.operand("scale", "y").val)  # bug: a vector constant cannot become a float
    if s < 0:
        return False
    scaled = mb.mul(x=pattern.root_var, y=s, before_op=pattern.scale)
    last = pattern.scale
    pattern.replace_output(mb.relu(x=scaled, name=last.outputs[0].name, before_op=last))


scale_pass = register_generic_pass(
    relu_then_scale,
    lambda p: P.is_constant(p.operand("scale", "y")),
    buggy_transform,
    "scale_before_relu",
    "examples",
)


@mb.program(input_specs=SPEC)
def prog(x):
    x = mb.mul(x=mb.relu(x=x), y=2.0, name="scalar_1")
    x = mb.mul(x=0.5, y=mb.relu(x=x), name="scalar_2")
    return mb.mul(x=mb.relu(x=x), y=np.array([1.0, 2.0, 3.0], np.float32), name="vector")


ex.show(prog, "program")
before, reference = str(prog), copy.deepcopy(prog)
ex.banner("running the pass")
try:
    scale_pass(prog)
except PassExecutionError as error:
    print(f"PassExecutionError: {error}")
else:
    raise SystemExit("FAILED: the pass was expected to raise")
ex.check(str(prog) == before, "program text identical to before the pass (the earlier rewrites undone)")
prog.validate()  # raises if the restored program were inconsistent
ex.compare(reference, prog)
