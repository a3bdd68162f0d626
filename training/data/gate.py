"""The data gate: Great Expectations 1.x suites, one per split, against the dataset's schema.

    python -m training validate --dataset-uri var/data/teacher [--label-column y] [--min-rows N] [--docs-dir DIR]
        [--batch-rows N]

``gate`` opens the dataset (training/data/sources.py), takes its schema from ``dataset.json`` or
infers it from train (training/data/schema.py), runs each split's suite (training/data/expectations.py)
and returns the verdict: one line per failed expectation with what was observed, the files' sha256s
and fingerprint, and ``data_schema`` (what the data is); GX Data Docs with ``docs_dir``. Any failure,
a dataset that cannot be opened or described included, raises ``DataValidationError`` (``.report``).
``gate_cached`` reuses a passed verdict for the same bytes, options, schema, gate code and GX version.
Tables larger than memory (over ``BATCH_BYTES`` of Parquet) are checked in one pass over their row
groups (a schema to infer: after a pass for train's profile; training/data/gate_batched.py), in the
same GX context and with the same wording of the verdict's lines (training/data/verdict.py).
Why: docs/decisions/0002-vectorized-gate-checks.md, docs/decisions/0003-keep-passed-gate-verdicts.md.
"""

from __future__ import annotations

import hashlib
import logging
import os
from dataclasses import asdict
from pathlib import Path
from typing import Any

from training.data.batches import Totals
from training.data.dataset import Dataset
from training.data.expectations import build_suite
from training.data.gate_batched import batched, inferred_in_batches, rows_per_batch
from training.data.sft import checks as sft_checks
from training.data.text import text_checks
from training.config.fields import ConfigError
from training.data.schema import (  # noqa: F401 (the gate's schema types, importable from here too)
    DTYPE_FAMILIES,
    NUMERIC,
    DatasetSchema,
    SchemaError,
    class_shares,
    infer_schema,
    schema_from_meta,
)
from training.data.options import DataOptions
from training.data.verdict import failure, unreadable
from training.data.sources import SPLITS, TABLE, discover
from training.data.sources import fingerprint as files_fingerprint
from training.util import sha256_file

# GX logs a line per expectation at INFO; the verdict we print is the readable summary.
logging.getLogger("great_expectations").setLevel(logging.WARNING)


class DataValidationError(ValueError):
    """The dataset failed the gate. ``report`` holds the full verdict."""

    def __init__(self, report: dict[str, Any]):
        self.report = report
        lines = [f"data validation failed for {report['dataset_uri']}:"] + [f"  - {f}" for f in report["failures"]]
        super().__init__("\n".join(lines))


def fingerprint(root: str | Path) -> str:
    """The data fingerprint of a dataset (sha256 over every data file's path and sha256)."""
    return files_fingerprint(discover(str(root)).all_files)


# --------------------------------------------------------------------------- the gate


def validate(dataset: str | Path | Dataset, **kwargs: Any) -> dict[str, Any]:
    """The verdict of ``gate``; raises DataValidationError on failure."""
    return gate(dataset, **kwargs)[0]


