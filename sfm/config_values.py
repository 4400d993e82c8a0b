"""How config values are read and checked (sfm.config): TOML literals and ``section.key=value`` overrides
(``--set``), coercion to a field's type, the range checks every section's ``check`` uses, TOML out, and the
vocabularies more than one section names (augmentations, store layouts, devices)."""

from __future__ import annotations

import dataclasses
import functools
import json
import types
import typing
from typing import Any, Iterable

from sfm.errors import SFMError

AUGMENTATIONS = ("flip_inline", "flip_crossline", "swap", "reverse_time", "invert_polarity")  # data.augment
LAYOUTS = ("sfm", "mdio")  # ingest.layout, predict.layout: the store's layout (sfm.formats.mdio_layout)


def toml_text(config: dict[str, Any]) -> str:
    """A job config dict ({section: {key: value}}; a dict value is a nested table, [section.key]) as TOML; None
    values are left out (the defaults)."""
    lines: list[str] = []

    def table(name: str, values: dict[str, Any]) -> None:
        lines.append(f"[{name}]")
        lines.extend(f"{key} = {json.dumps(value)}" for key, value in values.items()
                     if value is not None and not isinstance(value, dict))
        lines.append("")
        for key, value in values.items():
            if isinstance(value, dict):
                table(f"{name}.{key}", value)

    for section, values in config.items():
        table(section, values)
    return "\n".join(lines)


def parse_literal(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        if text.lower() in ("true", "false"):
            return text.lower() == "true"
        return text


@functools.cache
def field_types(section: type) -> dict[str, Any]:
    """The type of each field of the config section ``section``, as its annotation resolves."""
    hints = typing.get_type_hints(section)
    return {f.name: hints[f.name] for f in dataclasses.fields(section)}


def coerce(dotted: str, hint: Any, value: Any) -> Any:
    """Convert ``value`` to the field's type ``hint``, with a one-line error naming the key on failure. A tuple
    field takes a list, or one number for every element (a variable-length one: one number or name, a list of one)."""
    if typing.get_origin(hint) in (typing.Union, types.UnionType):  # X | None
        if value is None:
            return None
        hint = next(a for a in typing.get_args(hint) if a is not type(None))
    try:
        if typing.get_origin(hint) is tuple:
            elems = typing.get_args(hint)
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                value = [value] * (1 if Ellipsis in elems else len(elems))
            if isinstance(value, str) and Ellipsis in elems:  # one name (train.trackers=mlflow): a list of one
                value = [value]
            return tuple(elems[0](v) for v in value)
        if hint is bool:
            return value.lower() in ("1", "true", "yes") if isinstance(value, str) else bool(value)
        if hint is int:
            if isinstance(value, float) and not value.is_integer():
                raise ValueError("not an integer")
            return int(value)
        if hint in (float, str):
            return hint(value)
    except (TypeError, ValueError) as err:
        name = hint.__name__ if isinstance(hint, type) else str(hint)
        raise SFMError(f"config key '{dotted}' got {value!r}: {err}; expected {name}") from err
    return value


def at_least(section: str, values: Any, lows: dict[str, float], hints: dict[str, str] | None = None) -> None:
    """SFMError for the first setting ``key`` of ``lows`` under its lower bound (``hints[key]`` follows the message)."""
    for key, low in lows.items():
        value = getattr(values, key)
        if value < low:
            raise SFMError(f"{section}.{key} = {value} must be at least {low}{(hints or {}).get(key, '')}")


def fraction_in(key: str, value: float, ends: str, meaning: str) -> None:
    """SFMError unless ``value`` lies in [0, 1] with the ends ``ends`` says: "[]", "[)" or "()"."""
    low_ok = 0 <= value if ends[0] == "[" else 0 < value
    high_ok = value <= 1 if ends[1] == "]" else value < 1
    if not (low_ok and high_ok):
        raise SFMError(f"{key} = {value} must be in {ends[0]}0, 1{ends[1]} ({meaning})")


def one_of(key: str, value: Any, valid: tuple[str, ...]) -> None:
    if value not in valid:
        raise SFMError(f"{key} = {value!r} is not valid; use one of {', '.join(valid)}")


def split_assignments(assignments: str | Iterable[str]) -> list[str]:
    """The ``section.key=value`` items of ``--set``: each value given (the CLI's ``--set`` repeats; a flow's takes one
    string) may hold several, separated by ``;`` (``train.max_steps=500;data.batch_size=4``). SFMError for an item
    that is not an assignment."""
    items = [assignments] if isinstance(assignments, str) else list(assignments)
    out = [piece.strip() for item in items for piece in str(item).split(";") if piece.strip()]
    for item in out:
        key, sep, _ = item.partition("=")
        if not sep or "." not in key:
            raise SFMError(f"--set {item!r} must look like section.key=value (several: --set 'a.b=1;c.d=2')")
    return out


DEVICES = ("auto", "cpu", "cuda", "cuda:N")  # predict.device: what check_device accepts (N: a GPU's index)


def check_device(device: str) -> str:
    """``device`` if it is one of :data:`DEVICES` (``cuda:N`` with a number), else SFMError."""
    kind, sep, index = str(device).partition(":")
    if (kind, sep) in (("auto", ""), ("cpu", ""), ("cuda", "")) or (kind == "cuda" and sep and index.isdigit()):
        return device
    raise SFMError(f"device {device!r} is not a device; use {', '.join(DEVICES)}")
