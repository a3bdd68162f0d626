"""`python -m training <command>`: make-data, validate, train, upload, evaluate, compare.

Exit codes other tools script against:
  0  success
  2  bad input (config, CLI arguments, data that failed validation): fix the input, do not retry
 75  preempted (SIGTERM): a checkpoint of the current step was written; run again to resume
  1  anything else (a crash, a store that is down): a retry may help
"""

from __future__ import annotations

import argparse
import json
import sys

from training.config import ConfigError, TrainConfig, choices
from training.fields import help_lines

EXIT_BAD_INPUT = 2


def _cmd_make_data(a: argparse.Namespace) -> int:
    from training.datasets import make_digits_dataset, make_markov_dataset, make_teacher_dataset

    if a.kind == "digits":
        meta = make_digits_dataset(a.out, seed=a.seed)
    elif a.kind == "markov":
        meta = make_markov_dataset(a.out, n_train=a.train_rows, n_val=a.val_rows, vocab=a.vocab, seq_len=a.seq_len, seed=a.seed)
    else:
        meta = make_teacher_dataset(a.out, n_train=a.train_rows, n_val=a.val_rows, n_features=a.features,
                                    n_classes=a.classes, label_noise=a.label_noise, seed=a.seed)
    known = {k: meta[k] for k in ("bayes_accuracy", "loss_floor") if k in meta}
    print(json.dumps({"dataset_uri": a.out, "kind": meta["kind"], **known, "rows": meta["rows"]}))
    return 0


def _cmd_validate(a: argparse.Namespace) -> int:
    from training.validation import DataValidationError, validate

    try:
        report = validate(a.dataset_uri, min_rows=a.min_rows, docs_dir=a.docs_dir)
    except DataValidationError as e:
        print(str(e), file=sys.stderr)
        return EXIT_BAD_INPUT
    print(json.dumps(report))
    return 0


def _cmd_train(a: argparse.Namespace) -> int:
    from training.config import load_train_config

    cfg = load_train_config(a.config, a.set)
    if a.check_access:
        from training.storage import check_writable

        check_writable(cfg.checkpoint_dir, field="checkpoint_dir")
    if a.print_config:
        print(json.dumps(cfg.to_dict(), indent=2))
        return 0
    from training.train import EXIT_PREEMPTED, Preempted, run

    try:
        run(cfg)
    except Preempted as e:
        print(f"train: preempted; checkpoint written at step {e.args[0]}; run again to resume", file=sys.stderr, flush=True)
        return EXIT_PREEMPTED
    return 0


def _cmd_upload(a: argparse.Namespace) -> int:
    from training.storage import upload_checkpoint

    c = upload_checkpoint(a.checkpoint, a.store_uri, experiment=a.experiment, run_id=a.run_id)
    print(json.dumps({"uri": c.uri, "uploaded": c.uploaded, "skipped": c.skipped, "seconds": round(c.seconds, 3)}))
    return 0


def _cmd_evaluate(a: argparse.Namespace) -> int:
    from training.evaluate import run

    print(json.dumps(run(store_uri=a.store_uri, experiment=a.experiment, run_id=a.run_id, dataset_uri=a.dataset_uri)))
    return 0


def _cmd_compare(a: argparse.Namespace) -> int:
    from training.compare import CompareError, write_report

    try:
        result = write_report(a.experiment, a.out, run_ids=a.runs, last=a.last)
    except CompareError as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    print(json.dumps(result, indent=2))
    return 0


