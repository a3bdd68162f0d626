"""The web UI in a real (headless) browser: log in with the form, open the trigger form of
distributed_training, check that it shows every field and accepts the defaults, that an invalid
value disables Trigger with a message, and save screenshots.

Screenshots go to the test's tmp folder; with UPDATE_SCREENSHOTS=1 (`make screenshots`) they also
replace the ones in docs/images/ that the README shows.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.e2e.browser import Browser, chromium_path
from tests.e2e.live_airflow import PASSWORD

pytestmark = pytest.mark.slow
DOCS_IMAGES = Path(__file__).resolve().parents[2] / "docs" / "images"
DIALOG = "[...document.querySelectorAll('[role=dialog]')].find(d => d.innerText.includes('Run Parameters'))"
TRIGGER_ENABLED = (f"(() => {{ const d = {DIALOG}; const b = d && [...d.querySelectorAll('button')]"
                   ".find(b => b.innerText.trim() === 'Trigger'); return b ? !b.disabled : null; })()")


@pytest.fixture
def browser():
    assert chromium_path(), "chromium is missing: `make test` installs it (apt-get install -y chromium)"
    b = Browser(width=1280, height=900).start()
    try:
        yield b
    finally:
        b.close()


def _keep(path: Path) -> None:
    """With UPDATE_SCREENSHOTS=1, keep a small copy (128-colour palette PNG) in docs/images/."""
    if os.environ.get("UPDATE_SCREENSHOTS") == "1":
        from PIL import Image

        DOCS_IMAGES.mkdir(parents=True, exist_ok=True)
        Image.open(path).convert("RGB").quantize(colors=128).save(DOCS_IMAGES / path.name, optimize=True)


def test_trigger_form_in_the_browser(live_airflow, browser, tmp_path):
    af, b = live_airflow, browser
    af.wait_for_dags("distributed_training")
    details = af.api("GET", "/dags/distributed_training/details").json()

    b.goto(af.base + "/dags/distributed_training")
    b.type_into("input[name=username]", "admin")  # not logged in: the UI sends us to its login form
    b.type_into("input[name=password]", PASSWORD)
    b.press_enter()
    b.wait_for("location.pathname === '/dags/distributed_training'", what="back on the DAG page after login")

    b.click_button("Trigger")
    b.wait_for(f"!!{DIALOG}", what="the trigger form")
    text = b.wait_for(f"{DIALOG}.innerText", what="form text")
    shown = 0
    for name, p in details["params"].items():
        schema = p["schema"]
        if schema.get("section"):  # collapsed under its section heading
            assert schema["section"] in text
            continue
        assert schema["title"] in text and p["description"] in text, name
        shown += 1
    assert shown >= 10
    assert b.wait_for(TRIGGER_ENABLED, timeout=30, what="Trigger enabled") is True, "the defaults must be accepted"
    _keep(b.screenshot(tmp_path / "trigger_form.png"))

    # Numbers are kept inside their limits by the form itself: 0 ranks becomes the minimum, 1.
    field = "input[name=element_world_size]"
    b.eval(f"document.querySelector('{field}').select()")
    b.type_into(field, "0")
    b.eval(f"document.querySelector('{field}').blur()")
    assert b.wait_for(f"document.querySelector('{field}').value === '1'", timeout=30, what="world_size clamped to 1")

    # A value the form cannot judge (a pattern): the server refuses it and no run is created.
    runs_before = len(af.runs("distributed_training"))
    field = "input[name=element_experiment]"
    b.eval(f"document.querySelector('{field}').select()")
    b.type_into(field, "../etc")
    b.click_button("Trigger", within=DIALOG)
    b.wait_for("document.body.innerText.includes('Failed to Trigger Dag')", timeout=60, what="the refusal")
    reason = b.wait_for(f"{DIALOG}.innerText.includes(\"Failed validating 'pattern'\") && {DIALOG}.innerText",
                        what="the server's reason in the form")
    assert "'../etc'" in reason
    assert len(af.runs("distributed_training")) == runs_before
    b.eval(f"document.querySelector('{field}').scrollIntoView({{block: 'center'}})")
    _keep(b.screenshot(tmp_path / "trigger_form_refused.png"))
    assert (tmp_path / "trigger_form.png").stat().st_size > 20_000
