"""Declared configuration fields: each knob is written once (``knob()`` on a field of a
``@dataclass(kw_only=True)``), everything else is derived from it:

- ``check_fields``: every value against its type, choices, pattern and limits; a mistake raises
  ``ConfigError`` naming the field and the fix (rules between fields are the config's ``check_*``);
- ``parse_value`` / ``set_args``: ``--set key=value`` strings to values and back (a round trip);
- ``json_schema``: a field's JSON schema, which the Airflow side wraps in a ``Param``;
- ``help_lines`` and ``markdown_table``: the CLI's ``--help`` and the tables in the docs.

Types: ``int``, ``float``, ``bool``, ``str``, ``Literal[...]`` of strings, ``X | None`` of those,
``dict[str, str]``, ``dict[str, Any]``. Imports nothing heavy (no torch, no Airflow): the pods, the
CLI and the DAG parser all read it. Why: docs/decisions/0008-one-declaration-per-knob.md.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import json
import math
import re
import types
import typing
from dataclasses import dataclass
from typing import Any, Literal, get_args, get_origin


class ConfigError(ValueError):
    """A configuration value a user must fix. The message names the field and the fix."""

    def __init__(self, field_name: str, problem: str, fix: str):
        self.field = field_name
        super().__init__(f"config field '{field_name}': {problem}. Fix: {fix}")


def knob(default: Any, help: str, *, title: str | None = None, minimum: float | None = None,
         maximum: float | None = None, exclusive_minimum: float | None = None, pattern: str | None = None,
         section: str | None = None, form: bool = True, tag: bool = False, per_run: bool = False,
         schema: dict[str, Any] | None = None) -> Any:
    """Declare one configuration field.

    ``help``: one line on what it does (the CLI, the form's description and the docs show it).
    ``section``: the trigger form section it goes into (None: the main section).
    ``form``: False for fields the pipeline sets itself (paths of one run), never asked of a user.
    ``tag``: also an MLflow run tag on every run, so MLflow's compare view lines runs up by it.
    ``per_run``: a value of one run (a path keyed by the run, a hash), not a choice: an MLflow tag,
    never a param, so comparing runs shows what people chose and not what differs by construction.
    ``schema``: further JSON-schema keywords for the form only (``maxLength``, ``propertyNames``...);
    the config's own ``check_*`` rules enforce the same where it matters.
    """
    meta = {"help": help, "title": title, "minimum": minimum, "maximum": maximum,
            "exclusive_minimum": exclusive_minimum, "pattern": pattern, "section": section, "form": form, "tag": tag,
            "per_run": per_run, "schema": schema or {}}
    if isinstance(default, (dict, list)):
        return dataclasses.field(default_factory=lambda: copy.deepcopy(default), metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


@dataclass(frozen=True)
class Spec:
    """What a declared field allows, resolved from its annotation and its knob."""

    name: str
    kind: str  # JSON-schema type: integer, number, boolean, string, object; json: an object of any JSON values
    optional: bool
    choices: tuple[str, ...] | None
    default: Any
    help: str
    title: str
    minimum: float | None
    maximum: float | None
    exclusive_minimum: float | None
    pattern: str | None
    section: str | None
    form: bool
    tag: bool
    per_run: bool
    schema: dict[str, Any]


_KINDS = {int: "integer", float: "number", bool: "boolean", str: "string"}
_ARTICLE = {"integer": "an integer", "number": "a number", "boolean": "true or false", "string": "a string",
            "object": "a JSON object of strings", "json": "a JSON object"}


def _resolve(hint: Any) -> tuple[str, bool, tuple[str, ...] | None]:
    """(kind, optional, choices) of an annotation."""
    optional = False
    if get_origin(hint) in (typing.Union, types.UnionType):
        args = [a for a in get_args(hint) if a is not type(None)]
        if len(args) != 1:
            raise TypeError(f"unsupported union {hint!r}")
        hint, optional = args[0], True
    if get_origin(hint) is Literal:
        return "string", optional, tuple(get_args(hint))
    if get_origin(hint) is dict or hint is dict:
        value = (get_args(hint) or (str, str))[1]
        return ("json" if value is Any else "object"), optional, None
    if hint in _KINDS:
        return _KINDS[hint], optional, None
    raise TypeError(f"unsupported field type {hint!r}")


@functools.cache
def specs(cls: type) -> dict[str, Spec]:
    """Every field of a knob-declared dataclass, in declaration order."""
    hints = typing.get_type_hints(cls)
    out = {}
    for f in dataclasses.fields(cls):
        if "help" not in f.metadata:
            raise TypeError(f"{cls.__name__}.{f.name} is not declared with knob()")
        kind, optional, choices = _resolve(hints[f.name])
        m = f.metadata
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()  # type: ignore[misc]
        out[f.name] = Spec(name=f.name, kind=kind, optional=optional, choices=choices, default=default,
                           help=m["help"], title=m["title"] or f.name.replace("_", " ").capitalize(),
                           minimum=m["minimum"], maximum=m["maximum"], exclusive_minimum=m["exclusive_minimum"],
                           pattern=m["pattern"], section=m["section"], form=m["form"], tag=m["tag"],
                           per_run=m["per_run"], schema=m["schema"])
    return out


def choices(cls: type, name: str) -> list[str]:
    """The fixed choices of a ``Literal`` field (dropdowns, argparse ``choices``)."""
    found = specs(cls)[name].choices
    if found is None:
        raise TypeError(f"{cls.__name__}.{name} has no fixed choices")
    return list(found)


def mlflow_record(obj: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    """(params, tags) of a knob-declared dataclass instance for MLflow: per-run fields are tags."""
    params, tags = {}, {}
    for name, spec in specs(type(obj)).items():
        (tags if spec.per_run else params)[name] = getattr(obj, name)
    return params, tags


# --------------------------------------------------------------------------- checking


def check_value(spec: Spec, value: Any) -> None:
    """Raise ConfigError if ``value`` is not allowed for the field."""
    name, kind = spec.name, spec.kind
    if value is None:
        if spec.optional:
            return
        raise ConfigError(name, "is empty", f"set {name} to {_ARTICLE[kind]}")
    ok = {"integer": isinstance(value, int) and not isinstance(value, bool),
          "number": isinstance(value, (int, float)) and not isinstance(value, bool),
          "boolean": isinstance(value, bool),
          "string": isinstance(value, str),
          "object": isinstance(value, dict) and all(isinstance(k, str) and isinstance(v, str) for k, v in value.items()),
          "json": isinstance(value, dict) and all(isinstance(k, str) for k in value) and _is_json(value),
          }[kind]
    if kind == "number" and ok and not math.isfinite(value):
        ok = False
    if not ok:
        raise ConfigError(name, f"{value!r} is not {_ARTICLE[kind]}", f"set {name} to {_ARTICLE[kind]}{_range(spec)}")
    if spec.choices is not None and value not in spec.choices:
        raise ConfigError(name, f"{value!r} is not supported", f"use one of {', '.join(spec.choices)}")
    if spec.pattern is not None and not re.search(spec.pattern, value):
        raise ConfigError(name, f"{value!r} does not match the pattern {spec.pattern}", f"write {spec.help}")
    if kind in ("integer", "number"):
        low, high, excl = spec.minimum, spec.maximum, spec.exclusive_minimum
        if (low is not None and value < low) or (high is not None and value > high) or (excl is not None and value <= excl):
            raise ConfigError(name, f"{value!r} is out of range", f"set {name} to {_ARTICLE[kind]}{_range(spec)}")


def _is_json(value: Any) -> bool:
    try:
        json.dumps(value, allow_nan=False)
    except (TypeError, ValueError):
        return False
    return True


def _num(v: float) -> str:
    return str(int(v)) if float(v).is_integer() else repr(v)


def _range(spec: Spec) -> str:
    parts = []
    if spec.exclusive_minimum is not None:
        parts.append(f"> {_num(spec.exclusive_minimum)}")
    if spec.minimum is not None:
        parts.append(f">= {_num(spec.minimum)}")
    if spec.maximum is not None:
        parts.append(f"<= {_num(spec.maximum)}")
    return f" {' and '.join(parts)}" if parts else ""


def check_fields(obj: Any) -> None:
    """Check every field of a knob-declared dataclass instance (types, choices, patterns, limits)."""
    for name, spec in specs(type(obj)).items():
        check_value(spec, getattr(obj, name))


# --------------------------------------------------------------------------- --set strings

_TRUE, _FALSE = ("true", "1", "yes", "on"), ("false", "0", "no", "off")


def parse_value(spec: Spec, raw: str) -> Any:
    """A ``--set key=value`` string as the field's type (``key=`` is None for an optional field)."""
    if spec.optional and raw == "":
        return None
    try:
        if spec.kind == "integer":
            return int(raw)
        if spec.kind == "number":
            return float(raw)
        if spec.kind == "boolean":
            if raw.lower() not in _TRUE + _FALSE:
                raise ValueError(raw)
            return raw.lower() in _TRUE
        if spec.kind in ("object", "json"):
            value = json.loads(raw)
            if not isinstance(value, dict):
                raise ValueError(raw)
            return value
    except ValueError:
        raise ConfigError(spec.name, f"{raw!r} is not {_ARTICLE[spec.kind]}",
                          f"pass {_ARTICLE[spec.kind]}, e.g. --set {spec.name}={format_value(spec, spec.default)}") from None
    return raw


def format_value(spec: Spec, value: Any) -> str:
    """The inverse of ``parse_value``: ``parse_value(spec, format_value(spec, v)) == v``."""
    if value is None:
        return ""
    if spec.kind == "boolean":
        return "true" if value else "false"
    if spec.kind in ("object", "json"):
        return json.dumps(value, sort_keys=True)
    if spec.kind == "number":
        return repr(float(value))
    return str(value)


def from_strings(cls: type, base: dict[str, Any], items: list[str]) -> dict[str, Any]:
    """``base`` values updated with ``key=value`` strings, each parsed as its field's type."""
    fields = specs(cls)
    values = dict(base)
    for item in items:
        key, sep, raw = item.partition("=")
        if not sep:
            raise ConfigError("--set", f"{item!r} has no '='", "write --set key=value")
        if key not in fields:
            raise ConfigError(key, "is not a known field", f"use one of {', '.join(sorted(fields))}")
        values[key] = parse_value(fields[key], raw)
    unknown = sorted(set(values) - set(fields))
    if unknown:
        raise ConfigError(unknown[0], "is not a known field", f"use one of {', '.join(sorted(fields))}")
    return values


def set_args(cls: type, values: dict[str, Any]) -> list[str]:
    """``values`` as ``--set key=value`` arguments (the trainer's command-line contract)."""
    fields = specs(cls)
    out: list[str] = []
    for key, value in values.items():
        out += ["--set", f"{key}={format_value(fields[key], value)}"]
    return out


# --------------------------------------------------------------------------- forms and docs


def json_schema(spec: Spec) -> dict[str, Any]:
    """The field's JSON schema (an Airflow ``Param``'s keywords, without the default)."""
    kind = "object" if spec.kind == "json" else spec.kind
    schema: dict[str, Any] = {"type": [kind, "null"] if spec.optional else kind, "title": spec.title,
                              "description": spec.help}
    if spec.choices is not None:
        schema["enum"] = [*spec.choices, *([None] if spec.optional else [])]
    if spec.kind == "object":
        schema["additionalProperties"] = {"type": "string"}
    for key, value in (("minimum", spec.minimum), ("maximum", spec.maximum),
                       ("exclusiveMinimum", spec.exclusive_minimum), ("pattern", spec.pattern),
                       ("section", spec.section)):
        if value is not None:
            schema[key] = value
    return {**schema, **spec.schema}


def _allowed(spec: Spec) -> str:
    if spec.choices is not None:
        return " | ".join(spec.choices)
    if spec.kind == "json":
        return "JSON object"
    if spec.schema.get("examples"):
        return f"{spec.kind}, e.g. {', '.join(map(str, spec.schema['examples']))}"
    bounds = _range(spec).strip()
    return f"{spec.kind} {bounds}".strip()


def help_lines(cls: type, names: list[str] | None = None) -> str:
    """One line per field for ``--help``: name, allowed values, default, help."""
    rows = []
    for name, spec in specs(cls).items():
        if names is None or name in names:
            default = format_value(spec, spec.default) or "(empty)"
            rows.append(f"  {name:22s} {spec.help} [{_allowed(spec)}; default {default}]")
    return "\n".join(rows)


def markdown_table(cls: type, *, names: list[str] | None = None, defaults: dict[str, str] | None = None) -> str:
    """A Markdown table of the fields: name, default, allowed values, meaning."""
    rows = ["| field | default | allowed | meaning |", "|---|---|---|---|"]
    for name, spec in specs(cls).items():
        if names is not None and name not in names:
            continue
        default = (defaults or {}).get(name) or format_value(spec, spec.default) or "(empty)"
        allowed = _allowed(spec).replace("|", "\\|")
        rows.append(f"| `{name}` | `{default}` | {allowed} | {spec.help.replace('|', '/')} |")
    return "\n".join(rows)
