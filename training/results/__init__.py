"""What a run leaves for people: the model registry and its gate (``registry``), how a model is
logged to it (``logged_model``, with the pyfunc models ``folder_model`` and ``text_model``), the
pages and plots of a run (``reports``, ``plots``), the comparison of runs (``compare``) and the
benchmark sweep (``bench``). Imports ``metrics``, ``checkpoint``, ``distributed``, ``models``,
``data``, ``tracking``, ``config`` and ``util``."""
