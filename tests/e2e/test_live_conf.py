"""A trigger whose conf names something that is not a Param is refused by the live api-server (the
plugin's middleware, training_airflow/conf_check.py) with 400, naming the key and the closest
Param, and no run is created; a caller who may not trigger gets Airflow's own answer."""

from __future__ import annotations

import json

import pytest
import requests
from airflow.api_fastapi.auth.managers.base_auth_manager import COOKIE_NAME_JWT_TOKEN
from airflow_client.client.exceptions import BadRequestException

from tests.e2e.conftest import TRAIN

pytestmark = pytest.mark.slow


def test_an_unknown_conf_key_is_refused_with_400_naming_the_closest_param(live_airflow):
    af = live_airflow
    af.wait_for_dags(TRAIN)
    before = len(af.runs(TRAIN))
    for conf, key, closest in (({"label_col": "target"}, "label_col", "label_column"),
                               ({"steps": 20, "step": 600}, "step", "steps")):
        with pytest.raises(BadRequestException) as refused:
            af.trigger(TRAIN, conf)
        detail = json.loads(refused.value.body)["detail"]
        assert detail.startswith(f"config field '{key}': is not a Param of {TRAIN} (did you mean '{closest}'?)"), detail
    # The web UI's form posts there with the session cookie instead of a bearer token: refused alike.
    url = f"{af.base}/api/v2/dags/{TRAIN}/dagRuns"
    form = requests.post(url, json={"logical_date": None, "conf": {"step": 600}}, cookies={COOKIE_NAME_JWT_TOKEN: af.token()},
                         headers={"Referer": f"{af.base}/dags/{TRAIN}"}, timeout=60)
    assert form.status_code == 400 and "(did you mean 'steps'?)" in form.json()["detail"], form.text
    # Without a token the middleware stays out of the way: Airflow's own 401, not the field list.
    anonymous = requests.post(url, json={"conf": {"step": 600}}, timeout=60)
    assert anonymous.status_code == 401, anonymous.text
    assert len(af.runs(TRAIN)) == before, "a refused trigger creates no DAG run"
