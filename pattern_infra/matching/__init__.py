"""Matching: a compiled pattern's search plans (:mod:`.plan`) and the one search engine that walks them
(:mod:`.search`, with :mod:`.choice_search` for choice nodes), behind :class:`Matcher`. Imports only
the language."""

from .matcher import Matcher
from .plan import Failure

__all__ = ["Failure", "Matcher"]
