"""The data gate: Great Expectations 1.x suites built from the schema in ``dataset.json``.

    python -m training validate --dataset-uri var/data/teacher [--min-rows N] [--docs-dir /tmp/gx-docs]

The schema comes from the dataset itself, so every dataset kind (tabular, images, tokens) is
checked by the same code. ``dataset.json`` either carries an explicit ``schema`` section::

    "schema": {
      "columns": [
        {"name": "f0",    "dtype": "float", "min": -6.0, "max": 6.0},
        {"name": "label", "dtype": "int",   "values": [0, 1, 2, 3]}
      ],
      "label": "label",                 # optional: enables the class-balance check
      "min_rows": 100,                  # fewest rows a split may have
      "max_duplicate_fraction": 0.01,   # share of rows that are exact copies of another row
      "class_fraction": [0.025, 0.9]    # every label value's share of rows lies in this range
    }

or names a ``kind`` whose schema is derived from the generic fields every generator writes
(``SCHEMA_FROM_META``: ``tabular``, ``images`` and ``tokens`` from ``features``, ``feature_dtype``,
``feature_range``, ``label``, ``n_classes``). A kind with neither is refused with a message
saying what to add.

Each split is read with pyarrow and checked by one suite: exact column set, dtypes, no nulls (NaN
counts as null), no inf (column min/max within the declared or the float range), label values in
the allowed set or range, minimum rows, duplicate-row fraction, per-class share. Range checks use
the column min/max (vectorized) instead of GX's per-value ``expect_column_values_to_be_between``,
which calls a Python function per value and takes seconds on a million rows.

The verdict names every failed expectation with what was observed, one line each, and carries a
fingerprint of the data (sha256 of every file, row counts). With ``docs_dir`` GX's own Data Docs
(HTML) are built there from the stored validation results. ``validate_cached`` keeps a passed
verdict for the same bytes, schema, gate code and GX version.

One module past 400 lines: the schema, the suite, the gate and the key of a kept verdict change
together (that key hashes this file, so any change to the gate invalidates every kept verdict).
"""

from __future__ import annotations

import hashlib
import logging
import math
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

from training.datasets import SPLITS, read_meta
from training.util import sha256_file

# GX logs a line per expectation at INFO; the verdict we print is the readable summary.
logging.getLogger("great_expectations").setLevel(logging.WARNING)

# dtype family -> the pandas/numpy dtype names GX's type check accepts for it.
DTYPE_FAMILIES: dict[str, list[str]] = {
    "float": ["float16", "float32", "float64", "Float32Dtype", "Float64Dtype"],
    "int": ["int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64",  # + pandas nullable ints:
            "Int8Dtype", "Int16Dtype", "Int32Dtype", "Int64Dtype", "UInt8Dtype", "UInt16Dtype", "UInt32Dtype", "UInt64Dtype"],
    "bool": ["bool", "BooleanDtype"],
    "string": ["object", "str", "StringDtype"],
}
NUMERIC = ("float", "int")


class DataValidationError(ValueError):
    """The dataset failed the gate. ``report`` holds the full verdict."""

    def __init__(self, report: dict[str, Any]):
        self.report = report
        lines = [f"data validation failed for {report['dataset_uri']}:"] + [f"  - {f}" for f in report["failures"]]
        super().__init__("\n".join(lines))


class SchemaError(ValueError):
    """``dataset.json`` declares no usable schema."""


# --------------------------------------------------------------------------- schema


@dataclass(kw_only=True)
class ColumnSchema:
    name: str
    dtype: str
    min: float | None = None
    max: float | None = None
    values: list[Any] | None = None
    nullable: bool = False


