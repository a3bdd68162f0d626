"""The training library: runs inside pods and torchrun ranks. Never imports Airflow."""

__version__ = "0.1.0"
