"""Reading a dataset: where its rows come from (``sources``: layouts, local or ``s3://``, the
fingerprint), how a table becomes training data (``options``, ``split``, ``schema``), the arrays
training reads (``dataset``), the order the ranks read them in (``sampler``), a split read window
by window (``stream``), the Great Expectations gate (``gate``, its suite ``expectations``) and
generators with a known answer (``synthetic``).
Imports ``config``, ``store`` and ``util``; never ``checkpoint`` (tests/test_layers.py)."""
