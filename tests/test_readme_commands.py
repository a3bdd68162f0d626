"""The README's commands, run as a reader runs them: from a shell that has only PATH and HOME
(``env -i``), in the repository root, right after ``make install``. No ``make``, no
``source .venv/bin/activate``: each script sets up its own environment (scripts/project_env.py).

Every command of the README's ``bash`` blocks, and each ``.venv/bin/...`` command its text names,
is either run here (``RUN``, with what it is checked for) or listed in ``NOT_RUN`` with the reason
(servers, clusters, the test suite itself); a command added to the README that is neither fails
the first test. They run in a copy of the repository (its tracked and unignored files, the same
``.venv``), so the defaults they fall back on (``.airflow/``, ``var/``) are the copy's and the
developer's are never touched. A user's own path in a command (``/data/wine``, ``/models/my-gpt2``) and the run ids of
``compare`` are the only words replaced (``PLACEHOLDERS``)."""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.conftest import ROOT

README = ROOT / "README.md"
PATH = "/usr/local/bin:/usr/bin:/bin"

DEMO_WINE = ".venv/bin/python scripts/demo.py --set dataset_uri=/data/wine --set label_column=target"
DEMO_PARAMS = ".venv/bin/python scripts/demo.py --set world_size=1 --set steps=600"
COMPARE = ".venv/bin/python -m training compare --experiment distributed_training --runs RUN_ID RUN_ID --out var/reports/x"
LIBRARY = [  # "The training library on its own", in its order (each needs the one before)
    ".venv/bin/python -m training make-data --out var/data/teacher",
    ".venv/bin/python -m training validate --dataset-uri var/data/teacher",
    ".venv/bin/python -m training describe-data /data/wine --label-column target",
    "GLOO_SOCKET_IFNAME=lo .venv/bin/torchrun --nproc-per-node 2 --master-addr 127.0.0.1 --master-port 29511 "
    "-m training train --set dataset_uri=var/data/teacher --set checkpoint_dir=var/ckpt",
    ".venv/bin/python -m training upload --checkpoint var/ckpt/step_00000300 --store-uri file://$PWD/var/store "
    "--experiment manual --run-id try1",
    ".venv/bin/python -m training evaluate --store-uri file://$PWD/var/store --experiment manual --run-id try1 "
    "--dataset-uri var/data/teacher",
]
TRANSFORMER = [
    ".venv/bin/python -m training make-data --kind markov --out var/data/markov",
    "GLOO_SOCKET_IFNAME=lo .venv/bin/torchrun --nproc-per-node 2 --master-addr 127.0.0.1 --master-port 29512 "
    "--max-restarts 2 -m training train --set dataset_uri=var/data/markov --set model=transformer --set strategy=fsdp "
    "--set precision=bf16 --set checkpoint_dir=var/ckpt-tf --set checkpoint_every=50 --set steps=100",
]
EVAL = ("GLOO_SOCKET_IFNAME=lo .venv/bin/torchrun --nproc-per-node 2 --master-addr 127.0.0.1 --master-port 29513 "
        "-m training train --set dataset_uri=var/data/teacher --set checkpoint_dir=var/ckpt-eval --set eval_every=50 "
        "--set target_metric=eval/accuracy --set target_value=0.8")
BENCH = (".venv/bin/python -m training bench --dataset-uri var/data/teacher --worlds 1 2 --comm-hooks none fp16 "
         "--steps 100 --out var/bench")
VALIDATE_WINE = ".venv/bin/python -m training validate --dataset-uri /data/wine --label-column target"
TEXT_LM = [  # "Train a language model on your text", in its order
    ".venv/bin/python -m training make-data --kind text --out var/data/python-help",
    ".venv/bin/python -m training validate --dataset-uri var/data/python-help --text-column text",
    ".venv/bin/python scripts/demo.py --set dataset_uri=var/data/python-help --set text_column=text --set model=transformer "
    "--set tokenizer=bpe:1024 --set seq_len=64 --set batch_size=32 --set steps=200",  # no target: the demo's is for its table
    ".venv/bin/python scripts/demo.py --set dataset_uri=var/data/python-help --set text_column=text "
    "--set model=hf:/models/my-gpt2 --set seq_len=64 --set batch_size=32 --set steps=50 --set lr=1e-4",
]
# Each command run here -> the test that runs it.
RUN = {VALIDATE_WINE: "test_train_on_your_data", DEMO_WINE: "test_train_on_your_data",
       DEMO_PARAMS: "test_the_demo_with_a_param", "make compare": "test_compare_runs", COMPARE: "test_compare_runs",
       **dict.fromkeys(LIBRARY, "test_the_library_on_its_own"),
       **dict.fromkeys(TRANSFORMER, "test_a_transformer_with_fsdp"),
       EVAL: "test_evaluation_during_training", BENCH: "test_a_benchmark_sweep",
       **dict.fromkeys(TEXT_LM, "test_a_language_model_on_your_text")}

