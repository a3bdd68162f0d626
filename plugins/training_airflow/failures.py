"""``fails_fast``: the one place where bad input (``ConfigError``, a failed data gate) becomes an
``AirflowFailException``, which fails the task without retries; anything else is retried."""

from __future__ import annotations

import functools
from typing import Any, Callable, TypeVar

from airflow.sdk.exceptions import AirflowFailException

F = TypeVar("F", bound=Callable[..., Any])


def fails_fast(fn: F) -> F:
    """Bad input fails the task at once and for good (no retry would fix it): a config the trainer
    refuses and a dataset that fails the data gate. Anything else propagates, so Airflow retries."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        from training.config.fields import ConfigError

        try:
            return fn(*args, **kwargs)
        except ConfigError as e:
            raise AirflowFailException(f"invalid run parameters: {e}") from None
        except Exception as e:
            from training.data.gate import DataValidationError  # only once something failed

            if isinstance(e, DataValidationError):
                raise AirflowFailException(str(e)) from None
            raise

    return wrapper  # type: ignore[return-value]
