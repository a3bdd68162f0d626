"""The data gate on tables larger than memory: each split's suite run on every batch of rows, one
pass over its row groups (training/data/batches.py), with the whole-split expectations (row
count, duplicates, class shares) checked on the pass's totals; a schema to infer comes from a
pass over train first. The verdict's lines are worded as on whole splits (training/data/verdict.py).
"""

from __future__ import annotations

from typing import Any

from training.config.fields import ConfigError
from training.data.batches import Totals, release_memory, split_batches, split_rows
from training.data.dataset import Dataset
from training.data.expectations import build_suite
from training.data.schema import DatasetSchema, infer_schema
from training.data.sources import SPLITS
from training.data.verdict import failure, unreadable

BATCH_BYTES = 512 << 20  # Parquet bytes from which a dataset is checked in batches
BATCH_ROWS = 1_000_000
# Expectations on the whole split: checked on the pass's totals, not per batch.
_WHOLE = {"expect_table_row_count_to_be_between", "expect_rows_to_be_unique", "expect_column_values_to_be_unique",
          "expect_column_class_fractions_to_be_between"}


def rows_per_batch(ds: Dataset, batch_rows: int | None) -> int | None:
    """Rows per batch when ``ds`` is to be checked in batches: tables (not text, whose checks
    compare documents across splits) over ``BATCH_BYTES`` or asked for."""
    meta = ds.layout.meta or {}
    if ds.options.is_text or meta.get("kind") == "text":
        return None
    if batch_rows:
        return int(batch_rows)
    return BATCH_ROWS if sum(f.size for f in ds.layout.all_files) > BATCH_BYTES else None


def inferred_in_batches(ds: Dataset, rows: int, report: dict[str, Any], fail, stop) -> DatasetSchema:
    """The schema ``infer_schema`` infers from train, with train's profile from a pass over its
    row groups (the description: passes over the label, training/data/table_stream.py) instead of
    the whole split: the same schema, as min and max are exact in any order."""
    try:
        meta = ds.meta
    except ConfigError as e:  # the table cannot be described: no label column, a single class...
        fail(str(e), field=e.field)
        raise stop() from None
    except (OSError, ValueError) as e:  # a footer pyarrow cannot read
        fail(unreadable("train", e), split="train")
        raise stop() from None
    totals = Totals(hashed=[], label=None)
    try:
        for table in split_batches(ds.layout, "train", ds.options, rows):
            totals.add(table, None)
            del table
            release_memory()
    except Exception as e:  # corrupt / truncated file: pyarrow raises several types
        fail(unreadable("train", e), split="train")
        raise stop() from None
    return infer_schema(ds.parts("train").schema.empty_table(), meta, totals.profile())


def batched(ds: Dataset, schema: DatasetSchema, rows: int, context, source, report: dict[str, Any], fail) -> Totals:
    """Each split's suite on every batch of ``rows`` rows (its per-row and per-column
    expectations), then the whole-split ones (row count, duplicates, class shares) on the
    pass's totals. A failure is reported once per expectation and column, with the first batch
    that failed it and how many did. Returns train's totals."""
    import time

    import great_expectations as gx

    t0 = time.perf_counter()
    hashed = [c.name for c in schema.columns]
    train: Totals | None = None
    report["batched"] = {"rows_per_batch": rows, "batches": {}}
    for split in SPLITS:
        totals = Totals(hashed=hashed, label=schema.label if schema.class_fraction else None,
                        capacity=split_rows(ds.layout, split))
        vd, failed, start, count = None, {}, 0, 0
        try:
            for table in split_batches(ds.layout, split, ds.options, rows):
                df = table.to_pandas(split_blocks=True)
                totals.add(table, df)
                if vd is None:
                    whole = build_suite(schema, name=f"{schema.kind}_{split}", dtypes=dict(df.dtypes), rows=len(df))
                    suite = context.suites.add(gx.ExpectationSuite(name=whole.name, expectations=[
                        e for e in whole.expectations if e.expectation_type not in _WHOLE]))
                    batch_def = source.add_dataframe_asset(name=split).add_batch_definition_whole_dataframe("all")
                    vd = context.validation_definitions.add(gx.ValidationDefinition(name=split, data=batch_def, suite=suite))
                for r in vd.run(batch_parameters={"dataframe": df}).results:
                    if not r.success:
                        f = failure(split, r, schema)
                        key = (f["expectation"], f["column"])
                        if key not in failed:
                            failed[key] = [f, 0, start, start + len(df)]
                        failed[key][1] += 1
                start += len(df)
                count += 1
                _forget_batch(source)
                del df, table
                release_memory()
        except Exception as e:  # corrupt / truncated file: pyarrow raises several types
            fail(unreadable(split, e), split=split)
        report["rows"][split] = totals.rows
        report["batched"]["batches"][split] = count
        for f, times, a, b in failed.values():
            line = f.pop("line") + f" (first in rows {a}-{b - 1}; {times} of {count} batches)"
            fail(line, **f)
        for line in _whole_split_failures(split, schema, totals):
            fail(line, split=split)
        train = totals if split == "train" else train
    report["batched"]["seconds"] = round(time.perf_counter() - t0, 3)
    return train


def _forget_batch(source) -> None:
    """GX's execution engine keeps the last batch's DataFrame (and the Arrow buffers it views)
    until the next run replaces it: dropped, so the next batch is read without it."""
    manager = source.get_execution_engine().batch_manager
    manager.reset_batch_cache()
    manager.batch_data_cache.clear()


def _whole_split_failures(split: str, schema: DatasetSchema, t: Totals) -> list[str]:
    """The whole-split expectations on a batched pass's totals, worded as ``verdict.failure`` words them."""
    out = []
    if t.rows < schema.min_rows:
        out.append(f"{split}: expect_table_row_count_to_be_between: observed {t.rows}, allowed "
                   f"{{'min_value': {schema.min_rows}}}")
    dup = t.duplicated()
    if t.rows and dup / t.rows > schema.max_duplicate_fraction:
        out.append(f"{split}: expect_rows_to_be_unique(all columns): {dup} of {t.rows} rows are duplicated "
                   f"({100 * dup / t.rows:.2f}%, allowed {100 * schema.max_duplicate_fraction:.2f}%)")
    labels = schema.label_values()
    if schema.class_fraction and labels and t.label:
        lo, hi = schema.class_fraction
        shares = {str(v): t.labels.get(v, 0) / max(1, t.rows) for v in labels}
        off = {k: round(v, 4) for k, v in shares.items() if not lo <= v <= hi}
        if off or not t.rows:
            out.append(f"{split}: expect_column_class_fractions_to_be_between({t.label}): class shares {off} "
                       f"outside [{lo}, {hi}]")
    return out
