"""Task logs of runs made in-process with ``dag.test()`` (``make demo``), written where a worker
writes them, so the Airflow UI shows every task's log, a failed task's error included.

    with task_logs_to_files():
        dag.test(run_conf=conf)

``dag.test()`` prints each task's log to the console only, and Airflow has no switch for this (its
executor mode needs a running api-server). So, while a task runs, this tees the standard
``logging`` records (a root handler) and Airflow's structlog records (a processor put first) into
``<base_log_folder>/<log_filename_template>`` as the JSON lines a worker's supervisor writes,
which the api-server's log reader serves; a task listener opens and closes each task's file.
"""

from __future__ import annotations

import contextlib
import json
import logging
import threading
import traceback
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Iterator

from airflow.listeners import hookimpl

_lock = threading.Lock()
_file: Any = None


def _write(level: str, logger: str, event: str) -> None:
    with _lock:
        if _file is None:
            return
        record = {"timestamp": datetime.now(timezone.utc).isoformat(), "level": level.lower(), "logger": logger,
                  "event": event}
        _file.write(json.dumps(record) + "\n")
        _file.flush()


class _Handler(logging.Handler):
    def emit(self, record: logging.LogRecord) -> None:
        try:
            event = record.getMessage()
            if record.exc_info:
                event += "\n" + "".join(traceback.format_exception(*record.exc_info)).rstrip()
            _write(record.levelname, record.name, event)
        except Exception:  # a log copy must never break the task
            self.handleError(record)


def _structlog_tee(logger: Any, method: str, event_dict: dict[str, Any]) -> dict[str, Any]:
    event = str(event_dict.get("event", ""))
    extra = {k: v for k, v in event_dict.items() if k not in ("event", "exc_info", "logger_name", "timestamp", "level")}
    if extra:
        event += " " + " ".join(f"{k}={v}" for k, v in extra.items())
    exc = event_dict.get("exc_info")
    if exc:
        info = exc if isinstance(exc, tuple) else None
        if isinstance(exc, BaseException):
            info = (type(exc), exc, exc.__traceback__)
        event += "\n" + ("".join(traceback.format_exception(*info)).rstrip() if info else traceback.format_exc().rstrip())
    _write(method, str(event_dict.get("logger_name") or getattr(logger, "name", "") or "task"), event)
    return event_dict


def log_path(ti: Any) -> Path:
    """The task try's log file, as Airflow's file task handler names it."""
    import jinja2
    from airflow.configuration import conf

    template = conf.get("logging", "log_filename_template")
    relative = jinja2.Template(template).render(ti=ti, try_number=ti.try_number)
    return Path(conf.get("logging", "base_log_folder")) / relative


class _Listener:
    @hookimpl
    def on_task_instance_running(self, previous_state: Any, task_instance: Any) -> None:
        global _file
        path = log_path(task_instance)
        path.parent.mkdir(parents=True, exist_ok=True)
        with _lock:
            _file = open(path, "a", encoding="utf-8")

    def _close(self) -> None:
        global _file
        with _lock:
            if _file is not None:
                _file.close()
                _file = None

    @hookimpl
    def on_task_instance_success(self, previous_state: Any, task_instance: Any) -> None:
        self._close()

    @hookimpl
    def on_task_instance_failed(self, previous_state: Any, task_instance: Any, error: Any) -> None:
        if error is not None:
            _write("error", "task", f"Task failed: {type(error).__name__}: {error}")
        self._close()


@contextlib.contextmanager
def task_logs_to_files() -> Iterator[None]:
    import structlog
    from airflow.sdk.listener import get_listener_manager

    listener, handler = _Listener(), _Handler(level=logging.INFO)
    manager = get_listener_manager()
    manager.add_listener(listener)
    processors = structlog.get_config()["processors"]
    processors.insert(0, _structlog_tee)  # the list cached loggers share: they see it too
    logging.getLogger().addHandler(handler)
    try:
        yield
    finally:
        logging.getLogger().removeHandler(handler)
        if _structlog_tee in processors:
            processors.remove(_structlog_tee)
        with contextlib.suppress(Exception):
            manager.pm.unregister(listener)
        listener._close()