@dataclass(kw_only=True)
class DatasetSchema:
    kind: str
    columns: list[ColumnSchema]
    label: str | None = None
    min_rows: int = 100
    max_duplicate_fraction: float = 0.01
    class_fraction: tuple[float, float] | None = None

    @classmethod
    def from_dict(cls, kind: str, d: dict[str, Any]) -> "DatasetSchema":
        if not isinstance(d.get("columns"), list) or not d["columns"]:
            raise SchemaError("schema.columns must be a non-empty list of {name, dtype, ...}")
        cols = []
        for c in d["columns"]:
            if not isinstance(c, dict) or "name" not in c or "dtype" not in c:
                raise SchemaError(f"schema column {c!r} needs at least 'name' and 'dtype'")
            unknown = set(c) - {f.name for f in ColumnSchema.__dataclass_fields__.values()}
            if unknown:
                raise SchemaError(f"schema column {c['name']!r} has unknown keys {sorted(unknown)}")
            col = ColumnSchema(**c)
            if col.dtype not in DTYPE_FAMILIES:
                raise SchemaError(f"schema column {col.name!r}: dtype {col.dtype!r} is unknown; use one of {sorted(DTYPE_FAMILIES)}")
            if (col.min is not None or col.max is not None) and col.dtype not in NUMERIC:
                raise SchemaError(f"schema column {col.name!r}: min/max apply to numeric dtypes only")
            cols.append(col)
        names = [c.name for c in cols]
        label = d.get("label")
        if label is not None and label not in names:
            raise SchemaError(f"schema.label {label!r} is not one of the columns {names}")
        cf = d.get("class_fraction")
        if cf is not None:
            if label is None or len(cf) != 2 or not 0 <= cf[0] <= cf[1] <= 1:
                raise SchemaError("schema.class_fraction must be [min, max] within [0, 1] and needs schema.label")
            cf = (float(cf[0]), float(cf[1]))
        dup = float(d.get("max_duplicate_fraction", 0.01))
        if not 0 <= dup <= 1:
            raise SchemaError("schema.max_duplicate_fraction must be within [0, 1]")
        return cls(kind=kind, columns=cols, label=label, min_rows=int(d.get("min_rows", 100)),
                   max_duplicate_fraction=dup, class_fraction=cf)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d.pop("kind")
        d["class_fraction"] = list(self.class_fraction) if self.class_fraction else None
        d["columns"] = [{k: v for k, v in c.items() if v is not None and (k != "nullable" or v)} for c in d["columns"]]
        return d

    def label_values(self) -> list[Any] | None:
        col = next((c for c in self.columns if c.name == self.label), None)
        if col is None:
            return None
        if col.values is not None:
            return list(col.values)
        if col.dtype == "int" and col.min is not None and col.max is not None:
            return list(range(int(col.min), int(col.max) + 1))
        return None


def schema_from_fields(meta: dict[str, Any]) -> dict[str, Any]:
    """Schema from the generic ``dataset.json`` fields every generator writes: ``features``,
    ``feature_dtype`` (float|int), ``feature_range``, ``label`` (a column or null) and ``n_classes``."""
    lo, hi = meta["feature_range"]
    dtype = meta.get("feature_dtype", "float")
    schema: dict[str, Any] = {
        "columns": [{"name": f, "dtype": dtype, "min": lo, "max": hi} for f in meta["features"]],
        "min_rows": 100,
        "max_duplicate_fraction": 0.01,
    }
    if meta.get("label") is not None:
        n = int(meta["n_classes"])
        schema["columns"].append({"name": meta["label"], "dtype": "int", "values": list(range(n))})
        schema["label"] = meta["label"]
        # Every class holds at least a tenth of its uniform share, and none more than 90% of rows.
        schema["class_fraction"] = [round(0.1 / n, 6), 0.9]
    return schema


# Kinds whose schema is derived from their dataset.json fields. Any dataset can instead carry an
# explicit "schema" section (tighter bounds, other columns, a new kind).
SCHEMA_FROM_META: dict[str, Callable[[dict[str, Any]], dict[str, Any]]] = {
    "tabular": schema_from_fields, "images": schema_from_fields, "tokens": schema_from_fields}


def schema_from_meta(meta: dict[str, Any]) -> DatasetSchema:
    kind = meta.get("kind", "tabular")
    if "schema" in meta:
        return DatasetSchema.from_dict(kind, meta["schema"])
    derive = SCHEMA_FROM_META.get(kind)
    if derive is None:
        raise SchemaError(f"kind {kind!r} has no 'schema' section; add one (columns with dtypes and ranges, "
                          "min_rows, max_duplicate_fraction, class_fraction)")
    try:
        return DatasetSchema.from_dict(kind, derive(meta))
    except KeyError as e:
        raise SchemaError(f"kind {kind!r} needs the field {e.args[0]!r} (or an explicit 'schema' section)") from None