CLUSTER = "needs a Kubernetes cluster and a registry (tests/plugins/test_kubernetes.py and tests/e2e/test_pods.py " \
          "check the objects and run the pods on podman; tests/test_deploy_files.py validates the manifests)"
COMPOSE = "runs the Docker Compose stack (make stack-check does this by hand; tests/test_deploy_files.py checks the file)"
NOT_RUN = {
    "make install": "installs into .venv, which every test already runs in",
    "make demo": "tests/e2e/test_demo.py runs it from a clean shell",
    "make test": "the test suite itself",
    ".venv/bin/python scripts/demo.py --set dataset_uri=var/data/python-help --set text_column=text --set "
    "model=hf:/models/my-llama --set adapter=lora": "the same DAG as the GPT-2 command; tests/e2e/test_hf_pipeline.py "
    "runs LoRA on a Llama-style folder through it, tests/training/test_lora.py the trainer's side",
    ".venv/bin/python -m training make-data --kind instructions": "tests/training/test_sft.py and "
    "tests/e2e/test_hf_pipeline.py make the same table (make_instructions_dataset)",
    ".venv/bin/python scripts/demo.py --set dataset_uri=var/data/instructions": "needs a chat model folder; "
    "tests/e2e/test_hf_pipeline.py runs SFT with LoRA on a Llama-style chat folder through the same DAG",
    ".venv/bin/airflow dags trigger training_sweep": "needs the running scheduler; tests/e2e/test_live_sweep.py "
    "triggers the sweep DAG on the session's live Airflow and tests/plugins/test_conf_check.py checks its search at "
    "trigger time",
    ".venv/bin/python scripts/project_env.py .venv/bin/python benchmarks/gpu_check.py": "needs a CUDA machine; "
    "the --device cpu --small form is run by tests/training/test_gpu_check.py",
    "TEST_BACKGROUND_LOAD=2 .venv/bin/python -m pytest tests/training": "a part of the test suite itself",
    "make airflow-up": "starts Airflow's servers on 127.0.0.1:8080 for as long as one wants them (the tests start "
                       "the same parts on free ports: tests/e2e/live_airflow.py)",
    "make mlflow-ui": "starts an MLflow server on 127.0.0.1:5000 for as long as one wants it (tests/e2e/conftest.py "
                      "mlflow_ui starts it on a free port)",
    "make airflow-down": "stops the servers of make airflow-up",
    "TOKEN=$(curl -s -X POST http://127.0.0.1:8080/auth/token": "needs make airflow-up's server and password "
                                                                "(tests/e2e/test_live_airflow.py triggers over REST)",
    "curl -s -X POST http://127.0.0.1:8080/api/v2/dags/distributed_training/dagRuns": "needs make airflow-up's "
                                                                                      "server (as above)",
    "make images IMAGES=training": "builds the CUDA training image (tests/e2e/test_images.py builds the CPU one)",
    "docker tag ": CLUSTER, "docker push ": CLUSTER, "kubectl apply ": CLUSTER, "kubectl -n training create secret": CLUSTER,
    "airflow dags trigger distributed_training --conf '{\"backend\": \"kubernetes\"": CLUSTER,
    "cp .env.example .env": COMPOSE, "docker compose up -d --build": COMPOSE, "docker compose exec ": COMPOSE,
}


def _strip_comment(line: str) -> str:
    quote = None
    for i, ch in enumerate(line):
        if quote:
            quote = None if ch == quote else quote
        elif ch in "'\"":
            quote = ch
        elif ch == "#" and (i == 0 or line[i - 1].isspace()):
            return line[:i]
    return line


