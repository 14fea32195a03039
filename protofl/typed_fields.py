"""Typed fields: values of a run config checked against a dataclass's annotated fields (the run
config's top-level keys, a method's options), one mechanism for both: unknown keys are errors, each
value must have its field's type, and a ``Literal[...]`` field lists its allowed values (no flwr)."""

from __future__ import annotations

import dataclasses
import math
import threading
import types
import typing
from typing import Any, Literal, Mapping, get_args, get_origin

Scalar = bool | bytes | float | int | str  # a config or metrics value (as Flower's ``Scalar``)


def _describe(annotation: Any) -> str:
    if get_origin(annotation) is Literal:
        return f"one of {get_args(annotation)}"
    if get_origin(annotation) in (typing.Union, types.UnionType):
        return " or ".join(_describe(a) for a in get_args(annotation))
    return {bool: "a bool (true or false)", int: "an integer", float: "a finite number", str: "a string"}.get(
        annotation, str(annotation)
    )


def is_int(value: Any) -> bool:
    """An integer, and not a bool (``True`` is not 1 here)."""
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value: Any) -> bool:
    """An int or a float, and not a bool."""
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _conform(value: Any, annotation: Any) -> tuple[bool, Any]:
    """(whether ``value`` has the type ``annotation`` names, the value as that type)."""
    origin = get_origin(annotation)
    if origin is Literal:
        return any(value == a and type(value) is type(a) for a in get_args(annotation)), value
    if origin in (typing.Union, types.UnionType):
        for member in get_args(annotation):
            ok, converted = _conform(value, member)
            if ok:
                return True, converted
        return False, value
    if annotation is bool:
        return isinstance(value, bool), value
    if annotation is int:
        return is_int(value), value
    if annotation is float:  # TOML's nan and inf are no setting's value
        ok = is_number(value) and math.isfinite(value)
        return ok, float(value) if ok else value
    if annotation is str:
        return isinstance(value, str), value
    raise TypeError(f"unsupported field type {annotation!r}")


_type_hints: dict[type, dict[str, Any]] = {}
_type_hints_lock = threading.Lock()


def type_hints(cls: type) -> dict[str, Any]:
    """``typing.get_type_hints(cls)``, evaluated once per class under a lock: it compiles the string
    annotations, and CPython 3.11's compiler fails on threads that compile at once ("AST constructor
    recursion depth mismatch", seen with clients on Flower's thread pool)."""
    with _type_hints_lock:
        if cls not in _type_hints:
            _type_hints[cls] = typing.get_type_hints(cls)
        return _type_hints[cls]


def parse_fields(cls: type, values: Mapping[str, Any], prefix: str = "", unknown: str = "key") -> dict[str, Any]:
    """``values`` checked against the dataclass ``cls``'s fields (key "a-b" for field ``a_b``, "b"
    for ``b_``): an unknown key, or a value not of its field's type, is a ``ValueError`` naming
    ``prefix + key``."""
    hints = type_hints(cls)
    fields = {f.name.rstrip("_"): f.name for f in dataclasses.fields(cls)}  # lambda_: the key "lambda"
    parsed: dict[str, Any] = {}
    for key, value in values.items():
        name = fields.get(key.replace("-", "_"))
        if name is None:
            raise ValueError(f"unknown {unknown} {prefix + key!r}")
        ok, parsed[name] = _conform(value, hints[name])
        if not ok:
            raise ValueError(f"{prefix + key} must be {_describe(hints[name])}, got {value!r}")
    return parsed
