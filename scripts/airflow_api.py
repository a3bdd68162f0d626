"""One client for Airflow 3's public REST API (``/api/v2``), for the scripts and the tests: the official
``apache-airflow-client`` package's generated API classes (DAGApi, DagRunApi, TaskInstanceApi, XComApi,
...) behind the few calls they make, logged in to the simple auth manager with a JWT.

    from airflow_api import AirflowAPI          # scripts/*.py, run as scripts (scripts/ on sys.path)
    from scripts.airflow_api import AirflowAPI  # tests (the repository root on sys.path)

A run, a task instance or a DAG's details comes back as the API's JSON (a plain dict), the way the
callers index it. An answer outside 2xx raises the client's ApiException (BadRequestException for
a trigger the DAG's Params refuse, ...); the waits outlive a server that does not answer yet.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from typing import Any

import urllib3
from airflow_client.client import (ApiClient, ApiException, ClearTaskInstancesBody, ClearTaskInstancesBodyTaskIdsInner,
                                   Configuration, DAGApi, DAGPatchBody, DagRunApi, ImportErrorApi, MonitorApi,
                                   TaskInstanceApi, TriggerDAGRunPostBody, XComApi)
from airflow_client.client.exceptions import NotFoundException, ServiceException

# What a poll outlives: no answer (refused, reset, timed out) or a 5xx while the server (re)starts.
TRANSIENT = (urllib3.exceptions.HTTPError, ServiceException)


class _Client(ApiClient):
    """The generated client with a timeout on every request (its default is none: a hung server hangs the caller)."""

    def __init__(self, configuration: Configuration, timeout: float) -> None:
        super().__init__(configuration)
        self.timeout = timeout

    def call_api(self, method, url, header_params=None, body=None, post_params=None, _request_timeout=None):
        return super().call_api(method, url, header_params, body, post_params, _request_timeout or self.timeout)


def _plain(model: Any) -> dict[str, Any]:
    """A response model as the API's JSON (strings for states and dates)."""
    return model.model_dump(mode="json", by_alias=True)


def _json(response: Any) -> Any:
    """The JSON of a raw response (the client's or urllib3's); ApiException outside 2xx, as generated calls raise."""
    body = response.read()
    if not 200 <= response.status < 300:
        raise ApiException.from_response(http_resp=response, body=body.decode(errors="replace"), data=None)
    return json.loads(body)


