"""The data gate: Great Expectations 1.x suites built from the schema in ``dataset.json``.

    python -m training validate --dataset-uri var/data/teacher

Each split is read with pyarrow and checked by one suite (columns, types, no nulls, features in
range, labels in the allowed set, minimum rows). The verdict names every failed expectation with
what was observed, so the task log says in one line per problem what is wrong with the data.
"""

from __future__ import annotations

import hashlib
import logging
from pathlib import Path
from typing import Any

from training.datasets import SPLITS, read_meta

# GX logs a line per expectation at INFO; the verdict we print is the readable summary.
logging.getLogger("great_expectations").setLevel(logging.WARNING)


class DataValidationError(ValueError):
    """The dataset failed the gate. ``report`` holds the full verdict."""

    def __init__(self, report: dict[str, Any]):
        self.report = report
        lines = [f"data validation failed for {report['dataset_uri']}:"] + [f"  - {f}" for f in report["failures"]]
        super().__init__("\n".join(lines))


def fingerprint(root: str | Path) -> str:
    """sha256 over every data file's relative path and bytes: what exactly was trained on."""
    h = hashlib.sha256()
    for p in sorted(Path(root).rglob("*.parquet")):
        h.update(p.relative_to(root).as_posix().encode())
        with open(p, "rb") as f:
            while block := f.read(8 << 20):
                h.update(block)
    return h.hexdigest()


def build_suite(meta: dict[str, Any], *, split: str, min_rows: int):
    import great_expectations as gx
    import great_expectations.expectations as gxe

    features, label = meta["features"], meta["label"]
    lo, hi = meta["feature_range"]
    suite = gx.ExpectationSuite(name=f"{meta.get('kind', 'tabular')}_{split}")
    suite.add_expectation(gxe.ExpectTableColumnsToMatchSet(column_set=[*features, label], exact_match=True))
    suite.add_expectation(gxe.ExpectTableRowCountToBeBetween(min_value=min_rows))
    for col in [*features, label]:
        suite.add_expectation(gxe.ExpectColumnValuesToNotBeNull(column=col))
    for col in features:
        suite.add_expectation(gxe.ExpectColumnValuesToBeInTypeList(column=col, type_list=["float32", "float64"]))
        suite.add_expectation(gxe.ExpectColumnValuesToBeBetween(column=col, min_value=lo, max_value=hi))
    suite.add_expectation(gxe.ExpectColumnValuesToBeInTypeList(column=label, type_list=["int8", "int16", "int32", "int64"]))
    suite.add_expectation(gxe.ExpectColumnValuesToBeInSet(column=label, value_set=list(range(meta["n_classes"]))))
    return suite


def _describe(r) -> str:
    cfg = r.expectation_config
    col = cfg.kwargs.get("column")
    res = r.result or {}
    if "unexpected_count" in res and res.get("unexpected_count"):
        seen = f"{res['unexpected_count']} bad values"
        examples = [v for v in res.get("partial_unexpected_list") or [] if v is not None and v == v]  # drop NaN
        if examples:
            seen += f", e.g. {examples[:3]}"
    elif "observed_value" in res:
        seen = f"observed {res['observed_value']}"
    elif r.exception_info and r.exception_info.get("raised_exception"):
        seen = f"could not run: {r.exception_info.get('exception_message')}"
    else:
        seen = "failed"
    return f"{cfg.type}{f'({col})' if col else ''}: {seen}"


def validate(dataset_uri: str, *, min_rows: int = 100) -> dict[str, Any]:
    """Run the suite on every split. Returns the verdict; raises DataValidationError on failure."""
    import great_expectations as gx
    import pyarrow.parquet as pq

    root = Path(dataset_uri)
    report: dict[str, Any] = {"dataset_uri": str(dataset_uri), "success": False, "failures": [], "rows": {}}
    try:
        meta = read_meta(root)
    except (FileNotFoundError, ValueError) as e:
        report["failures"].append(f"dataset.json: {e}")
        raise DataValidationError(report) from None

    from great_expectations.data_context.types.base import ProgressBarsConfig

    context = gx.get_context(mode="ephemeral")
    # Progress bars are noise in a task log (and carriage returns in a file).
    context.variables.progress_bars = ProgressBarsConfig(globally=False)
    source = context.data_sources.add_pandas("pandas")
    for split in SPLITS:
        parts = sorted((root / split).glob("*.parquet"))
        if not parts:
            report["failures"].append(f"{split}: no Parquet files under {root / split}")
            continue
        try:
            df = pq.read_table(parts).to_pandas() if len(parts) > 1 else pq.read_table(parts[0]).to_pandas()
        except Exception as e:  # corrupt / truncated Parquet: pyarrow raises several types
            report["failures"].append(f"{split}: cannot read Parquet ({type(e).__name__}: {e})")
            continue
        report["rows"][split] = len(df)
        batch = source.add_dataframe_asset(name=split).add_batch_definition_whole_dataframe("all").get_batch(
            batch_parameters={"dataframe": df})
        result = batch.validate(build_suite(meta, split=split, min_rows=min_rows))
        report["failures"] += [f"{split}: {_describe(r)}" for r in result.results if not r.success]
    report["success"] = not report["failures"]
    if report["success"]:
        report["fingerprint"] = fingerprint(root)
        return report
    raise DataValidationError(report)
