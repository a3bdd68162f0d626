"""The configuration tables in the README and docs/configuration.md are what the declared fields
generate (scripts/config_docs.py): a field added, renamed or re-described in the code without
`make docs` fails here."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_committed_configuration_tables_match_the_declarations():
    out = subprocess.run([sys.executable, str(ROOT / "scripts" / "config_docs.py"), "--check"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-2000:]


def test_every_trainer_field_is_documented():
    from training.config.train_config import TrainConfig
    from training.config.fields import specs

    doc = (ROOT / "docs" / "configuration.md").read_text()
    assert all(f"| `{name}` |" in doc for name in specs(TrainConfig))
