"""``@pattern_program``: ``@mb.program`` for patterns, with the pattern rules checked as the function runs.

``@mb.program`` calls the decorated function at once; one that forgets ``return`` then fails inside
coremltools with ``AttributeError: 'NoneType' object has no attribute 'consuming_blocks'``. The same
function decorated with ``@pattern_program(input_specs=[...])`` raises :class:`PatternDefinitionError`
saying what to return; so does one that returns one of its own inputs. Otherwise it builds the very same
program as ``@mb.program``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from coremltools.converters.mil import Builder as mb
from coremltools.converters.mil.mil import Program

from ..language.errors import PatternDefinitionError

__all__ = ["pattern_program"]


class _Checked:
    """The pattern function, as ``mb.program`` sees it (same code object and name), with its result
    checked."""

    def __init__(self, function: Callable[..., Any]) -> None:
        self.function = function
        self.__code__ = function.__code__  # mb.program reads the argument names from it
        self.__name__ = function.__name__

    def __call__(self, *inputs: Any) -> Any:
        outputs = self.function(*inputs)
        name = self.__name__
        if outputs is None:
            raise PatternDefinitionError(
                f"Pattern function {name!r} returns nothing. End it with `return` and the output of its "
                f'last op, e.g. `return mb.mul(x=x, y=g, name="out")` (several last ops: return a tuple).'
            )
        for output in outputs if isinstance(outputs, (list, tuple)) else [outputs]:
            if any(output is var for var in inputs):
                raise PatternDefinitionError(
                    f"Pattern function {name!r} returns its input {output.name!r}: a pattern returns what "
                    "its last op computes. Return the output of the op that ends the sequence to find."
                )
        return outputs


def pattern_program(
    input_specs: list[Any] | None = None, opset_version: Any = None, function_name: str = "main"
) -> Callable[[Callable[..., Any]], Program]:
    """Like ``mb.program``, for a pattern: a function without ``return``, or returning one of its inputs,
    raises :class:`PatternDefinitionError` instead of failing inside coremltools.

    Args:
        input_specs: As for ``mb.program``: one ``mb.TensorSpec`` per argument.
        opset_version: As for ``mb.program``.
        function_name: As for ``mb.program``.

    Returns:
        The decorator; it returns the ``Program``.

    Raises:
        PatternDefinitionError: The function returns nothing, or one of its inputs.
    """

    def decorate(function: Callable[..., Any]) -> Program:
        return mb.program(input_specs=input_specs, opset_version=opset_version, function_name=function_name)(
            _Checked(function)
        )

    return decorate
