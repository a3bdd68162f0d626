"""The Great Expectations suite of one split (``build_suite``), from the dataset's schema, with
two expectations GX 1.x lacks (class shares within bounds, unique rows by a 64-bit row hash).
Ranges are checked on the column min/max, not per value: docs/decisions/0002-vectorized-gate-checks.md."""

from __future__ import annotations

from typing import Any

from training.data.schema import DTYPE_FAMILIES, NUMERIC, DatasetSchema


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
        actual = dtypes.get(c.name) if dtypes is not None else None
        # GX compares a column's dtype by equality with dtypes built from these names, and no name
        # builds pandas 3's default string dtype (pyarrow storage, NaN as missing): a string column
        # declared "string" is right as it is. "any": a column whose values the model never reads.
        is_string = c.dtype == "string" and actual is not None and pd_types.is_string_dtype(actual)
        if DTYPE_FAMILIES[c.dtype] and not is_string:
            ex.append(gxe.ExpectColumnValuesToBeInTypeList(column=c.name, type_list=DTYPE_FAMILIES[c.dtype]))
        numeric = actual is None or pd_types.is_numeric_dtype(actual) and not pd_types.is_bool_dtype(actual)
        if c.dtype in NUMERIC and numeric and (c.dtype == "float" or c.min is not None or c.max is not None):
            big = float(np.finfo(np.float64).max)
            lo = c.min if c.min is not None else -big  # float columns: at least finite (no inf)
            hi = c.max if c.max is not None else big
            ex.append(gxe.ExpectColumnMinToBeBetween(column=c.name, min_value=lo, max_value=hi))
            ex.append(gxe.ExpectColumnMaxToBeBetween(column=c.name, min_value=lo, max_value=hi))
        if c.values is not None:
            ex.append(gxe.ExpectColumnValuesToBeInSet(column=c.name, value_set=list(c.values)))
        if c.min_length is not None and (actual is None or pd_types.is_string_dtype(actual)
                                         or pd_types.is_object_dtype(actual)):
            ex.append(gxe.ExpectColumnValueLengthsToBeBetween(column=c.name, min_value=c.min_length))
    # Every row of a duplicate group (the original too) counts as duplicated; nested values (token
    # ids as lists) have no row hash, the other columns still count.
    hashable = [c.name for c in schema.columns if not (schema.kind == "text" and c.dtype == "any")]
    if set(names) <= have and len(hashable) > 1:
        ex.append(_custom_expectations()["rows_unique"](column_list=hashable, mostly=1.0 - schema.max_duplicate_fraction))
    elif set(names) <= have and hashable:  # one column (documents alone): GX's own check of one column
        ex.append(gxe.ExpectColumnValuesToBeUnique(column=hashable[0], mostly=1.0 - schema.max_duplicate_fraction))
    labels = schema.label_values()
    if schema.class_fraction and schema.label in have and labels:
        ex.append(_custom_expectations()["class_fractions"](
            column=schema.label, value_set=labels, min_fraction=schema.class_fraction[0], max_fraction=schema.class_fraction[1]))
    suite = gx.ExpectationSuite(name=name, expectations=ex)
    return suite
