"""Fan-out: one pattern op standing for *every* consumer of a variable, captured as a list.

``fanout=["uses"]`` (TFLite's ``MultipleSameOps``) makes the pattern op ``uses`` match all the consumers
of its input at once, however many there are, provided they are all of its kind: ``pattern.uses`` is
then a list of ops, in program order, and all of them are final ops of the match.

Here it removes duplicate work: when every consumer of a ``relu`` is the same ``exp``, one ``exp`` is
enough::

    x --> relu --> exp --> ...              becomes     x --> relu --> exp --> ...
              |--> exp --> ...                                          |--> ...
              |--> exp --> ...                                          |--> ...

Shown: the matches and their ``pattern.uses`` lists (three consumers; a mixed set that does not match;
one consumer, which matches but has nothing to merge), then the program before and after.
"""

import _common as ex
from coremltools.converters.mil import Builder as mb

from pattern_infra import find_matches, register_generic_pass


@mb.program(input_specs=[mb.TensorSpec(shape=(2, 3))])
def shared_exp(x):
    return mb.exp(x=mb.relu(x=x, name="source"), name="uses")


def has_duplicates(pattern):
    # One consumer: nothing to merge. (A transform that changes nothing still counts as a rewrite, and
    # the pass would revisit the match until FixpointError; reject here, or return False to decline.)
    return len(pattern.uses) > 1


def merge_duplicates(pattern):
    keep, *duplicates = pattern.uses
    for dup in duplicates:
        pattern.replace_output(keep.outputs[0], old_var=dup.outputs[0])  # dead duplicates are removed


dedup_pass = register_generic_pass(
    shared_exp, has_duplicates, merge_duplicates, "merge_duplicate_exp", "examples", fanout=["uses"]
)


@mb.program(input_specs=[mb.TensorSpec(shape=(2, 3))])
def prog(x):
    three = mb.relu(x=x, name="three_exps")
    y = mb.add(x=mb.add(x=mb.exp(x=three), y=mb.exp(x=three)), y=mb.exp(x=three))
    mixed = mb.relu(x=y, name="exp_and_sin")
    y = mb.add(x=mb.exp(x=mixed), y=mb.sin(x=mixed))
    return mb.exp(x=mb.relu(x=y, name="one_exp"))


ex.banner("find_matches(shared_exp, prog, fanout=['uses'])")
for m in find_matches(shared_exp, prog, fanout=["uses"]):
    print(f"source={m.source.name:<11} uses={[op.name for op in m.uses]}")
ex.banner("merging the duplicates")
after = ex.rewrite(dedup_pass, prog)
ex.check(ex.op_types(after).count("exp") == 3, "three exps of one relu became one; the others untouched")
ex.compare(prog, after)