class AirflowAPI:
    """Airflow's REST API at ``base`` (``http://host:port``) as ``username`` of the simple auth manager.
    ``on_poll`` runs before every poll of the waits (raise there to stop waiting: a part died)."""

    def __init__(self, base: str, username: str, password: str, *, timeout: float = 60,
                 on_poll: Callable[[], None] | None = None) -> None:
        self.base = base.rstrip("/")
        self.username, self.password = username, password
        self.on_poll = on_poll
        # No retries inside a call (urllib3 would resend, and log each time): the waits poll again instead.
        self.client = _Client(Configuration(host=self.base, retries=0), timeout)
        self._token: str | None = None

    def token(self) -> str:
        if self._token is None:
            # The official client has no call for POST /auth/token (the auth manager's, outside the /api/v2
            # spec it is generated from): one request through its transport, the JWT becomes its access token.
            r = self.client.call_api("POST", f"{self.base}/auth/token", {"Content-Type": "application/json"},
                                     {"username": self.username, "password": self.password}, _request_timeout=30)
            self._token = self.client.configuration.access_token = _json(r)["access_token"]
        return self._token

    def _api(self, cls):
        self.token()
        return cls(self.client)

    def _wait(self, probe: Callable[[], Any], timeout: float, every: float, failure: Callable[[str], str],
              tolerate: tuple[type[BaseException], ...] = TRANSIENT) -> Any:
        """probe() until it returns something truthy; TimeoutError(failure(last error)) after ``timeout`` s."""
        deadline, last = time.monotonic() + timeout, ""
        while True:
            if self.on_poll:
                self.on_poll()
            try:
                if value := probe():
                    return value
            except tolerate as e:
                last = f"{type(e).__name__}: {str(e)[:500]}"
            if time.monotonic() >= deadline:
                raise TimeoutError(failure(last))
            time.sleep(every)

    # ------------------------------------------------------------------ the server, DAGs
    def wait_until_up(self, timeout: float = 300, every: float = 1) -> None:
        """Return once the api-server is healthy and logs us in (a starting server may refuse either)."""
        self._wait(lambda: MonitorApi(self.client).get_health(_request_timeout=5) and self.token(), timeout, every,
                   lambda last: f"{self.base}: not healthy with a token after {timeout:.0f}s (last: {last})",
                   tolerate=(*TRANSIENT, ApiException))

    def _parsed(self, dag_id: str) -> bool:
        try:
            return self._api(DAGApi).get_dag(dag_id) is not None
        except NotFoundException:
            return False

    def wait_for_dags(self, *dag_ids: str, timeout: float = 240, every: float = 2) -> None:
        missing = list(dag_ids)

        def parsed() -> bool:
            missing[:] = [d for d in missing if not self._parsed(d)]
            return not missing

        self._wait(parsed, timeout, every, lambda last: f"DAGs {missing} not parsed after {timeout:.0f}s; import "
                   f"errors: {self.import_errors()}" + (f" (last: {last})" if last else ""))

    def import_errors(self) -> dict[str, str]:
        return {e.filename: e.stack_trace for e in self._api(ImportErrorApi).get_import_errors().import_errors}

    def dag_details(self, dag_id: str) -> dict[str, Any]:
        return _plain(self._api(DAGApi).get_dag_details(dag_id))

    def unpause(self, dag_id: str) -> None:
        self._api(DAGApi).patch_dag(dag_id, DAGPatchBody(is_paused=False))

    # ------------------------------------------------------------------ runs
    def trigger(self, dag_id: str, conf: dict[str, Any], *, note: str | None = None) -> str:
        """A manual run now (no logical date) with ``conf``; its dag_run_id."""
        body = TriggerDAGRunPostBody(logical_date=None, conf=conf, note=note)
        return self._api(DagRunApi).trigger_dag_run(dag_id, body).dag_run_id

    def run(self, dag_id: str, run_id: str) -> dict[str, Any]:
        return _plain(self._api(DagRunApi).get_dag_run(dag_id, run_id))

    def runs(self, dag_id: str, *, run_type: str | None = None) -> list[dict[str, Any]]:
        found = self._api(DagRunApi).get_dag_runs(dag_id, run_type=[run_type] if run_type else None)
        return [_plain(r) for r in found.dag_runs]

    def wait_for_run(self, dag_id: str, run_id: str, *, timeout: float = 600, every: float = 2) -> dict[str, Any]:
        """The run once it ended (success or failed); TimeoutError naming its tasks' states."""
        run: dict[str, Any] = {}

        def ended() -> bool:
            run.update(self.run(dag_id, run_id))
            return run["state"] in ("success", "failed")

        self._wait(ended, timeout, every, lambda last: f"{dag_id}/{run_id} still {run.get('state')} after "
                   f"{timeout:.0f}s: {self.task_states(dag_id, run_id)}" + (f" (last: {last})" if last else ""))
        return run

    def clear(self, dag_id: str, run_id: str, task_ids: list[str], *, downstream: bool = True) -> None:
        """What "Clear task (and downstream)" in the UI does: the tasks run again as a new try."""
        ids = [ClearTaskInstancesBodyTaskIdsInner(t) for t in task_ids]
        body = ClearTaskInstancesBody(dry_run=False, dag_run_id=run_id, task_ids=ids, include_downstream=downstream,
                                      only_failed=False, reset_dag_runs=True)
        self._api(TaskInstanceApi).post_clear_task_instances(dag_id, body)

    # ------------------------------------------------------------------ tasks
    def task_instances(self, dag_id: str, run_id: str) -> list[dict[str, Any]]:
        return [_plain(ti) for ti in self._api(TaskInstanceApi).get_task_instances(dag_id, run_id).task_instances]

    def task_states(self, dag_id: str, run_id: str) -> dict[str, str | None]:
        return {ti["task_id"]: ti["state"] for ti in self.task_instances(dag_id, run_id)}

    def try_numbers(self, dag_id: str, run_id: str) -> dict[str, int]:
        return {ti["task_id"]: ti["try_number"] for ti in self.task_instances(dag_id, run_id)}

    def xcom(self, dag_id: str, run_id: str, task_id: str, key: str = "return_value") -> Any:
        return self._api(XComApi).get_xcom_entry(dag_id, task_id, run_id, key).actual_instance.value

    def extra_links(self, dag_id: str, run_id: str, task_id: str) -> dict[str, str]:
        return self._api(TaskInstanceApi).get_extra_links(dag_id, run_id, task_id).extra_links

    def task_log(self, dag_id: str, run_id: str, task_id: str, try_number: int = 1, map_index: int | None = None) -> str:
        """The task's log of that try as text: each record's event, and an exception's type and value
        (``map_index``: which of a mapped task's instances)."""
        # The raw JSON: the generated model of a record keeps its event and timestamp only (validating
        # the list of records drops the other fields, an exception's error_detail among them).
        body = _json(self._api(TaskInstanceApi).get_log_without_preload_content(dag_id, run_id, task_id, try_number,
                                                                                  map_index=map_index))
        content = body.get("content", body)
        if not isinstance(content, list):
            return str(content)
        lines = []
        for entry in content:  # structured log records (or plain lines); an exception's text is in error_detail
            if not isinstance(entry, dict):
                lines.append(str(entry))
                continue
            lines.append(str(entry.get("event", "")))
            lines += [f"{d.get('exc_type')}: {d.get('exc_value')}" for d in entry.get("error_detail") or []]
        return "\n".join(lines)