def readme_commands() -> list[str]:
    """The README's commands: each one of its ``bash`` blocks (comments dropped, continued and
    quoted lines joined, spaces collapsed), then each inline code span naming ``.venv/bin/``."""
    text = README.read_text()
    commands = []
    for block in re.findall(r"^ *```bash\n(.*?)^ *```", text, re.S | re.M):
        pending = ""
        for line in block.splitlines():
            pending = f"{pending} {_strip_comment(line).strip()}".strip()
            if pending.endswith("\\"):
                pending = pending[:-1]
                continue
            try:
                shlex.split(pending)
            except ValueError:  # a quote goes on over the next line
                continue
            if pending:
                commands.append(" ".join(pending.split()))
            pending = ""
    prose = re.sub(r"```.*?```", "", text, flags=re.S)
    commands += [" ".join(c.split()) for c in re.findall(r"`([^`\n]*\.venv/bin/[^`\n]*)`", prose)]
    return commands


def test_every_readme_command_is_run_or_says_why_not():
    commands = readme_commands()
    assert len(commands) >= 30, commands  # the parser still finds them
    neither = [c for c in commands if c not in RUN and not any(c.startswith(p) for p in NOT_RUN)]
    assert not neither, ("README commands neither run by tests/test_readme_commands.py nor listed in its NOT_RUN "
                         f"with a reason: {neither}")
    stale = [c for c in [*RUN, *NOT_RUN] if not any(x == c or x.startswith(c) for x in commands)]
    assert not stale, f"no longer in the README (update tests/test_readme_commands.py): {stale}"


def test_the_environment_fills_in_only_what_is_not_set():
    from scripts import project_env

    env = project_env.apply({"AIRFLOW_HOME": "/elsewhere", "TRAINING_VAR_DIR": "/state", "PYTHONPATH": "/mine"})
    assert env["AIRFLOW_HOME"] == "/elsewhere" and env["MLFLOW_TRACKING_URI"] == "sqlite:////state/mlflow/mlflow.db"
    assert env["AIRFLOW__CORE__DAGS_FOLDER"] == str(ROOT / "dags") and env["GLOO_SOCKET_IFNAME"] == "lo"
    assert env["PYTHONPATH"].split(os.pathsep) == [str(ROOT / "plugins"), str(ROOT), "/mine"]
    assert project_env.apply({})["AIRFLOW_HOME"] == str(ROOT / ".airflow")  # the checkout's, when unset
    assert project_env.apply({}, names=project_env.LIBRARY).keys() == set(project_env.LIBRARY)  # python -m training


# --------------------------------------------------------------------------- running them


def _copy_checkout(to: Path) -> Path:
    """The repository's files as a clone has them (no .git, no state, nothing ignored), with the
    same .venv, whose install stamp stays current (make would not reinstall)."""
    ignored = shutil.ignore_patterns(".git", ".venv", ".airflow", "var", "mlruns", "__pycache__", ".pytest_cache",
                                     "*.egg-info", "build", ".env")
    shutil.copytree(ROOT, to, ignore=ignored, symlinks=True)
    (to / ".venv").symlink_to(ROOT / ".venv")
    for name in ("requirements.txt", "constraints.txt", "pyproject.toml"):  # older than .venv/.installed
        os.utime(to / name, (0, 0))
    return to


@pytest.fixture(scope="module")
def checkout(tmp_path_factory):
    """A copy of the checkout, a clean environment, and the user's table the README names as
    /data/wine (scikit-learn's wine table with its label column ``target``, one Parquet file)."""
    from sklearn.datasets import load_wine

    tmp = tmp_path_factory.mktemp("readme")
    wine = tmp / "wine"
    wine.mkdir()
    load_wine(as_frame=True).frame.to_parquet(wine / "wine.parquet", index=False)
    (tmp / "home").mkdir()
    from tests.hf_models import gpt2_folder

    # The README's own Hugging Face folder: weights as save_pretrained writes them, not pretrained
    # (what is checked here is the command; tests/e2e/test_hf_pipeline.py checks what fine-tuning gains).
    gpt2 = gpt2_folder(tmp / "my-gpt2", pretrain_steps=0)
    return {"root": _copy_checkout(tmp / "repo"), "env": {"PATH": PATH, "HOME": str(tmp / "home")},
            "placeholders": {"/data/wine": str(wine), "/models/my-gpt2": str(gpt2)}}


