"""Matching: a pattern's spellings planned and merged into one plan tree per anchor (:mod:`.plan`,
:mod:`.matcher`), and the one search engine that walks it (:mod:`.search`), behind :class:`Matcher`.
Imports only the language."""

from .matcher import Matcher
from .plan import Failure

__all__ = ["Failure", "Matcher"]
