"""Seeing what passes do and could do: ``explain`` (:mod:`.explain`) and ``explain_in_conversion``
(:mod:`.in_conversion`), the trace of rewrites (:mod:`.tracing`) and its HTML report (:mod:`.report`),
and ``suggest``, the repeated subgraphs no pass covers (:mod:`.suggest`, :mod:`.suggest_source`)."""
