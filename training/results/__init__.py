"""What a run leaves for people: the model registry and its gate (``registry``), the pages and
plots of a run (``reports``, ``plots``), the comparison of runs (``compare``) and the benchmark
sweep (``bench``). Imports ``checkpoint``, ``distributed``, ``models``, ``tracking``, ``config``
and ``util``."""