# --------------------------------------------------------------------------- fingerprint


def data_files(root: str | Path) -> list[dict[str, Any]]:
    """Every data file under ``root`` with its size and sha256."""
    root = Path(root)
    out = []
    for p in sorted(root.rglob("*.parquet")):
        out.append({"path": p.relative_to(root).as_posix(), "size": p.stat().st_size, "sha256": sha256_file(p)})
    return out


def fingerprint(root: str | Path, files: list[dict[str, Any]] | None = None) -> str:
    """One sha256 over every data file's relative path and sha256: what exactly was trained on."""
    h = hashlib.sha256()
    for f in files if files is not None else data_files(root):
        h.update(f"{f['path']}\0{f['sha256']}\n".encode())
    return h.hexdigest()


# --------------------------------------------------------------------------- suite


_CUSTOM: dict[str, Any] = {}


def _custom_expectations() -> dict[str, Any]:
    """Two GX expectations GX 1.x lacks, defined once (GX registers expectation and metric classes
    by name when the class is created) and only when GX is imported.

    - ``expect_column_class_fractions_to_be_between``: every class's share of rows within bounds.
      The built-in KL-divergence expectation needs a partition object and reports one divergence,
      not which class is off; this one reads GX's ``column.value_counts`` metric and reports shares.
    - ``expect_rows_to_be_unique``: the built-in compound-unique check, but on a 64-bit hash per row
      (pandas ``hash_pandas_object``) instead of ``DataFrame.duplicated`` over every column, which
      factorizes each float column and takes seconds on a million rows. A hash collision could only
      count two distinct rows as duplicates (never hide one); at 1e6 rows its chance is ~3e-8.
    """
    if _CUSTOM:
        return _CUSTOM
    from typing import ClassVar, Optional

    from great_expectations.execution_engine import PandasExecutionEngine
    from great_expectations.expectations.core.expect_compound_columns_to_be_unique import (
        ExpectCompoundColumnsToBeUnique,
    )
    from great_expectations.expectations.expectation import ColumnAggregateExpectation
    from great_expectations.expectations.metrics.map_metric_provider import MulticolumnMapMetricProvider
    from great_expectations.expectations.metrics.map_metric_provider.multicolumn_condition_partial import (
        multicolumn_condition_partial,
    )

    class ExpectColumnClassFractionsToBeBetween(ColumnAggregateExpectation):
        """Every value of ``value_set`` makes up between ``min_fraction`` and ``max_fraction`` of the rows."""

        value_set: list
        min_fraction: float
        max_fraction: float

        metric_dependencies: ClassVar[tuple[str, ...]] = ("column.value_counts",)
        success_keys: ClassVar[tuple[str, ...]] = ("value_set", "min_fraction", "max_fraction")
        args_keys: ClassVar[tuple[str, ...]] = ("column", "value_set", "min_fraction", "max_fraction")

        def _validate(self, metrics: dict, runtime_configuration: Optional[dict] = None, execution_engine=None):
            counts = metrics["column.value_counts"]
            total = int(counts.sum())
            shares = {str(v): (int(counts.get(v, 0)) / total if total else 0.0) for v in self.value_set}
            off = {k: round(s, 4) for k, s in shares.items() if not self.min_fraction <= s <= self.max_fraction}
            return {"success": total > 0 and not off,
                    "result": {"observed_value": {k: round(s, 4) for k, s in shares.items()},
                               "details": {"out_of_bounds": off}}}

    class RowsUniqueByHash(MulticolumnMapMetricProvider):
        condition_metric_name = "multicolumn_values.unique_by_row_hash"
        condition_domain_keys = ("batch_id", "table", "column_list", "row_condition", "condition_parser",
                                 "ignore_row_if")

        @multicolumn_condition_partial(engine=PandasExecutionEngine)
        def _pandas(cls, column_list, **kwargs):
            import pandas as pd

            return ~pd.util.hash_pandas_object(column_list, index=False).duplicated(keep=False)

    class ExpectRowsToBeUnique(ExpectCompoundColumnsToBeUnique):
        """Rows (over ``column_list``) are unique; ``mostly`` bounds the share of duplicated rows."""

        map_metric = "multicolumn_values.unique_by_row_hash"

    _CUSTOM.update(class_fractions=ExpectColumnClassFractionsToBeBetween, rows_unique=ExpectRowsToBeUnique,
                   _metric=RowsUniqueByHash)
    return _CUSTOM


