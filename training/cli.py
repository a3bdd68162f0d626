"""`python -m training <command>`: make-data, describe-data, validate, train, upload, evaluate, compare, bench.

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

from training.config.fields import ConfigError
from training.config.train_config import MODEL_KIND, TrainConfig, choices
from training.config.fields import help_lines, specs
from training.distributed.launch import EXIT_BAD_INPUT

DATA_FIELDS = ("label_column", "feature_columns", "task", "validation_fraction", "split_seed", "text_column",
               "prompt_column", "response_column", "messages_column")


def _cmd_make_data(a: argparse.Namespace) -> int:
    from training.data.synthetic import (make_digits_dataset, make_instructions_dataset, make_markov_dataset,
                                         make_teacher_dataset, make_text_dataset)

    if a.kind == "digits":
        meta = make_digits_dataset(a.out, seed=a.seed)
    elif a.kind in ("text", "text-classes"):
        meta = make_text_dataset(a.out, labels=a.kind == "text-classes", names=a.kind == "text-classes")
    elif a.kind == "instructions":
        meta = make_instructions_dataset(a.out)
    elif a.kind == "markov":
        meta = make_markov_dataset(a.out, n_train=a.train_rows, n_val=a.val_rows, vocab=a.vocab, seq_len=a.seq_len, seed=a.seed)
    else:
        meta = make_teacher_dataset(a.out, n_train=a.train_rows, n_val=a.val_rows, n_features=a.features,
                                    n_classes=a.classes, label_noise=a.label_noise, seed=a.seed)
    known = {k: meta[k] for k in ("bayes_accuracy", "loss_floor") if k in meta}
    print(json.dumps({"dataset_uri": a.out, "kind": meta["kind"], **known, "rows": meta["rows"]}))
    return 0


def _data_options(a: argparse.Namespace):
    """The data fields given on the command line, checked as the trainer checks them."""
    from training.data.options import DataOptions

    cfg = TrainConfig(dataset_uri=a.dataset_uri, **{f: getattr(a, f) for f in DATA_FIELDS})
    return DataOptions.of(cfg)


def _cmd_validate(a: argparse.Namespace) -> int:
    from training.data.gate import DataValidationError, validate

    try:
        report = validate(a.dataset_uri, options=_data_options(a), min_rows=a.min_rows, docs_dir=a.docs_dir,
                          batch_rows=a.batch_rows)
    except DataValidationError as e:
        print(str(e), file=sys.stderr)
        return EXIT_BAD_INPUT
    print(json.dumps(report))
    return 0


def _cmd_tokenize(a: argparse.Namespace) -> int:
    """Make a text dataset's token windows (what the DAG's tokenize task does) and print where they are."""
    from training.data.dataset import open_dataset
    from training.data.options import DataOptions
    from training.data.tokens import build_for
    from training.models import hf

    cfg = TrainConfig(dataset_uri=a.dataset_uri, tokenizer=a.tokenizer, seq_len=a.seq_len, model=a.model,
                      chat_template=a.chat_template, max_truncated_share=a.max_truncated_share,
                      **{f: getattr(a, f) for f in DATA_FIELDS})
    if not cfg.is_text:
        raise ConfigError("text_column", "is empty", "name the column of documents, e.g. --text-column text (or the "
                          "prompt and response columns, or the messages column, of SFT examples)")
    data = open_dataset(cfg.dataset_uri, DataOptions.of(cfg))
    built, _ = build_for(cfg, data, a.out, model_folder=hf.folder(cfg.model) if hf.is_hf(cfg.model) else None)
    print(json.dumps({"token_shards": built.uri, "cache_hit": built.cache_hit, "splits": built.stats["splits"]}))
    return 0


def _cmd_describe_data(a: argparse.Namespace) -> int:
    """Write a dataset.json from what the data holds: the description and the schema as the gate
    would infer it, to read, tighten and keep (with it, the gate checks both splits against it)."""
    from pathlib import Path

    from training.data.dataset import Dataset
    from training.data.schema import pinned_meta
    from training.data.sources import META_FILE, discover

    layout = discover(a.dataset_uri)
    if a.out is None and a.dataset_uri.startswith("s3://"):
        raise ConfigError("--out", "is needed for an s3:// dataset", f"write it locally, then upload it as {META_FILE}")
    out = Path(a.out) if a.out else Path(a.dataset_uri) / META_FILE
    if out.exists() and not a.force:
        raise ConfigError("--out", f"{out} exists", "pass --force to replace it, or --out another file")
    # Describe the data itself, not the dataset.json it may already have.
    layout.meta = None
    ds = Dataset(layout.require(), _data_options(a))
    meta = pinned_meta(ds.meta, ds.gate_schema(), summary={**layout.summary(ds.options), "fingerprint": ds.fingerprint,
                       "rows": {s: ds.table(s).num_rows for s in ("train", "validation")}}, columns=ds.train_profile())
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(meta, indent=2) + "\n")
    print(json.dumps({"wrote": str(out), "task": meta["task"], "task_reason": meta["task_reason"],
                      "label": meta["label"], "features": len(meta["features"]), **meta["described_from"]["rows"]}))
    return 0


def _cmd_train(a: argparse.Namespace) -> int:
    from training.config.train_config import load_train_config

    cfg = load_train_config(a.config, a.set)
    if a.check_access:
        from training.store import check_writable

        check_writable(cfg.checkpoint_dir, field="checkpoint_dir")
    if a.print_config:
        print(json.dumps(cfg.to_dict(), indent=2))
        return 0
    from training.distributed import parallel
    from training.train import EXIT_PREEMPTED, Preempted, run

    code = 0
    try:
        run(cfg)
    except Preempted as e:
        print(f"train: preempted; checkpoint written at step {e.args[0]}; run again to resume", file=sys.stderr, flush=True)
        code = EXIT_PREEMPTED
    parallel.release()  # the model went with the exception: the group can go now
    return code


def _cmd_upload(a: argparse.Namespace) -> int:
    from training.checkpoint.commit import upload_checkpoint

    c = upload_checkpoint(a.checkpoint, a.store_uri, experiment=a.experiment, run_id=a.run_id)
    print(json.dumps({"uri": c.uri, "uploaded": c.uploaded, "skipped": c.skipped, "seconds": round(c.seconds, 3)}))
    return 0


def _cmd_evaluate(a: argparse.Namespace) -> int:
    from training.evaluate import run

    print(json.dumps(run(store_uri=a.store_uri, experiment=a.experiment, run_id=a.run_id, dataset_uri=a.dataset_uri,
                         options=_data_options(a))))
    return 0


def _cmd_compare(a: argparse.Namespace) -> int:
    from training.results.compare import CompareError, write_report

    try:
        result = write_report(a.experiment, a.out, run_ids=a.runs, last=a.last)
    except CompareError as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    print(json.dumps(result, indent=2))
    return 0


def _cmd_bench(a: argparse.Namespace) -> int:
    from training.results.bench import main

    return main(a)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m training", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)

    s = sub.add_parser("make-data", help="write a dataset whose reachable accuracy or loss is known")
    s.add_argument("--out", required=True, help="folder to write (train/, validation/, dataset.json)")
    s.add_argument("--kind", choices=["teacher", "digits", "markov", "text", "text-classes", "instructions"],
                   default="teacher",
                   help="teacher: tabular (mlp); digits: 8x8 images (cnn); markov: token sequences (transformer); "
                   "text: Python's own help text as documents (transformer, text_column=text); text-classes: the "
                   "same with a label, code (code or grammar) or prose, by name (a text classifier); instructions: "
                   "prompt/response and messages columns over the same text (supervised fine-tuning of an hf: model)")
    s.add_argument("--train-rows", type=int, default=20_000, help="rows in the train split")
    s.add_argument("--val-rows", type=int, default=4_000, help="rows in the validation split")
    s.add_argument("--features", type=int, default=16, help="number of feature columns")
    s.add_argument("--classes", type=int, default=4, help="number of classes")
    s.add_argument("--label-noise", type=float, default=0.1, help="share of labels replaced at random")
    s.add_argument("--vocab", type=int, default=16, help="markov: vocabulary size")
    s.add_argument("--seq-len", type=int, default=32, help="markov: tokens per sequence (plus one target)")
    s.add_argument("--seed", type=int, default=0, help="seed of the generator (teacher network, chain, split)")
    s.set_defaults(fn=_cmd_make_data)

    fields = specs(TrainConfig)

    def data_options(s: argparse.ArgumentParser) -> None:
        """--label-column, --feature-columns, --task, --validation-fraction, --split-seed, as in TrainConfig."""
        for name in DATA_FIELDS:
            spec = fields[name]
            kind = {"number": float, "integer": int}.get(spec.kind, str)
            s.add_argument("--" + name.replace("_", "-"), dest=name, type=kind, default=spec.default,
                           choices=spec.choices, help=f"{spec.help} (default {spec.default})".replace("%", "%%"))

    s = sub.add_parser("describe-data", help="write a dataset.json from the data (description and schema, to pin)",
                       description=_cmd_describe_data.__doc__)
    s.add_argument("dataset_uri", help="dataset folder, Parquet file or s3://bucket/prefix")
    s.add_argument("--out", help="where to write it (default: DATASET_URI/dataset.json)")
    s.add_argument("--force", action="store_true", help="replace an existing file")
    data_options(s)
    s.set_defaults(fn=_cmd_describe_data)

    s = sub.add_parser("validate", help="run the Great Expectations data gate on a dataset")
    s.add_argument("--dataset-uri", required=True, help="dataset folder, Parquet file or s3://bucket/prefix")
    data_options(s)
    s.add_argument("--min-rows", type=int, default=None,
                   help="fewest rows a split may have (default: the dataset schema's min_rows, 100 unless set)")
    s.add_argument("--docs-dir", default=None, help="also build Great Expectations Data Docs (HTML) in this folder")
    s.add_argument("--batch-rows", type=int, default=None,
                   help="check in one pass over the row groups, this many rows at a time (a table whose dataset.json "
                   "names its features; default: when its Parquet files exceed 512 MiB)")
    s.set_defaults(fn=_cmd_validate)

    s = sub.add_parser("tokenize", help="make a text dataset's token windows for training (prints token_shards)",
                       description=_cmd_tokenize.__doc__)
    s.add_argument("--dataset-uri", required=True, help="dataset folder, Parquet file or s3://bucket/prefix")
    data_options(s)
    s.add_argument("--tokenizer", default=fields["tokenizer"].default, help=fields["tokenizer"].help)
    s.add_argument("--seq-len", dest="seq_len", type=int, default=fields["seq_len"].default, help=fields["seq_len"].help)
    s.add_argument("--model", default="transformer", help="the model the windows are for: an hf:<folder> model "
                   "brings its own tokenizer (the default tokenizer then) and chat template")
    s.add_argument("--chat-template", dest="chat_template", default=None, help=fields["chat_template"].help)
    s.add_argument("--max-truncated-share", dest="max_truncated_share", type=float,
                   default=fields["max_truncated_share"].default, help=fields["max_truncated_share"].help)
    s.add_argument("--out", required=True, help="the store to write them to: a folder, file:///folder or s3://bucket/prefix")
    s.set_defaults(fn=_cmd_tokenize)

    s = sub.add_parser("train", help="train (run under torchrun for several ranks)",
                       description=f"Config fields (--set key=value):\n{help_lines(TrainConfig)}",
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
    s.add_argument("--dataset-uri", required=True, help="dataset (its validation split is scored)")
    data_options(s)
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
    s.add_argument("--model", default="mlp",
                   help=f"a built-in family ({', '.join(MODEL_KIND)}) or a factory package.module:function")
    s.add_argument("--worlds", type=int, nargs="+", default=[1, 2], help="world sizes (ranks on this machine)")
    s.add_argument("--strategies", nargs="+", default=["ddp"], choices=choices(TrainConfig, "strategy"))
    s.add_argument("--precisions", nargs="+", default=["fp32"], choices=choices(TrainConfig, "precision"))
    s.add_argument("--comm-hooks", nargs="+", default=["none"], choices=choices(TrainConfig, "comm_hook"))
    s.add_argument("--bucket-caps", type=float, nargs="+", default=[25.0], metavar="MB",
                   help="DDP gradient bucket sizes (bucket_cap_mb) to sweep")
    s.add_argument("--hidden", type=int, help="model width (default: the trainer's)")
    s.add_argument("--depth", type=int, help="layers or blocks (default: the trainer's)")
    s.add_argument("--n-heads", type=int, help="attention heads of the transformer (default: the trainer's)")
    s.add_argument("--repeats", type=int, default=1, help="rounds of the whole grid; the table shows medians")
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