def run(checkout: dict, command: str, *, timeout: float = 600,
        placeholders: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """``command`` as the README writes it, in the copy's root, with only PATH and HOME set."""
    for word, value in {**checkout["placeholders"], **(placeholders or {})}.items():
        command = command.replace(word, value)
    proc = subprocess.run(["bash", "-c", command], cwd=checkout["root"], env=checkout["env"], capture_output=True,
                          text=True, timeout=timeout)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"{command}\nexit {proc.returncode}\n{out[-4000:]}"
    return proc


def _mlflow_run_id(out: str) -> str:
    return re.search(r"MLflow run   : \S+  \((\w{32})\)  status=FINISHED", out)[1]


@pytest.fixture(scope="module")
def demo_runs(checkout) -> dict[str, str]:
    """The README's two demo commands, exactly as written: their output."""
    return {command: run(checkout, command).stdout for command in (DEMO_WINE, DEMO_PARAMS)}


@pytest.mark.slow
def test_train_on_your_data(checkout, demo_runs):
    validated = run(checkout, VALIDATE_WINE).stdout
    assert '"success": true' in validated and '"validation"' in validated, validated[-2000:]
    out = demo_runs[DEMO_WINE]
    assert re.search(r"DAG run      : \S+  state=\S*success", out), out[-3000:]
    assert _mlflow_run_id(out)
    # the copy's own state, where a clone keeps it: Airflow's home and the MLflow store under the root
    assert (checkout["root"] / ".airflow" / "airflow.db").is_file()
    assert f"Tracking URI : sqlite:///{checkout['root'] / 'var' / 'mlflow' / 'mlflow.db'}" in out


@pytest.mark.slow
def test_the_demo_with_a_param(demo_runs):
    out = demo_runs[DEMO_PARAMS]
    assert re.search(r"MLflow run   : mlp-ddp-fp32-1rank-600steps  \(\w{32}\)  status=FINISHED", out), out[-3000:]


@pytest.mark.slow
def test_compare_runs(checkout, demo_runs):
    """`make compare` and `python -m training compare` read the store the demo wrote to (the copy's
    var/mlflow/mlflow.db) with nothing set in the shell."""
    run(checkout, "make compare")
    assert (checkout["root"] / "var" / "reports" / "distributed_training" / "report.md").is_file()
    ids = " ".join(_mlflow_run_id(out) for out in demo_runs.values())
    run(checkout, COMPARE, placeholders={"RUN_ID RUN_ID": ids})
    assert (checkout["root"] / "var" / "reports" / "x" / "report.md").is_file()


@pytest.mark.slow
def test_the_library_on_its_own(checkout):
    for command in LIBRARY:
        run(checkout, command)
    assert (Path(checkout["placeholders"]["/data/wine"]) / "dataset.json").is_file()  # describe-data wrote it
    assert list((checkout["root"] / "var" / "store" / "manual" / "try1").glob("step_00000300/manifest.json"))


@pytest.mark.slow
def test_a_transformer_with_fsdp(checkout):
    for command in TRANSFORMER:
        run(checkout, command)
    assert (checkout["root"] / "var" / "ckpt-tf" / "step_00000100").is_dir()  # the last of the README's 100 steps


def _teacher_data(checkout: dict) -> None:
    if not (checkout["root"] / "var" / "data" / "teacher").is_dir():
        run(checkout, LIBRARY[0])  # the data the README made in the block before


@pytest.mark.slow
def test_evaluation_during_training(checkout):
    _teacher_data(checkout)
    trained = run(checkout, EVAL)
    out = trained.stdout + trained.stderr
    assert re.search(r"target eval/accuracy 0\.8 reached at step \d+", out) and "eval step 300:" in out, out[-3000:]


@pytest.mark.slow
def test_a_benchmark_sweep(checkout):
    _teacher_data(checkout)
    run(checkout, BENCH)
    assert (checkout["root"] / "var" / "bench" / "report" / "report.md").is_file()


@pytest.mark.slow
@pytest.mark.budget(360, reason="four README commands in a row: make text, validate it, a full DAG run of a "
                                 "transformer on it, then a fine-tune")
def test_a_language_model_on_your_text(checkout):
    made, validated, trained, tuned = (run(checkout, command).stdout for command in TEXT_LM)
    assert '"kind": "text"' in made and '"success": true' in validated, validated[-2000:]
    assert re.search(r"DAG run      : \S+  state=\S*success", trained), trained[-3000:]
    assert re.search(r"Evaluation   : bits_per_byte [0-9.]+, perplexity", trained), trained[-3000:]
    assert re.search(r"MLflow run   : my-gpt2-ddp-fp32-2ranks-50steps  \(\w{32}\)  status=FINISHED", tuned), tuned[-3000:]