def gate(dataset: str | Path | Dataset, *, options: DataOptions | None = None, env: dict[str, str] | None = None,
         min_rows: int | None = None, docs_dir: str | Path | None = None,
         batch_rows: int | None = None) -> tuple[dict[str, Any], Dataset]:
    """Run the suite on every split. Returns the verdict and the opened dataset (its splits read
    once, for the caller to go on with); raises DataValidationError on failure.

    ``dataset``: a dataset_uri (opened with ``options`` and the S3 settings ``env``) or an opened
    ``Dataset``. ``min_rows`` overrides the schema's minimum; ``docs_dir`` builds GX Data Docs
    (HTML) there. The verdict (also on failure, in ``DataValidationError.report``): ``success``,
    ``failures`` (readable lines), ``failed_expectations`` (split, expectation, column, observed),
    ``rows`` per split, ``files`` (path, size, sha256), ``fingerprint``, ``schema`` (what was
    checked), ``data_schema`` (what the data is), ``data_docs``.

    A table over ``BATCH_BYTES`` of Parquet (or any, with ``batch_rows``) is checked in one pass
    over its row groups instead of whole splits (``gate_batched.batched``; a schema inferred from train's
    profile, itself a pass first); the verdict then carries ``batched`` (rows per batch, batches,
    seconds).
    """
    uri = dataset.uri if isinstance(dataset, Dataset) else str(dataset)
    report: dict[str, Any] = {"dataset_uri": uri, "success": False, "failures": [], "failed_expectations": [],
                              "rows": {}, "files": [], "fingerprint": None}

    def fail(line: str, **extra: Any) -> None:
        report["failures"].append(line)
        report["failed_expectations"].append({"line": line, **extra})

    ds, tables, schema = _open(dataset, options, env, report, fail, batch_rows)
    if min_rows is not None:
        schema.min_rows = int(min_rows)
    report["schema"] = {"kind": schema.kind, **schema.to_dict()}
    if tables is not None:
        report["data_schema"] = _data_schema(ds, schema, report)

    import great_expectations as gx
    from great_expectations.data_context.types.base import ProgressBarsConfig

    context = gx.get_context(mode="ephemeral")
    # Progress bars are noise in a task log (and carriage returns in a file).
    context.variables.progress_bars = ProgressBarsConfig(globally=False)
    if docs_dir is not None:
        context.add_data_docs_site(site_name="gate", site_config={
            "class_name": "SiteBuilder", "site_index_builder": {"class_name": "DefaultSiteIndexBuilder"},
            "store_backend": {"class_name": "TupleFilesystemStoreBackend", "base_directory": str(docs_dir)}})
    source = context.data_sources.add_pandas("pandas")
    text_lines: list[str] = []
    if tables is None:  # data larger than memory: one pass over the row groups
        train_totals = batched(ds, schema, rows_per_batch(ds, batch_rows), context, source, report, fail)
        report["data_schema"] = _data_schema(ds, schema, report, train_totals)
        tables = {}
    if schema.kind == "text" and ds.meta.get("sft"):  # examples: answers, roles, assistant turns
        text_lines, report["sft"] = sft_checks(tables, ds.meta["sft"])
    elif schema.kind == "text":  # what a suite of column expectations cannot say about documents
        text_lines, report["text"], tables = text_checks(tables, ds.meta["text_column"])
    for split, table in tables.items():
        # One pandas block per column: no copy into a 2-D block, and column access (GX touches
        # every column many times) stays a cheap view.
        df = table.to_pandas(split_blocks=True)
        suite = context.suites.add(build_suite(schema, name=f"{schema.kind}_{split}", dtypes=dict(df.dtypes), rows=len(df)))
        batch_def = source.add_dataframe_asset(name=split).add_batch_definition_whole_dataframe("all")
        vd = context.validation_definitions.add(gx.ValidationDefinition(name=split, data=batch_def, suite=suite))
        result = vd.run(batch_parameters={"dataframe": df})
        del df
        for r in result.results:
            if not r.success:
                f = failure(split, r, schema)
                fail(f.pop("line"), **f)
    for line in text_lines:
        fail(line)
    if docs_dir is not None:
        context.build_data_docs(site_names=["gate"])
        index = Path(docs_dir) / "index.html"
        report["data_docs"] = str(index) if index.is_file() else None
    report["success"] = not report["failures"]
    if report["success"]:
        return report, ds
    raise DataValidationError(report)


def _open(dataset, options, env, report: dict[str, Any], fail,
          batch_rows: int | None = None) -> tuple[Dataset, dict[str, Any] | None, DatasetSchema]:
    """The dataset, its readable splits (Arrow tables; None when it is to be checked in batches)
    and the schema to check them against; every problem that stops the gate before GX is a
    failure line (then DataValidationError)."""
    def stop() -> DataValidationError:
        return DataValidationError(report)

    try:
        ds = dataset if isinstance(dataset, Dataset) else Dataset(discover(str(dataset), env=env), options or DataOptions())
    except ConfigError as e:  # no such folder, bucket or object; an unreadable dataset.json
        fail(str(e))
        raise stop() from None
    try:
        declared = ds.declared_schema()
    except (SchemaError, TypeError, ValueError) as e:
        fail(f"dataset.json: {e}")
        raise stop() from None
    for problem in ds.layout.problems:
        split = next((s for s in SPLITS if problem.startswith(f"{s}:")), None)
        fail(problem if split else f"dataset_uri: {problem}", split=split)
    if ds.layout.problems:
        raise stop()
    report["files"] = [{"path": f.path, "size": f.size, "sha256": f.sha256} for f in ds.layout.all_files]
    report["fingerprint"] = ds.fingerprint
    rows = rows_per_batch(ds, batch_rows)
    if rows:
        return ds, None, declared if declared is not None else inferred_in_batches(ds, rows, report, fail, stop)
    tables: dict[str, Any] = {}
    for split in SPLITS:
        try:
            tables[split] = ds.table(split)
            report["rows"][split] = tables[split].num_rows
        except Exception as e:  # corrupt / truncated / empty file: pyarrow raises several types
            where = "table" if TABLE in ds.layout.files else split
            fail(unreadable(where, e), split=split)
            if TABLE in ds.layout.files:
                break
    if "train" not in tables:
        raise stop()
    try:
        schema = declared if declared is not None else ds.gate_schema()
    except ConfigError as e:  # the table cannot be described: no label column, a single class...
        fail(str(e), field=e.field)
        raise stop() from None
    return ds, tables, schema


