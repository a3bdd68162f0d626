"""Names in a run's conf that are not Params of the DAG are refused before the run starts. Airflow
adds them to the run's Params unchecked, so a typo (``step`` for ``steps``) would start a run on
the defaults. One message (``unknown_fields_error``: the unknown key, the closest Param, the fix)
for the three places that check:

- ``scripts/demo.py --set``, before anything runs (exit code 2);
- ``ConfCheck``, an ASGI middleware the project's plugin (plugins/training_links.py) adds to the
  api-server: a ``POST /api/v2/dags/{dag_id}/dagRuns`` (the REST API, and the web UI's trigger
  form, which posts there) for a DAG of ``CHECKED_DAGS`` gets 400 with the message, no run (and
  so does a training run outside the deployment's policy: ``policy.check``);
- ``open_run``, the first task, for runs made another way (``airflow dags trigger --conf``,
  TriggerDagRunOperator).

Light imports only: the plugin loads this module in every Airflow process.
"""

from __future__ import annotations

import difflib
import json
import logging
import re
from collections.abc import Iterable, Mapping
from typing import Any, Awaitable, Callable

from training.config.fields import ConfigError

log = logging.getLogger(__name__)

# The DAGs of dags/ that have Params (tests/dags checks this list against the DAG folder).
CHECKED_DAGS = frozenset({"distributed_training", "distributed_training_on_data", "register_dataset",
                          "training_benchmark", "training_sweep"})
# The DAGs whose runs the deployment's policy bounds (training_airflow/policy.py).
POLICY_DAGS = frozenset({"distributed_training", "distributed_training_on_data", "training_sweep"})
SWEEP_DAG = "training_sweep"  # its search is checked too: a space the trainer refuses, the policy's sweep bounds
TRIGGER_PATH = re.compile(r"/api/v2/dags/(?P<dag_id>[^/]+)/dagRuns/?$")
MAX_BODY = 1 << 20  # a larger trigger body is passed on unread (Airflow answers it)


def unknown_fields(conf: Mapping[str, Any] | None, known: Iterable[str]) -> list[str]:
    """The keys of ``conf`` that are not in ``known``, in the order they were given."""
    known = set(known)
    return [key for key in (conf or {}) if key not in known]


def unknown_fields_error(conf: Mapping[str, Any] | None, known: Iterable[str], *, dag_id: str) -> ConfigError | None:
    """A ``ConfigError`` naming each key of ``conf`` that is not a Param of ``dag_id`` (``known``),
    the closest Param and the fix; ``None`` when every key is a Param."""
    known = list(known)
    unknown = unknown_fields(conf, known)
    if not unknown:
        return None
    closest = {key: next(iter(difflib.get_close_matches(key, known, n=1)), None) for key in unknown}

    def named(key: str) -> str:
        return f"{key!r} (did you mean {closest[key]!r}?)" if closest[key] else f"{key!r} (no Param is close to it)"

    def fix(key: str) -> str:
        return (f"write {closest[key]!r} if that is what you meant, or leave {key!r} out" if closest[key]
                else f"leave {key!r} out")

    first, *others = unknown
    problem = f"is not a Param of {dag_id}" + (f" (did you mean {closest[first]!r}?)" if closest[first] else "")
    if others:
        problem += f"; nor {'is' if len(others) == 1 else 'are'} {', '.join(named(k) for k in others)}"
    problem += (", so a run would ignore " + ("its value and start with the default" if not others
                                             else "their values and start with the defaults"))
    return ConfigError(first, problem, "; ".join(fix(k) for k in unknown)
                       + " (the Params are the fields of the DAG's trigger form)")


def check_conf(conf: Mapping[str, Any] | None, known: Iterable[str], *, dag_id: str) -> None:
    """Raise ``unknown_fields_error`` when ``conf`` names something that is not a Param."""
    error = unknown_fields_error(conf, known, dag_id=dag_id)
    if error is not None:
        raise error


# --------------------------------------------------------------------------- the api-server


class ConfCheck:
    """ASGI middleware: a trigger (``POST .../api/v2/dags/{dag_id}/dagRuns``) of a DAG in
    ``dag_ids`` whose ``conf`` names something that is not one of the DAG's Params, or (a training
    DAG) asks for something the deployment's policy refuses, is answered 400 with
    ``{"detail": <the message>}``, before Airflow creates a run. Everything else passes
    through untouched, as do triggers of a caller who may not trigger the DAG (Airflow answers
    them 401 or 403 itself) and any the check cannot read (the ``open_run`` backstop remains).

    The Params are those of the DAG's latest serialized version, which Airflow validates the run
    against: read from the metadata DB (``declared``), never by parsing the DAG folder."""

    def __init__(self, app: Callable[..., Awaitable[None]], dag_ids: Iterable[str] = CHECKED_DAGS,
                 declared: Callable[[Any, str], Iterable[str] | None] | None = None,
                 authorized: Callable[[dict, str], Awaitable[bool]] | None = None) -> None:
        self.app = app
        self.dag_ids = frozenset(dag_ids)
        self.declared = declared or _declared_params
        self.authorized = authorized or _may_trigger

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        match = TRIGGER_PATH.search(scope.get("path", "")) if scope["type"] == "http" else None
        if not match or scope.get("method") != "POST" or match["dag_id"] not in self.dag_ids:
            await self.app(scope, receive, send)
            return
        body, receive = await _read_body(receive)
        try:
            error = await self._check(scope, match["dag_id"], body)
        except Exception:  # never a 500 from here: Airflow and open_run still check
            log.exception("conf check of a trigger of %s failed; passing it on", match["dag_id"])
            error = None
        if error is None:
            await self.app(scope, receive, send)
            return
        payload = json.dumps({"detail": str(error)}).encode()
        await send({"type": "http.response.start", "status": 400,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode())]})
        await send({"type": "http.response.body", "body": payload})

    async def _check(self, scope: dict, dag_id: str, body: bytes | None) -> ConfigError | None:
        try:
            conf = json.loads(body).get("conf") if body else None
        except (ValueError, AttributeError):  # not a JSON object: Airflow answers 422
            return None
        conf = {} if conf is None else conf  # the defaults alone are bounded by the policy too
        if not isinstance(conf, dict) or not (conf or dag_id in POLICY_DAGS) or not await self.authorized(scope, dag_id):
            return None
        from starlette.concurrency import run_in_threadpool

        known = await run_in_threadpool(self.declared, scope.get("app"), dag_id)
        if known is None:
            return None
        error = unknown_fields_error(conf, known, dag_id=dag_id)
        if error is None and dag_id in POLICY_DAGS and isinstance(known, Mapping):
            params = {**known, **conf}
            error = _outside_policy(params) or _target_mismatch(params)
        if error is None and dag_id == SWEEP_DAG and isinstance(known, Mapping):
            error = await run_in_threadpool(_bad_search, {**known, **conf})
        return error


