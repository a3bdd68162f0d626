"""The GPU path in one command: the project's trainer under torchrun (nccl on CUDA) with FSDP2, bf16
and activation checkpointing on a decoder of >= 100M parameters, killed mid-run and resumed, and a
DDP run whose gradient communication is timed with CUDA events; ONE JSON report on stdout.

    .venv/bin/python benchmarks/gpu_check.py                  # a CUDA machine: every GPU it has
    .venv/bin/python benchmarks/gpu_check.py --device cpu --small   # gloo on CPU, a small decoder (make test)

Three runs of ``python -m training train`` (the real entry, fields as ``--set``), each relaying its
MLflow calls to stdout (``TRAINING_MLFLOW_RELAY=stdout``), which this script reads:

- ``fsdp``: strategy=fsdp precision=bf16 activation_checkpointing=full: the backend the ranks
  used, parameters, steady step time, tokens/s and MFU (log windows after the first), peak memory;
- ``resume``: the same run, one rank SIGKILLed after a step past the mid-run checkpoint
  (``TRAINING_FAULT_KILL_AT_STEP``) and restarted by torchrun: its ``model.safetensors`` and its
  per-step losses must equal the ``fsdp`` run's bit for bit;
- ``comm``: strategy=ddp with the same model: collectives per step, time in flight and the exposed
  part; on CUDA the exposed time comes from CUDA events on the compute stream (CommTimer), on CPU
  from the CPU clock (``timed_with``).

On CPU the three runs go side by side (most of each is start-up); on CUDA one after another, so
that each has the GPUs to itself. ``ok`` is true when every check passed; ``problems`` says which
did not. Exit code 0 when ok.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

FULL = {"hidden": 1024, "depth": 8, "n_heads": 16, "seq_len": 512, "vocab": 256, "steps": 30, "per_rank_batch": 8}
SMALL = {"hidden": 32, "depth": 2, "n_heads": 4, "seq_len": 16, "vocab": 16, "steps": 6, "per_rank_batch": 4}


def _relayed(output: str) -> dict:
    """The MLflow calls a run relayed: metric series by key, params, summary figures."""
    from training.tracking.relay import RELAY_PREFIX

    metrics: dict[str, list[tuple[int, float]]] = {}
    params: dict[str, str] = {}
    summary: dict[str, float] = {}
    for line in output.splitlines():
        if not line.startswith(RELAY_PREFIX):
            continue
        call = json.loads(line[len(RELAY_PREFIX):])
        name, args, kwargs = call["call"], call["args"], call["kwargs"]
        if name in ("log_metrics", "log_metrics_once"):
            for k, v in args[0].items():
                metrics.setdefault(k, []).append((int(kwargs.get("step", args[1] if len(args) > 1 else 0)), float(v)))
        elif name == "log_params":
            params.update({k: str(v) for k, v in args[0].items()})
        elif name == "log_summary":
            summary.update(args[0])
    return {"metrics": metrics, "params": params, "summary": summary}


def _median(relayed: dict, key: str) -> float | None:
    values = [v for _, v in relayed["metrics"].get(key, [])]
    return statistics.median(values) if values else None


def _start(name: str, sets: dict, *, nproc: int, work: Path, env: dict, max_restarts: int = 0) -> subprocess.Popen:
    from training.distributed.launch import torchrun_command
    from training.util import free_port

    args = [a for k, v in sets.items() for a in ("--set", f"{k}={v}")]
    args += ["--set", f"checkpoint_dir={work / name / 'ck'}", "--set", f"output_dir={work / name / 'out'}"]
    cmd = torchrun_command(args, nproc_per_node=nproc, master_port=free_port(), max_restarts=max_restarts)
    full_env = {k: v for k, v in os.environ.items() if k != "MLFLOW_RUN_ID"}
    # A run id turns rank 0's relay on; the relay never contacts MLflow, it only prints the calls.
    full_env.update({"TRAINING_MLFLOW_RELAY": "stdout", "MLFLOW_RUN_ID": f"gpu-check-{name}",
                     "OMP_NUM_THREADS": full_env.get("OMP_NUM_THREADS", "1"), **env})
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=full_env)


def _finish(name: str, proc: subprocess.Popen, work: Path, problems: list[str], timeout: float) -> dict:
    try:
        output, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        output, _ = proc.communicate()
        problems.append(f"{name}: did not finish in {timeout:.0f} s")
    (work / f"{name}.log").write_text(output)
    if proc.returncode != 0:
        problems.append(f"{name}: exit code {proc.returncode}; last lines: {output[-600:]!r}")
    out = work / name / "out"
    summary_file = out / "train_summary.json"
    return {"relayed": _relayed(output), "summary": json.loads(summary_file.read_text()) if summary_file.is_file() else {},
            "out": out, "final": work / name / "ck"}


def _losses(out: Path, last_attempt_only: bool) -> dict[int, str]:
    from training.metrics.steps import StepLog

    records = StepLog.read(out)
    if last_attempt_only and records:
        records = [r for r in records if r["attempt"] == records[-1]["attempt"]]
    return {r["step"]: r["loss"] for r in records}


def _weights_diff(a: Path, b: Path) -> float:
    """Largest absolute difference between two exported models, tensor by tensor."""
    from safetensors import safe_open

    worst = 0.0
    with safe_open(a, "pt") as fa, safe_open(b, "pt") as fb:
        if sorted(fa.keys()) != sorted(fb.keys()):
            return float("inf")
        for k in fa.keys():
            worst = max(worst, float((fa.get_tensor(k).double() - fb.get_tensor(k).double()).abs().max()))
    return worst


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", choices=["cuda", "cpu"], default=None, help="default: cuda when there is one")
    ap.add_argument("--small", action="store_true", help=f"a small decoder and few steps: {SMALL}")
    ap.add_argument("--nproc", type=int, default=None, help="ranks (default: every GPU; 2 on CPU)")
    for k in FULL:
        ap.add_argument("--" + k.replace("_", "-"), dest=k, type=int, default=None)
    ap.add_argument("--work", default=None, help="folder for data, checkpoints and logs (default: a temporary one)")
    ap.add_argument("--timeout", type=float, default=1800, help="seconds per run")
    a = ap.parse_args()

    import torch

    cuda = torch.cuda.is_available() if a.device is None else a.device == "cuda"
    if cuda and not torch.cuda.is_available():
        print(json.dumps({"ok": False, "problems": ["--device cuda: torch sees no CUDA device"]}))
        return 1
    size = {**(SMALL if a.small else FULL), **{k: getattr(a, k) for k in FULL if getattr(a, k) is not None}}
    nproc = a.nproc or (torch.cuda.device_count() if cuda else 2)
    steps = size["steps"]
    every = steps // 2
    work = Path(a.work) if a.work else Path(tempfile.mkdtemp(prefix="gpu-check-"))
    work.mkdir(parents=True, exist_ok=True)
    env = {} if cuda else {"CUDA_VISIBLE_DEVICES": ""}

    from training.data.synthetic import make_markov_dataset

    batch = size["per_rank_batch"] * nproc
    make_markov_dataset(work / "data", n_train=max(256, batch * steps), n_val=64, vocab=size["vocab"],
                        seq_len=size["seq_len"], seed=0)
    base = {"dataset_uri": work / "data", "model": "transformer", "hidden": size["hidden"], "depth": size["depth"],
            "n_heads": size["n_heads"], "precision": "bf16", "activation_checkpointing": "full", "steps": steps,
            "batch_size": batch, "log_every": max(1, steps // 3), "warmup_steps": 0, "eval_every": 0}
    runs = {
        "fsdp": (dict(base, strategy="fsdp", checkpoint_every=every), {}, 0),
        "resume": (dict(base, strategy="fsdp", checkpoint_every=every),
                   {"TRAINING_FAULT_KILL_AT_STEP": f"{every + 1}:{nproc - 1}"}, 1),
        "comm": (dict(base, strategy="ddp", checkpoint_every=0), {}, 0),
    }
    problems: list[str] = []
    done = {}
    if cuda:  # one at a time: each run has the GPUs to itself
        for name, (sets, extra, restarts) in runs.items():
            done[name] = _finish(name, _start(name, sets, nproc=nproc, work=work, env={**env, **extra},
                                              max_restarts=restarts), work, problems, a.timeout)
    else:  # side by side: start-up dominates on CPU
        procs = {name: _start(name, sets, nproc=nproc, work=work, env={**env, **extra}, max_restarts=restarts)
                 for name, (sets, extra, restarts) in runs.items()}
        done = {name: _finish(name, p, work, problems, a.timeout) for name, p in procs.items()}

    fsdp, resume, comm = done["fsdp"], done["resume"], done["comm"]
    rel = fsdp["relayed"]
    params = rel["params"]
    final = f"step_{steps:08d}/model.safetensors"
    same_bytes = ((fsdp["final"] / final).is_file() and (resume["final"] / final).is_file()
                  and (fsdp["final"] / final).read_bytes() == (resume["final"] / final).read_bytes())
    ref_losses, resumed_losses = _losses(fsdp["out"], False), _losses(resume["out"], True)
    same_losses = bool(resumed_losses) and all(ref_losses.get(s) == v for s, v in resumed_losses.items())
    comm_rel = comm["relayed"]
    report = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": "cuda" if cuda else "cpu",
        "gpu": torch.cuda.get_device_name(0) if cuda else None,
        "torch": torch.__version__,
        "world_size": nproc,
        "backend": params.get("backend"),
        "model": {"family": "transformer", "n_params": int(params.get("n_params", 0)), "hidden": size["hidden"],
                  "depth": size["depth"], "n_heads": size["n_heads"], "seq_len": size["seq_len"],
                  "vocab": size["vocab"]},
        "fsdp": {"strategy": params.get("strategy"), "precision": params.get("precision"),
                 "activation_checkpointing": params.get("activation_checkpointing"), "steps": steps,
                 "global_batch": batch, "step_s": _median(rel, "perf/step_s"),
                 "tokens_per_s": _median(rel, "perf/tokens_per_s"), "mfu": _median(rel, "perf/mfu"),
                 "flops_per_sample": float(params.get("perf/flops_per_sample", 0)),
                 "peak_mem_bytes_max": fsdp["summary"].get("peak_mem_bytes_max"),
                 "train_wall_s": fsdp["summary"].get("train_wall_s"), "final_loss": fsdp["summary"].get("last_logged_loss")},
        "resume": {"killed_after_step": every + 1, "checkpoint_every": every,
                   "restarts": resume["summary"].get("restarts"), "resumed_from": resume["summary"].get("resumed_from"),
                   "model_bytes_identical": same_bytes, "losses_identical": same_losses,
                   "steps_compared": len(resumed_losses),
                   "max_abs_weight_diff": (_weights_diff(fsdp["final"] / final, resume["final"] / final)
                                           if (fsdp["final"] / final).is_file() and (resume["final"] / final).is_file()
                                           else None)},
        "comm": {"strategy": comm_rel["params"].get("strategy"), "timed_with": "cuda_events" if cuda else "cpu_clock",
                 "collectives_per_step": _median(comm_rel, "comm/collectives_per_step"),
                 "bytes_per_step": _median(comm_rel, "comm/bytes_per_step"),
                 "exposed_s_per_step": _median(comm_rel, "comm/exposed_s_per_step"),
                 "exposed_fraction": _median(comm_rel, "comm/exposed_fraction"),
                 "in_flight_s_per_step": _median(comm_rel, "comm/s_per_step"),
                 "step_s": _median(comm_rel, "perf/step_s")},
        "work": str(work),
    }
    expected_backend = "nccl" if cuda else "gloo"
    if report["backend"] != expected_backend:
        problems.append(f"backend {report['backend']!r}, expected {expected_backend}")
    if not a.small and report["model"]["n_params"] < 100_000_000:
        problems.append(f"the decoder has {report['model']['n_params']} parameters, under 100M")
    if not (report["fsdp"]["mfu"] or 0) > 0:
        problems.append("no MFU was measured")
    if not (same_bytes and same_losses and report["resume"]["restarts"] == 1):
        problems.append("the resumed run is not bit-identical to the uninterrupted one")
    if not (report["comm"]["collectives_per_step"] or 0) > 0 or report["comm"]["exposed_s_per_step"] is None:
        problems.append("no gradient communication was timed")
    report["problems"] = problems
    report["ok"] = not problems
    print(json.dumps(report, indent=2))
    if not a.work and report["ok"]:
        shutil.rmtree(work, ignore_errors=True)
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