def _cmd_bench(a: argparse.Namespace) -> int:
    from training.bench import main

    return main(a)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m training", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)

    s = sub.add_parser("make-data", help="write a dataset whose reachable accuracy or loss is known")
    s.add_argument("--out", required=True, help="folder to write (train/, validation/, dataset.json)")
    s.add_argument("--kind", choices=["teacher", "digits", "markov"], default="teacher",
                   help="teacher: tabular (mlp); digits: 8x8 images (cnn); markov: token sequences (transformer)")
    s.add_argument("--train-rows", type=int, default=20_000, help="rows in the train split")
    s.add_argument("--val-rows", type=int, default=4_000, help="rows in the validation split")
    s.add_argument("--features", type=int, default=16, help="number of feature columns")
    s.add_argument("--classes", type=int, default=4, help="number of classes")
    s.add_argument("--label-noise", type=float, default=0.1, help="share of labels replaced at random")
    s.add_argument("--vocab", type=int, default=16, help="markov: vocabulary size")
    s.add_argument("--seq-len", type=int, default=32, help="markov: tokens per sequence (plus one target)")
    s.add_argument("--seed", type=int, default=0, help="seed of the generator (teacher network, chain, split)")
    s.set_defaults(fn=_cmd_make_data)

    s = sub.add_parser("validate", help="run the Great Expectations data gate on a dataset")
    s.add_argument("--dataset-uri", required=True, help="dataset folder")
    s.add_argument("--min-rows", type=int, default=None,
                   help="fewest rows a split may have (default: the dataset schema's min_rows, 100 unless set)")
    s.add_argument("--docs-dir", default=None, help="also build Great Expectations Data Docs (HTML) in this folder")
    s.set_defaults(fn=_cmd_validate)

    fields = help_lines(TrainConfig)
    s = sub.add_parser("train", help="train (run under torchrun for several ranks)",
                       description=f"Config fields (--set key=value):\n{fields}",
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    s.add_argument("--config", help="JSON file with config fields")
    s.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override one config field")
    s.add_argument("--print-config", action="store_true", help="print the resolved config as JSON and exit")
    s.add_argument("--check-access", action="store_true",
                   help="first list and write checkpoint_dir once: a missing bucket or refused access exits 2")
    s.set_defaults(fn=_cmd_train)

    def store_location(s: argparse.ArgumentParser) -> None:
        s.add_argument("--store-uri", required=True, help="file:///folder or s3://bucket/prefix")
        s.add_argument("--experiment", required=True, help="experiment name (first key part)")
        s.add_argument("--run-id", required=True, help="MLflow run id (second key part)")

    s = sub.add_parser("upload", help="commit a local checkpoint folder to the store (manifest, then latest)")
    s.add_argument("--checkpoint", required=True, help="local step_XXXXXXXX folder with its manifest.json")
    store_location(s)
    s.set_defaults(fn=_cmd_upload)

    s = sub.add_parser("evaluate", help="fetch, verify and score the run's latest checkpoint")
    store_location(s)
    s.add_argument("--dataset-uri", required=True, help="dataset folder (its validation split is scored)")
    s.set_defaults(fn=_cmd_evaluate)

    s = sub.add_parser("compare", help="comparison report (table + plots) of MLflow runs",
                       description="Reads runs from MLFLOW_TRACKING_URI and writes report.md, report.html and PNG plots.")
    s.add_argument("--experiment", required=True, help="MLflow experiment name")
    s.add_argument("--runs", nargs="+", metavar="RUN_ID", help="these runs (default: the last N finished runs)")
    s.add_argument("--last", type=int, default=10, help="how many of the newest finished runs (default 10)")
    s.add_argument("--out", required=True, help="folder for report.md, report.html and the plots")
    s.set_defaults(fn=_cmd_compare)

    s = sub.add_parser("bench", help="benchmark sweep: one child MLflow run per grid point, then the comparison report",
                       description="Runs world size x strategy x precision x comm_hook with torchrun on this machine. "
                                   "Each point is a child run (tag mlflow.parentRunId) of one parent run, which gets "
                                   "the comparison report (report.md/html, plots) as artifacts under comparison/.")
    s.add_argument("--dataset-uri", required=True, help="dataset folder (its kind must match --model)")
    s.add_argument("--experiment", default="training_benchmark", help="MLflow experiment (default training_benchmark)")
    s.add_argument("--model", default="mlp", choices=choices(TrainConfig, "model"), help="model family")
    s.add_argument("--worlds", type=int, nargs="+", default=[1, 2], help="world sizes (ranks on this machine)")
    s.add_argument("--strategies", nargs="+", default=["ddp"], choices=choices(TrainConfig, "strategy"))
    s.add_argument("--precisions", nargs="+", default=["fp32"], choices=choices(TrainConfig, "precision"))
    s.add_argument("--comm-hooks", nargs="+", default=["none"], choices=choices(TrainConfig, "comm_hook"))
    s.add_argument("--steps", type=int, default=100, help="optimizer steps per point")
    s.add_argument("--batch-size", type=int, default=64, help="global batch size")
    s.add_argument("--log-every", type=int, default=10, help="log interval (steps)")
    s.add_argument("--eval-every", type=int, default=0, help="evaluation interval (0 = off)")
    s.add_argument("--target-metric", default="none", choices=choices(TrainConfig, "target_metric"),
                   help="eval/accuracy or eval/loss (needs --eval-every)")
    s.add_argument("--target-value", type=float, default=None, help="value the target metric must reach")
    s.add_argument("--parent-run-id", help="log children under this existing run (default: a new parent run)")
    s.add_argument("--run-name", help="name of a new parent run")
    s.add_argument("--out", help="folder for per-point logs and the report (default: a temporary folder)")
    s.set_defaults(fn=_cmd_bench)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.fn(args)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
