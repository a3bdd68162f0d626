"""The data gate's verdict lines: a failed Great Expectations result worded as one readable line
naming the split, the expectation, the column and what was observed (``failure``), shared by the
gate on whole splits (training/data/gate.py) and the pass in batches (training/data/gate_batched.py).
"""

from __future__ import annotations

import math
from typing import Any

from training.data.schema import DTYPE_FAMILIES, DatasetSchema


def plain(v: Any) -> Any:
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
        return [plain(x) for x in v]
    if isinstance(v, dict):
        return {str(k): plain(x) for k, x in v.items()}
    return v


def short(value: Any, limit: int = 60) -> Any:
    """An example value for a verdict line: a long string (a document) cut to its start, on one line."""
    if isinstance(value, str) and len(value) > limit:
        return one_line(value[:limit]) + "..."
    return one_line(value) if isinstance(value, str) else value


def unreadable(where: str, e: BaseException) -> str:
    """The line for a Parquet file pyarrow cannot read (corrupt, truncated, empty)."""
    return f"{where}: cannot read Parquet ({type(e).__name__}: {one_line(str(e))})"


def one_line(text: str) -> str:
    """Error texts from readers can hold newlines and raw bytes; a verdict line holds neither."""
    text = " ".join(text.split())
    return "".join(c if c.isprintable() else f"\\x{ord(c):02x}" for c in text)


def failure(split: str, r, schema: DatasetSchema) -> dict[str, Any]:
    """One failed expectation: structured, plus a readable line naming column and observation."""
    cfg = r.expectation_config
    kw = cfg.kwargs
    res = r.result or {}
    col = kw.get("column")
    if cfg.type == "expect_rows_to_be_unique":
        col = "all columns"
    observed: Any = None
    if r.exception_info and r.exception_info.get("raised_exception"):
        seen = f"could not run: {one_line(str(r.exception_info.get('exception_message')))}"
    elif cfg.type == "expect_table_columns_to_match_set":
        mism = (res.get("details") or {}).get("mismatched") or {}
        observed = plain(res.get("observed_value"))
        parts = [f"missing {mism['missing']}" if mism.get("missing") else "",
                 f"unexpected {mism['unexpected']}" if mism.get("unexpected") else ""]
        seen = ", ".join(p for p in parts if p) or f"observed {observed}"
    elif cfg.type == "expect_rows_to_be_unique":
        n, total = res.get("unexpected_count", 0), res.get("element_count", 0)
        observed = round(n / total, 6) if total else None
        seen = (f"{n} of {total} rows are duplicated ({100 * (observed or 0):.2f}%, "
                f"allowed {100 * schema.max_duplicate_fraction:.2f}%)")
    elif cfg.type == "expect_column_class_fractions_to_be_between":
        observed = plain(res.get("observed_value"))
        off = plain((res.get("details") or {}).get("out_of_bounds"))
        seen = f"class shares {off or observed} outside [{kw['min_fraction']}, {kw['max_fraction']}]"
    elif cfg.type == "expect_column_values_to_be_in_type_list" and "observed_value" in res:
        observed = plain(res["observed_value"])
        family = next((f for f, names in DTYPE_FAMILIES.items() if names == list(kw.get("type_list") or [])), None)
        seen = f"observed dtype {observed}, expected {family or kw.get('type_list')}"
    elif cfg.type == "expect_column_values_to_be_in_set" and res.get("unexpected_count"):
        # A label's set is train's classes: name the ones the split holds beyond them.
        observed = res["unexpected_count"]
        allowed = list(kw.get("value_set") or [])
        unknown = sorted({short(plain(v)) for v in res.get("partial_unexpected_list") or []}, key=str)
        seen = (f"{observed} values outside the set ({[short(v) for v in allowed[:20]]}"
                f"{' ...' if len(allowed) > 20 else ''}): {unknown}")
    elif res.get("unexpected_count"):
        observed = res["unexpected_count"]
        seen = f"{observed} bad values"
        # Examples of a null check are all null: they say nothing the count does not.
        examples = [short(e) for e in (plain(v) for v in res.get("partial_unexpected_list") or [])
                    if e not in ("NaN", "null")][:3]
        if examples:
            seen += f", e.g. {examples}"
    elif "observed_value" in res:
        observed = plain(res["observed_value"])
        bounds = {k: plain(kw[k]) for k in ("min_value", "max_value") if kw.get(k) is not None
                  and abs(kw[k]) < 1e300}
        seen = f"observed {observed}" + (f", allowed {bounds}" if bounds else "")
    else:
        seen = "failed"
    line = f"{split}: {cfg.type}{f'({col})' if col else ''}: {seen}"
    return {"split": split, "expectation": cfg.type, "column": col, "observed": observed, "line": line}