def _outside_policy(params: dict[str, Any]) -> ConfigError | None:
    """The ``PolicyError`` of a run's Params (the DAG's defaults and the conf) outside the deployment's policy."""
    from training_airflow import policy, settings

    try:
        policy.check(params, resolve=settings.resolve_path)
    except policy.PolicyError as e:
        return e
    return None


def _bad_search(params: dict[str, Any]) -> ConfigError | None:
    """A sweep's search the trainer or the policy would refuse (a field, a range, a choice, the bounds)."""
    from training_airflow import settings
    from training_airflow.sweep_check import check_search

    try:
        check_search({**params, "dataset_uri": settings.resolve_path(str(params.get("dataset_uri", "")))})
    except ConfigError as e:
        return e
    except (TypeError, ValueError, KeyError):  # a wrong type: Airflow's own validation answers it
        return None
    return None


def _target_mismatch(params: dict[str, Any]) -> ConfigError | None:
    """A ``target_metric`` the run's task cannot log, as far as the fields tell (the data is
    not read here: ``open_run`` checks it against the table's schema)."""
    from training.config.train_config import check_target_task

    target = params.get("target_metric")
    if not isinstance(target, str):  # Airflow's own validation answers a wrong type
        return None
    try:
        sft = params.get("prompt_column") or params.get("messages_column")  # SFT trains a language model
        check_target_task(target, task=str(params.get("task") or "auto"), text_column=params.get("text_column") or None,
                          data_task="language_modeling" if sft else None)
    except ConfigError as e:
        return e
    return None


async def _read_body(receive: Callable) -> tuple[bytes | None, Callable]:
    """The request body (``None`` past ``MAX_BODY``), and a ``receive`` that hands it on again."""
    chunks, size, more = [], 0, True
    while more:
        message = await receive()
        if message["type"] != "http.request":  # the client went away: pass that on
            chunks.append(message)
            break
        chunks.append(message)
        size += len(message.get("body", b""))
        more = message.get("more_body", False)
        if size > MAX_BODY:
            break
    body = None if size > MAX_BODY else b"".join(m.get("body", b"") for m in chunks if m["type"] == "http.request")
    pending = list(chunks)

    async def replay() -> dict:
        return pending.pop(0) if pending else await receive()

    return body, replay


def _declared_params(app: Any, dag_id: str) -> dict[str, Any] | None:
    """The Params of the DAG's latest serialized version and their defaults (``None``: no such DAG,
    Airflow says so)."""
    from airflow.utils.session import create_session

    dag_bag = getattr(getattr(app, "state", None), "dag_bag", None)
    if dag_bag is None:
        from airflow.models.dagbag import DBDagBag

        dag_bag = DBDagBag()
    with create_session() as session:
        dag = dag_bag.get_latest_version_of_dag(dag_id, session=session)
    return None if dag is None else {name: dag.params[name] for name in dag.params}


async def _may_trigger(scope: dict, dag_id: str) -> bool:
    """Whether the caller may trigger ``dag_id``, decided as Airflow's trigger endpoint decides
    (its user from the bearer token or the session cookie, the auth manager's verdict)."""
    from fastapi import HTTPException
    from fastapi.security import HTTPAuthorizationCredentials
    from starlette.concurrency import run_in_threadpool
    from starlette.requests import Request

    from airflow.api_fastapi.app import get_auth_manager
    from airflow.api_fastapi.auth.managers.models.resource_details import DagAccessEntity, DagDetails
    from airflow.api_fastapi.core_api.security import get_user
    from airflow.models.dag import DagModel

    request = Request(scope)
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    bearer = HTTPAuthorizationCredentials(scheme=scheme, credentials=token.strip()) if token.strip() else None
    try:
        user = await get_user(request, None, bearer)
    except HTTPException:
        return False

    def verdict() -> bool:
        details = DagDetails(id=dag_id, team_name=DagModel.get_team_name(dag_id))
        return get_auth_manager().is_authorized_dag(method="POST", access_entity=DagAccessEntity.RUN,
                                                    details=details, user=user)

    return bool(await run_in_threadpool(verdict))
