"""What a dataset must look like, and what it is: the schema the data gate checks
(``DatasetSchema``) and the description (``meta``) training reads (``describe``).

- With a ``dataset.json``: its explicit ``schema`` section (``schema_from_meta``; ``describe-data``
  writes one with ``pinned_meta``), or one derived from the generic fields ``make-data`` writes
  (``schema_from_fields``); the file says which columns are features and label.
- Without: ``describe`` picks the label (``label_column``), the features (``feature_columns``,
  default every other numeric column) and the task (``task=auto``: an integer or boolean label with
  at most ``MAX_CLASSES`` values in train is classification, else regression); ``infer_schema``
  checks validation against train: same columns and dtypes, train's classes, values within train's
  range widened by that range on each side (train [a, b] allows [2a - b, 2b - a]).

A mistake a user must fix (no label column, a label with nulls or strings, a single class,
non-numeric features) raises ``ConfigError`` naming the field; a bad schema ``SchemaError``.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Callable

from training.config.fields import ConfigError
from training.data.options import DataOptions

# dtype family -> the pandas/numpy dtype names GX's type check accepts for it ("any": not checked).
DTYPE_FAMILIES: dict[str, list[str]] = {
    "float": ["float16", "float32", "float64", "Float32Dtype", "Float64Dtype"],
    "int": ["int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64",  # + pandas nullable ints:
            "Int8Dtype", "Int16Dtype", "Int32Dtype", "Int64Dtype", "UInt8Dtype", "UInt16Dtype", "UInt32Dtype", "UInt64Dtype"],
    "bool": ["bool", "BooleanDtype"],
    "string": ["object", "str", "StringDtype"],
    "any": [],
}
NUMERIC = ("float", "int")
MAX_CLASSES = 50  # task=auto: an integer label with at most this many distinct values is classification
INFERRED_MIN_ROWS = 10  # an inferred schema cannot know a split's size; fewer rows than this say nothing


class SchemaError(ValueError):
    """``dataset.json`` declares no usable schema."""


# --------------------------------------------------------------------------- the gate's schema


@dataclass(kw_only=True)
class ColumnSchema:
    name: str
    dtype: str
    min: float | None = None
    max: float | None = None
    values: list[Any] | None = None
    nullable: bool = False
    min_length: int | None = None  # strings (documents): at least this many characters


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


def declares_schema(meta: dict[str, Any] | None) -> bool:
    """Whether ``dataset.json`` says what the data must look like (else it is inferred from train)."""
    return bool(meta) and any(k in meta for k in ("schema", "features", "kind"))


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


# --------------------------------------------------------------------------- what the data is


def family(arrow_type) -> str:
    """The dtype family of an Arrow type: float, int, bool, string, or any (times, nested, ...)."""
    import pyarrow as pa

    if pa.types.is_floating(arrow_type):
        return "float"
    if pa.types.is_integer(arrow_type):
        return "int"
    if pa.types.is_boolean(arrow_type):
        return "bool"
    if pa.types.is_string(arrow_type) or pa.types.is_large_string(arrow_type):
        return "string"
    return "any"


def type_name(arrow_type) -> str:
    """An Arrow type as a person reads it (``string`` for both string layouts)."""
    return "string" if family(arrow_type) == "string" else str(arrow_type)


def _numeric(arrow_type) -> bool:
    return family(arrow_type) in ("float", "int", "bool")


def _missing(column) -> int:
    """Nulls plus NaN: both are a missing value to a model."""
    import pyarrow as pa
    import pyarrow.compute as pc

    nan = int(pc.sum(pc.is_nan(column)).as_py() or 0) if pa.types.is_floating(column.type) else 0
    return column.null_count + nan


def describe(meta: dict[str, Any] | None, options: DataOptions, train: Callable[[], Any],
             label_scan: Callable[[str], tuple[int, Any]] | None = None) -> dict[str, Any]:
    """The dataset's description, what training and the model spec read: ``kind``, ``features``,
    ``feature_dtype``, ``label``, ``task`` (+ ``task_reason``), ``n_classes`` (1 for regression),
    ``classes`` (inferred classification), ``normalize`` (standardize features). From
    ``dataset.json`` when it names the features, else from ``train()`` (an Arrow table) and ``options``;
    a table with ``label_scan`` (``label`` -> its missing values and distinct values in train,
    training/data/table_stream.py) needs of ``train()`` its schema only."""
    if meta and "features" in meta:
        kind = meta.get("kind", "tabular")
        task = meta.get("task") or "classification"
        out = {"kind": kind, "feature_dtype": "float", **meta, "task": task,
               "task_reason": meta.get("task_reason") or f"dataset.json: {task}",
               # make-data's tables are standard normal already and say so by being generated.
               "normalize": bool(meta.get("normalize", "generator" not in meta)) and kind == "tabular",
               "source": "dataset.json"}
        if task == "regression":
            out["n_classes"] = 1
        return out
    if options.sft is not None:
        return _describe_sft(train(), dict(options.sft))
    if options.text_column:
        return _describe_text(train(), options)
    described = _describe_table(train(), options, label_scan)
    return {**described, **{k: v for k, v in (meta or {}).items() if k == "normalize"}}


def _describe_table(table, options: DataOptions,
                    label_scan: Callable[[str], tuple[int, Any]] | None = None) -> dict[str, Any]:
    """From the train split, or from its schema (``table``: no rows needed) and ``label_scan``."""
    names = table.column_names
    label = options.label_column
    if label not in names:
        raise ConfigError("label_column", f"{label!r} is not a column of the train split (its columns: "
                          f"{', '.join(names)})", "set label_column to the column that holds the target")
    ltype = table.schema.field(label).type
    if not _numeric(ltype) and family(ltype) != "string":
        raise ConfigError("label_column", f"{label!r} holds {type_name(ltype)} values, neither numbers nor class "
                          "names", "write classes as names or integers and regression targets as numbers")
    missing, values = label_scan(label) if label_scan is not None else (_missing(table.column(label)),
                                                                         table.column(label))
    if missing:
        raise ConfigError("label_column", f"{label!r} has {missing} missing values (null or NaN) in the train split",
                          "drop those rows or fill in their labels")
    features, ignored = _features(table, options)
    task, reason, classes = label_task(values, label, options.task)
    out: dict[str, Any] = {"kind": "tabular", "features": features, "feature_dtype": "float", "label": label,
                           "task": task, "task_reason": reason, "n_classes": len(classes) if classes else 1,
                           "normalize": True, "ignored_columns": ignored, "source": "inferred from the train split"}
    if classes:
        out["classes"] = classes
    return out


def _describe_text(table, options: DataOptions) -> dict[str, Any]:
    """A table of documents (``text_column``: strings, or token ids as list<int>): a language
    model's data, or a classifier's when the table also has ``label_column``."""
    import pyarrow as pa

    names, col = table.column_names, options.text_column
    if col not in names:
        raise ConfigError("text_column", f"{col!r} is not a column of the train split (its columns: {', '.join(names)})",
                          "set text_column to the column that holds the documents")
    ctype = table.schema.field(col).type
    is_ids = (pa.types.is_list(ctype) or pa.types.is_large_list(ctype)) and pa.types.is_integer(ctype.value_type)
    if family(ctype) != "string" and not is_ids:
        raise ConfigError("text_column", f"{col!r} holds {type_name(ctype)} values, not text",
                          "write the documents as strings (or pre-tokenized ids as list<int>)")
    out: dict[str, Any] = {"kind": "text", "text_column": col, "text_format": "token_ids" if is_ids else "text",
                           "features": [col], "label": None, "source": "inferred from the train split"}
    label = options.label_column
    if label in names and label != col:
        missing = _missing(table.column(label))
        if missing:
            raise ConfigError("label_column", f"{label!r} has {missing} missing values (null or NaN) in the train "
                              "split", "drop those rows or fill in their labels")
        task, reason, classes = label_task(table.column(label), label, options.task)
        if task != "classification":
            raise ConfigError("task", f"text with label {label!r} trains a classifier, but {reason}",
                              "write the classes as names or integers, or leave label_column out of the table to "
                              "train a language model on the text")
        out.update(label=label, task="classification", task_reason=f"text with the label {label!r}: classification "
                   f"({len(classes)} classes)", n_classes=len(classes), classes=classes)
    else:
        if options.task not in ("auto", "language_modeling"):
            raise ConfigError("task", f"{options.task} needs a label column, and the table has no {label!r}",
                              "set task=auto for a language model on the text, or name the label in label_column")
        out.update(task="language_modeling", task_reason=f"text without a label column ({label!r}): a language model")
    return out


def _describe_sft(table, sft: dict[str, str]) -> dict[str, Any]:
    """A table of SFT examples: prompt and response strings, or conversations (a list of
    {role, content} structs); a language model trained on the answers (training/data/sft.py)."""
    import pyarrow as pa

    names = table.column_names
    for fld, col in sft.items():
        if col not in names:
            raise ConfigError(fld, f"{col!r} is not a column of the train split (its columns: {', '.join(names)})",
                              f"set {fld} to the column that holds the {fld.split('_')[0]}s")
        ctype = table.schema.field(col).type
        if fld == "messages_column":
            ok = ((pa.types.is_list(ctype) or pa.types.is_large_list(ctype)) and pa.types.is_struct(ctype.value_type)
                  and {"role", "content"} <= {f.name for f in ctype.value_type})
            if not ok:
                raise ConfigError(fld, f"{col!r} holds {type_name(ctype)} values, not conversations",
                                  "write each row as a list of {role, content} structs (strings)")
        elif family(ctype) != "string":
            raise ConfigError(fld, f"{col!r} holds {type_name(ctype)} values, not text", "write the examples as strings")
    what = "conversations" if "messages_column" in sft else f"prompts {sft.get('prompt_column')!r} and answers " \
        f"{sft.get('response_column')!r}"
    return {"kind": "text", "text_format": "sft", "sft": dict(sft), "features": list(sft.values()), "label": None,
            "task": "language_modeling", "source": "inferred from the train split",
            "task_reason": f"supervised fine-tuning on {what}: a language model trained on the answers"}


def _features(table, options: DataOptions) -> tuple[list[str], list[str]]:
    names, label = table.column_names, options.label_column
    types = {f.name: f.type for f in table.schema}
    if options.feature_columns is None:
        features = [c for c in names if c != label and _numeric(types[c])]
        ignored = [f"{c} ({type_name(types[c])})" for c in names if c != label and c not in features]
        if not features:
            raise ConfigError("feature_columns", f"the train split has no numeric column besides the label {label!r}"
                              f" (its other columns: {', '.join(ignored) or 'none'})",
                              "encode the features as numbers before writing the table")
        return features, ignored
    features = list(options.feature_columns)
    unknown = [c for c in features if c not in names]
    if unknown:
        raise ConfigError("feature_columns", f"{', '.join(unknown)} not in the train split (its columns: "
                          f"{', '.join(names)})", "list existing columns, comma-separated, or leave it empty for all")
    if label in features:
        raise ConfigError("feature_columns", f"lists the label column {label!r}", f"leave {label!r} out of feature_columns")
    bad = [f"{c} ({type_name(types[c])})" for c in features if not _numeric(types[c])]
    if bad:
        raise ConfigError("feature_columns", f"non-numeric columns: {', '.join(bad)}",
                          "leave them out of feature_columns, or encode them as numbers before writing the table "
                          "(integer codes or one column per category)")
    return features, [c for c in names if c != label and c not in features]


def label_task(column, label: str, task: str) -> tuple[str, str, list[Any] | None]:
    """(task, the reason in words, the classes of a classification)."""
    import pyarrow.compute as pc

    fam = family(column.type)
    values = None
    if task == "auto":
        if fam in ("int", "bool"):
            values = sorted(pc.unique(column).to_pylist())
            if len(values) <= MAX_CLASSES:
                task = "classification"
                reason = (f"label {label!r} holds integers ({column.type}) with {len(values)} distinct values in "
                          f"train (at most {MAX_CLASSES}): classification")
            else:
                task = "regression"
                reason = (f"label {label!r} holds integers with {len(values)} distinct values in train (more than "
                          f"{MAX_CLASSES}): regression")
        elif fam == "string":
            values = sorted(pc.unique(column).to_pylist())
            if len(values) > MAX_CLASSES:
                raise ConfigError("label_column", f"{label!r} holds {len(values)} distinct names in train, more than "
                                  f"the {MAX_CLASSES} classes task=auto infers", "set task=classification to train "
                                  f"a classifier of {len(values)} classes, or name another label_column")
            task, reason = "classification", (f"label {label!r} holds class names ({len(values)} distinct in "
                                              f"train): classification")
        elif fam == "float":
            task, reason = "regression", f"label {label!r} holds floating-point numbers ({column.type}): regression"
        else:
            raise ConfigError("label_column", f"{label!r} holds {type_name(column.type)} values, neither numbers "
                              "nor class names", "write classes as names or integers, regression targets as numbers")
    else:
        reason = f"task={task} (set)"
    if task == "regression":
        if fam == "string":
            raise ConfigError("task", f"regression needs numbers but label {label!r} holds names",
                              "set task=auto or classification to train a classifier of its names")
        return task, reason, None
    values = values if values is not None else sorted(pc.unique(column).to_pylist())
    if fam == "float" and any(float(v) != int(v) for v in values):
        example = next(v for v in values if float(v) != int(v))
        raise ConfigError("task", f"classification needs whole-number labels but {label!r} holds {example!r}",
                          "set task=regression for a numeric target, or write the classes as integers")
    if len(values) < 2:
        raise ConfigError("label_column", f"{label!r} has a single class ({values[0]!r}) in the train split: there "
                          "is nothing to tell apart", "use data with at least two classes, or task=regression for a "
                          "numeric target")
    return task, reason, values


def profile(table, names: list[str] | None = None) -> list[dict[str, Any]]:
    """Per column: Arrow type, family, missing values (null or NaN); for numbers the finite
    min/max, mean and standard deviation."""
    import pyarrow.compute as pc

    out = []
    for name in names or table.column_names:
        col = table.column(name)
        entry: dict[str, Any] = {"name": name, "type": type_name(col.type), "dtype": family(col.type),
                                 "missing": _missing(col)}
        if entry["dtype"] in NUMERIC:
            finite = pc.filter(col, pc.is_finite(col)) if entry["dtype"] == "float" else col
            mm = pc.min_max(finite)
            entry.update(min=_plain(mm["min"].as_py()), max=_plain(mm["max"].as_py()),
                         mean=_plain(pc.mean(finite).as_py()), std=_plain(pc.stddev(finite).as_py()))
        out.append(entry)
    return out


def _plain(v: Any) -> Any:
    return float(v) if isinstance(v, float) else v


def class_shares(column, classes: list[Any]) -> list[dict[str, Any]]:
    import pyarrow.compute as pc

    counts = {c["values"]: c["counts"] for c in pc.value_counts(column).to_pylist()}
    total = max(1, len(column))
    return [{"class": c, "rows": int(counts.get(c, 0)), "share": round(counts.get(c, 0) / total, 6)} for c in classes]


def infer_schema(table, description: dict[str, Any], columns: list[dict[str, Any]] | None = None) -> DatasetSchema:
    """The gate's schema from the train split (see the module docstring): every column of train
    with its dtype family; features and a regression label within train's range widened by that
    range on each side; a classification label among train's classes."""
    by_name = {c["name"]: c for c in (columns or profile(table))}
    used = {*description["features"], description["label"]}
    text = description.get("text_column")
    cols = []
    for name in table.column_names:
        p = by_name.get(name) or profile(table, [name])[0]
        if name == text:  # documents: present and not empty (token ids: present)
            cols.append(ColumnSchema(name=name, dtype=p["dtype"], min_length=1 if p["dtype"] == "string" else None))
        elif name == description["label"] and description.get("classes"):
            cols.append(ColumnSchema(name=name, dtype=p["dtype"], values=list(description["classes"])))
        elif name in used and p["dtype"] in NUMERIC and p.get("min") is not None:
            lo, hi = float(p["min"]), float(p["max"])
            margin = hi - lo if hi > lo else max(abs(hi), 1.0)
            cols.append(ColumnSchema(name=name, dtype=p["dtype"], min=lo - margin, max=hi + margin))
        else:
            cols.append(ColumnSchema(name=name, dtype=p["dtype"], nullable=name not in used))
    label = description["label"] if description.get("classes") else None
    return DatasetSchema(kind=description.get("kind", "tabular"), columns=cols, label=label, min_rows=INFERRED_MIN_ROWS,
                         max_duplicate_fraction=0.01)


def pinned_meta(description: dict[str, Any], schema: DatasetSchema, *, summary: dict[str, Any],
                columns: list[dict[str, Any]]) -> dict[str, Any]:
    """What ``python -m training describe-data`` writes as ``dataset.json``: the description and
    the schema as inferred now, so the bounds can be read, tightened and kept."""
    keep = ("kind", "features", "feature_dtype", "label", "task", "task_reason", "n_classes", "classes", "normalize")
    return {**{k: description[k] for k in keep if k in description}, "schema": schema.to_dict(),
            "described_from": summary, "train_profile": columns}
