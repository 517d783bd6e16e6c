"""Dataclass fields checked against their annotations, for configs read from JSON.

A config file is hand-edited: `"mla_output_gate": "false"` is a truthy string, `true` is an int
to Python, and NaN is a float. `check_field_types` refuses each of them naming the field, from
the annotations alone, so a new field is checked without a new line of validation.
"""
from __future__ import annotations

import dataclasses
import math

# A field's annotation -> (what the error says it must be, the test of a non-None value).
FIELD_KINDS = {
    "bool": ("a bool (true or false)", lambda v: isinstance(v, bool)),
    "int": ("an int", lambda v: isinstance(v, int) and not isinstance(v, bool)),
    "float": ("a finite number",
              lambda v: isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)),
    "str": ("a string", lambda v: isinstance(v, str)),
    "list[str]": ("a list of strings", lambda v: isinstance(v, list) and all(isinstance(t, str) for t in v)),
    "list[int]": ("a list of ints",
                  lambda v: isinstance(v, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in v)),
}


def check_field_types(obj, skip: tuple[str, ...] = ()) -> None:
    """ValueError naming the first field of dataclass `obj` whose value its annotation (a
    FIELD_KINDS name, optionally `| None`) refuses; fields of the kinds in `skip` are left to the
    caller."""
    for f in dataclasses.fields(obj):
        kind = f.type.removesuffix(" | None")
        optional = kind != f.type
        if kind in skip:
            continue
        v = getattr(obj, f.name)
        if not (optional and v is None or v is not None and FIELD_KINDS[kind][1](v)):
            raise ValueError(f"{type(obj).__name__}.{f.name}: must be {FIELD_KINDS[kind][0]}"
                             f"{' or null' if optional else ''}, got {v!r}")
