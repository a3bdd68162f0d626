"""The training library: runs inside pods and torchrun ranks. Never imports Airflow.

Parts, bottom first; each imports only parts below it (tests/test_layers.py): ``util`` and ``log``;
``config``; ``store`` and ``tracking``; ``data``; ``models``; ``distributed``; ``checkpoint``;
``metrics``; ``results``; then the entry points ``evaluate``, ``train`` and ``cli`` (``python -m training``).
"""

__version__ = "0.1.0"
