"""Writing a pass: ready predicates for ``var_constraints`` (:mod:`.predicates`), ``@pattern_program``
(:mod:`.program`), the rewrite written as a second program (:mod:`.rewrite`), ``find_matches`` and the
design document's helpers (:mod:`.find`, :mod:`.design`) and an independent copy of a program
(:mod:`.clone`). Their public names are importable from :mod:`pattern_infra`."""