def build_suite(schema: DatasetSchema, *, name: str, dtypes: dict[str, Any] | None = None, rows: int | None = None):
    """The GX suite for one split.

    ``dtypes`` (the split's column -> dtype) and ``rows`` keep the verdict to the root causes: a
    missing column is reported once (by the column-set check), not once per check on it; range
    checks run only on columns that are numeric; an empty split gets only the table checks.
    """
    import great_expectations as gx
    import great_expectations.expectations as gxe
    import numpy as np
    from pandas.api import types as pd_types

    names = [c.name for c in schema.columns]
    have = set(dtypes if dtypes is not None else names)
    if rows == 0:
        have = set()
    # Built as one list: ExpectationSuite.add_expectation compares each new expectation with every
    # earlier one (quadratic, a noticeable share of the gate's time at ~40 expectations per split).
    ex: list[Any] = [gxe.ExpectTableColumnsToMatchSet(column_set=names, exact_match=True),
                     gxe.ExpectTableRowCountToBeBetween(min_value=schema.min_rows)]
    for c in schema.columns:
        if c.name not in have:
            continue
        if not c.nullable:
            ex.append(gxe.ExpectColumnValuesToNotBeNull(column=c.name))
        ex.append(gxe.ExpectColumnValuesToBeInTypeList(column=c.name, type_list=DTYPE_FAMILIES[c.dtype]))
        actual = dtypes.get(c.name) if dtypes is not None else None
        numeric = actual is None or pd_types.is_numeric_dtype(actual) and not pd_types.is_bool_dtype(actual)
        if c.dtype in NUMERIC and numeric and (c.dtype == "float" or c.min is not None or c.max is not None):
            big = float(np.finfo(np.float64).max)
            lo = c.min if c.min is not None else -big  # float columns: at least finite (no inf)
            hi = c.max if c.max is not None else big
            ex.append(gxe.ExpectColumnMinToBeBetween(column=c.name, min_value=lo, max_value=hi))
            ex.append(gxe.ExpectColumnMaxToBeBetween(column=c.name, min_value=lo, max_value=hi))
        if c.values is not None:
            ex.append(gxe.ExpectColumnValuesToBeInSet(column=c.name, value_set=list(c.values)))
    if set(names) <= have:
        # Every row of a duplicate group (the original too) counts as duplicated.
        ex.append(_custom_expectations()["rows_unique"](column_list=names, mostly=1.0 - schema.max_duplicate_fraction))
    labels = schema.label_values()
    if schema.class_fraction and schema.label in have and labels:
        ex.append(_custom_expectations()["class_fractions"](
            column=schema.label, value_set=labels, min_fraction=schema.class_fraction[0], max_fraction=schema.class_fraction[1]))
    suite = gx.ExpectationSuite(name=name, expectations=ex)
    return suite


def _plain(v: Any) -> Any:
    """GX results hold numpy scalars, NaN and pandas NA; make them JSON- and human-friendly."""
    if v is None or type(v).__name__ == "NAType":
        return "null"
    if hasattr(v, "item") and not isinstance(v, (list, dict)):
        try:
            v = v.item()
        except (ValueError, AttributeError):
            pass
    if isinstance(v, float) and math.isnan(v):
        return "NaN"
    if isinstance(v, float) and math.isinf(v):
        return "inf" if v > 0 else "-inf"
    if isinstance(v, (list, tuple)):
        return [_plain(x) for x in v]
    if isinstance(v, dict):
        return {str(k): _plain(x) for k, x in v.items()}
    return v


def _one_line(text: str) -> str:
    """Error texts from readers can hold newlines and raw bytes; a verdict line holds neither."""
    text = " ".join(text.split())
    return "".join(c if c.isprintable() else f"\\x{ord(c):02x}" for c in text)


