"""The alert rules (deploy/prometheus/training-alerts.yaml) through Debian's promtool: the file is
valid, every alert fires and stays quiet as its unit tests say, and every metric a rule reads is one
the ranks serve (training/metrics/live.py)."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import yaml

from training.metrics.live import METRICS

RULES_DIR = Path(__file__).resolve().parents[1] / "deploy" / "prometheus"
RULES = RULES_DIR / "training-alerts.yaml"
PROMTOOL = shutil.which("promtool")


def _promtool(*args: str, cwd: Path = RULES_DIR) -> subprocess.CompletedProcess:
    assert PROMTOOL, "promtool is missing: `make prometheus` (or apt-get install -y prometheus) installs it"
    return subprocess.run([PROMTOOL, *args], cwd=cwd, capture_output=True, text=True, timeout=120)


def test_rules_file_is_valid():
    out = _promtool("check", "rules", str(RULES))
    assert out.returncode == 0, out.stdout + out.stderr


def test_every_alert_passes_its_unit_tests():
    out = _promtool("test", "rules", "training-alerts.test.yaml")
    assert out.returncode == 0, out.stdout + out.stderr


def test_every_alert_has_a_runbook_and_a_unit_test():
    alerts = [r for g in yaml.safe_load(RULES.read_text())["groups"] for r in g["rules"]]
    assert {a["alert"] for a in alerts} == {"TrainingStalled", "TrainingLossNaN", "TrainingLossExploding",
                                            "TrainingCheckpointOverdue", "TrainingRankRestarted", "TrainingStraggler",
                                            "TrainingThroughputLow"}
    tested = {t["alertname"] for case in yaml.safe_load((RULES_DIR / "training-alerts.test.yaml").read_text())["tests"]
              for t in case["alert_rule_test"] if t["exp_alerts"]}
    for a in alerts:
        assert a["annotations"]["runbook"].strip(), a["alert"]
        assert a["alert"] in tested, f"{a['alert']} has no unit test where it fires"
        for name in re.findall(r"\btraining_[a-z_]+", a["expr"]):
            assert name in METRICS, f"{a['alert']} reads {name}, which no rank serves"


def test_promtool_catches_a_wrong_expectation(tmp_path):
    """The unit tests can fail: the same file expecting the stall alert 30 s too early does."""
    shutil.copy(RULES, tmp_path / RULES.name)
    text = (RULES_DIR / "training-alerts.test.yaml").read_text().replace("eval_time: 45s\n        alertname: TrainingStalled\n        exp_alerts: []",
                                                                         "eval_time: 15s\n        alertname: TrainingStalled\n        exp_alerts: [{exp_labels: {severity: page}}]")
    (tmp_path / "t.yaml").write_text(text)
    out = _promtool("test", "rules", "t.yaml", cwd=tmp_path)
    assert out.returncode != 0 and "TrainingStalled" in out.stdout + out.stderr