def _data_schema(ds: Dataset, schema: DatasetSchema, report: dict[str, Any], totals: Totals | None = None) -> dict[str, Any]:
    """What the data is, for the run (``data_schema.json``): where the rows came from, the
    description (label, features, task and why), train's columns, the classes and their shares
    (from ``totals``, train's batched pass, when the splits were not read whole)."""
    out: dict[str, Any] = {"fingerprint": ds.fingerprint, **ds.layout.summary(ds.options), "rows": report["rows"]}
    try:
        d = ds.meta
    except ConfigError:  # a dataset.json schema without a description (another kind of data)
        d = None
    except (OSError, ValueError):  # train's footers unreadable (pyarrow's errors): the batched pass said so
        d = None
    if d is not None:
        out["description"] = {k: d[k] for k in ("kind", "source", "label", "task", "task_reason", "features",
                                                "n_classes", "classes", "normalize", "ignored_columns") if k in d}
        if d.get("label") and d.get("task") == "classification":
            classes = d.get("classes") or list(range(int(d["n_classes"])))
            if totals is None:
                out["classes"] = class_shares(ds.table("train").column(d["label"]), classes)
            else:
                total = max(1, totals.rows)
                out["classes"] = [{"class": c, "rows": totals.labels.get(c, 0),
                                   "share": round(totals.labels.get(c, 0) / total, 6)} for c in classes]
    out["train_columns"] = ds.train_profile() if totals is None else totals.profile()
    out["schema_source"] = "dataset.json" if ds.declared_schema() is not None else "inferred from the train split"
    out["schema"] = schema.to_dict()
    return out


# --------------------------------------------------------------------------- verdicts kept between runs


def gate_key(ds: Dataset, min_rows: int | None = None) -> str:
    """What a verdict depends on: the data files' bytes (the fingerprint), ``dataset.json``, the
    options that turn the table into training data, the gate's code (this module, the pass in
    batches, the verdict's wording, the schema and the table reader), the Great Expectations
    version and ``min_rows``."""
    import json
    from importlib.metadata import version

    from training.data import batches, expectations, gate_batched, options, schema, sources, split, text, verdict

    h = hashlib.sha256()
    for part in (ds.fingerprint, json.dumps(ds.layout.meta, sort_keys=True, default=str),
                 json.dumps(asdict(ds.options), sort_keys=True, default=str),
                 *(sha256_file(Path(m.__file__)) for m in (batches, expectations, gate_batched, options, schema, sources,
                                                           split, text, verdict)),
                 sha256_file(Path(__file__)),
                 version("great_expectations"), str(min_rows)):
        h.update(part.encode() + b"\0")
    return h.hexdigest()


def gate_cached(dataset: str | Path, *, cache_dir: str | Path, options: DataOptions | None = None,
                env: dict[str, str] | None = None, min_rows: int | None = None,
                docs_dir: str | Path | None = None) -> tuple[dict[str, Any], Dataset]:
    """``gate``, run once per dataset content and suite: a passed verdict (and its Data Docs) is
    kept in ``cache_dir`` under ``gate_key`` and returned again while neither the data bytes, the
    options, ``dataset.json``, the gate's code nor GX changed (opening and hashing the files is all
    a repeat costs; the suite itself, with GX's import, takes seconds). The returned verdict then
    carries ``cached_from`` (when and where that verdict was reached). A failed verdict is never
    kept: the gate runs again and reports afresh."""
    import json
    import shutil
    import time

    try:
        ds = Dataset(discover(str(dataset), env=env), options or DataOptions())
        key = None if ds.layout.problems else gate_key(ds, min_rows)
    except (ConfigError, OSError):  # no such folder, unreadable files: the gate itself says what is wrong
        key = None
    if key is None:
        return gate(dataset, options=options, env=env, min_rows=min_rows, docs_dir=docs_dir)
    entry = Path(cache_dir) / key
    try:
        report = json.loads((entry / "report.json").read_text())
    except (OSError, ValueError):
        report = None
    if report is not None and docs_dir is not None and not (entry / "data_docs" / "index.html").is_file():
        report = None  # kept without Data Docs, wanted with them: run the gate once more
    if report is not None:
        report["cached_from"] = {"validated_unix": report.pop("validated_unix", None),
                                 "dataset_uri": report["dataset_uri"]}
        report["dataset_uri"] = str(dataset)
        report["data_docs"] = None
        if docs_dir is not None:
            shutil.copytree(entry / "data_docs", docs_dir, dirs_exist_ok=True)
            report["data_docs"] = str(Path(docs_dir) / "index.html")
        return report, ds
    report, ds = gate(ds, min_rows=min_rows, docs_dir=docs_dir)  # raises when it fails
    tmp = Path(cache_dir) / f".{key}.{os.getpid()}.tmp"
    try:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        if report.get("data_docs"):
            # The HTML and style sheet; GX's bundled fonts and images (~4 MB) are not kept.
            shutil.copytree(docs_dir, tmp / "data_docs", ignore=shutil.ignore_patterns("fonts", "images"))
        (tmp / "report.json").write_text(json.dumps({**report, "validated_unix": time.time()}))
        shutil.rmtree(entry, ignore_errors=True)  # one kept without Data Docs
        tmp.rename(entry)  # whole entries only; a concurrent writer's entry is as good as ours
    except OSError as e:
        shutil.rmtree(tmp, ignore_errors=True)
        logging.getLogger(__name__).warning("data gate verdict not cached in %s (%s)", cache_dir, e)
    return report, ds