def _failure(split: str, r, schema: DatasetSchema) -> dict[str, Any]:
    """One failed expectation: structured, plus a readable line naming column and observation."""
    cfg = r.expectation_config
    kw = cfg.kwargs
    res = r.result or {}
    col = kw.get("column")
    if cfg.type == "expect_rows_to_be_unique":
        col = "all columns"
    observed: Any = None
    if r.exception_info and r.exception_info.get("raised_exception"):
        seen = f"could not run: {_one_line(str(r.exception_info.get('exception_message')))}"
    elif cfg.type == "expect_table_columns_to_match_set":
        mism = (res.get("details") or {}).get("mismatched") or {}
        observed = _plain(res.get("observed_value"))
        parts = [f"missing {mism['missing']}" if mism.get("missing") else "",
                 f"unexpected {mism['unexpected']}" if mism.get("unexpected") else ""]
        seen = ", ".join(p for p in parts if p) or f"observed {observed}"
    elif cfg.type == "expect_rows_to_be_unique":
        n, total = res.get("unexpected_count", 0), res.get("element_count", 0)
        observed = round(n / total, 6) if total else None
        seen = (f"{n} of {total} rows are duplicated ({100 * (observed or 0):.2f}%, "
                f"allowed {100 * schema.max_duplicate_fraction:.2f}%)")
    elif cfg.type == "expect_column_class_fractions_to_be_between":
        observed = _plain(res.get("observed_value"))
        off = _plain((res.get("details") or {}).get("out_of_bounds"))
        seen = f"class shares {off or observed} outside [{kw['min_fraction']}, {kw['max_fraction']}]"
    elif cfg.type == "expect_column_values_to_be_in_type_list" and "observed_value" in res:
        observed = _plain(res["observed_value"])
        family = next((f for f, names in DTYPE_FAMILIES.items() if names == list(kw.get("type_list") or [])), None)
        seen = f"observed dtype {observed}, expected {family or kw.get('type_list')}"
    elif res.get("unexpected_count"):
        observed = res["unexpected_count"]
        seen = f"{observed} bad values"
        # Examples of a null check are all null: they say nothing the count does not.
        examples = [e for e in (_plain(v) for v in res.get("partial_unexpected_list") or []) if e not in ("NaN", "null")][:3]
        if examples:
            seen += f", e.g. {examples}"
    elif "observed_value" in res:
        observed = _plain(res["observed_value"])
        bounds = {k: _plain(kw[k]) for k in ("min_value", "max_value") if kw.get(k) is not None
                  and abs(kw[k]) < 1e300}
        seen = f"observed {observed}" + (f", allowed {bounds}" if bounds else "")
    else:
        seen = "failed"
    line = f"{split}: {cfg.type}{f'({col})' if col else ''}: {seen}"
    return {"split": split, "expectation": cfg.type, "column": col, "observed": observed, "line": line}


# --------------------------------------------------------------------------- the gate


def validate(dataset_uri: str, *, min_rows: int | None = None, docs_dir: str | Path | None = None) -> dict[str, Any]:
    """Run the suite on every split. Returns the verdict; raises DataValidationError on failure.

    ``min_rows`` overrides the schema's minimum; ``docs_dir`` builds GX Data Docs (HTML) there.
    The verdict (also on failure, in ``DataValidationError.report``): ``success``, ``failures``
    (readable lines), ``failed_expectations`` (split, expectation, column, observed),
    ``rows`` per split, ``files`` (path, size, sha256), ``fingerprint``, ``schema``, ``data_docs``.
    """
    root = Path(dataset_uri)
    report: dict[str, Any] = {"dataset_uri": str(dataset_uri), "success": False, "failures": [],
                              "failed_expectations": [], "rows": {}, "files": [], "fingerprint": None}

    def fail(line: str, **extra: Any) -> None:
        report["failures"].append(line)
        report["failed_expectations"].append({"line": line, **extra})

    try:
        meta = read_meta(root)
        schema = schema_from_meta(meta)
    except (FileNotFoundError, ValueError) as e:  # ValueError covers bad JSON and SchemaError
        fail(f"dataset.json: {e}")
        raise DataValidationError(report) from None
    if min_rows is not None:
        schema.min_rows = int(min_rows)
    report["schema"] = {"kind": schema.kind, **schema.to_dict()}
    report["files"] = data_files(root)
    report["fingerprint"] = fingerprint(root, report["files"])

    import great_expectations as gx
    import pyarrow.parquet as pq
    from great_expectations.data_context.types.base import ProgressBarsConfig

    context = gx.get_context(mode="ephemeral")
    # Progress bars are noise in a task log (and carriage returns in a file).
    context.variables.progress_bars = ProgressBarsConfig(globally=False)
    if docs_dir is not None:
        context.add_data_docs_site(site_name="gate", site_config={
            "class_name": "SiteBuilder", "site_index_builder": {"class_name": "DefaultSiteIndexBuilder"},
            "store_backend": {"class_name": "TupleFilesystemStoreBackend", "base_directory": str(docs_dir)}})
    source = context.data_sources.add_pandas("pandas")
    for split in SPLITS:
        parts = sorted((root / split).glob("*.parquet"))
        if not parts:
            fail(f"{split}: no Parquet files under {root / split}", split=split)
            continue
        try:
            # One pandas block per column: no copy into a 2-D block on read, and column access
            # (GX touches every column many times) stays a cheap view.
            df = pq.read_table(parts if len(parts) > 1 else parts[0]).to_pandas(split_blocks=True, self_destruct=True)
        except Exception as e:  # corrupt / truncated / empty file: pyarrow raises several types
            fail(f"{split}: cannot read Parquet ({type(e).__name__}: {_one_line(str(e))})", split=split)
            continue
        report["rows"][split] = len(df)
        suite = context.suites.add(build_suite(schema, name=f"{schema.kind}_{split}", dtypes=dict(df.dtypes), rows=len(df)))
        batch_def = source.add_dataframe_asset(name=split).add_batch_definition_whole_dataframe("all")
        vd = context.validation_definitions.add(gx.ValidationDefinition(name=split, data=batch_def, suite=suite))
        result = vd.run(batch_parameters={"dataframe": df})
        del df
        for r in result.results:
            if not r.success:
                f = _failure(split, r, schema)
                report["failures"].append(f.pop("line"))
                report["failed_expectations"].append({"line": report["failures"][-1], **f})
    if docs_dir is not None:
        context.build_data_docs(site_names=["gate"])
        index = Path(docs_dir) / "index.html"
        report["data_docs"] = str(index) if index.is_file() else None
    report["success"] = not report["failures"]
    if report["success"]:
        return report
    raise DataValidationError(report)


# --------------------------------------------------------------------------- verdicts kept between runs


def gate_key(dataset_uri: str | Path, files: list[dict[str, Any]], min_rows: int | None = None) -> str:
    """What a verdict depends on: the data files' bytes (``fingerprint``), ``dataset.json`` (the
    schema), this module's code, the Great Expectations version and ``min_rows``."""
    from importlib.metadata import version

    h = hashlib.sha256()
    for part in (fingerprint(dataset_uri, files), sha256_file(Path(dataset_uri) / "dataset.json"),
                 sha256_file(__file__), version("great_expectations"), str(min_rows)):
        h.update(part.encode() + b"\0")
    return h.hexdigest()


def validate_cached(dataset_uri: str, *, cache_dir: str | Path, min_rows: int | None = None,
                    docs_dir: str | Path | None = None) -> dict[str, Any]:
    """``validate``, run once per dataset content and suite: a passed verdict (and its Data Docs)
    is kept in ``cache_dir`` under ``gate_key`` and returned again while neither the data bytes,
    ``dataset.json``, the gate's code nor GX changed (hashing the files is all a repeat costs;
    the suite itself, with GX's import, takes seconds). The returned verdict then carries
    ``cached_from`` (when and where that verdict was reached). A failed verdict is never kept:
    the gate runs again and reports afresh."""
    import json
    import shutil
    import time

    try:
        files = data_files(dataset_uri)
        key = gate_key(dataset_uri, files, min_rows)
    except OSError:  # no dataset.json, unreadable files: the gate itself says what is wrong
        return validate(dataset_uri, min_rows=min_rows, docs_dir=docs_dir)
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
        report["dataset_uri"] = str(dataset_uri)
        report["data_docs"] = None
        if docs_dir is not None:
            shutil.copytree(entry / "data_docs", docs_dir, dirs_exist_ok=True)
            report["data_docs"] = str(Path(docs_dir) / "index.html")
        return report
    report = validate(dataset_uri, min_rows=min_rows, docs_dir=docs_dir)  # raises when it fails
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
    return report
