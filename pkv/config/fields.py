"""The schema's fields, walked: which keys it declares (Hydra's ``+key=value`` must not add one it
does not) and whether each numeric value lies within the Bound its field carries
(pkv.config.schema). Each check returns the problem, (field, value, why), or None; pkv.config.checks
turns it into a ConfigError naming the file."""

from __future__ import annotations

import dataclasses
import typing
from collections.abc import Sequence
from typing import Any

from omegaconf import DictConfig, ListConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from pkv.config.schema import GPU_BOUNDS, Bound, PkvConfig
from pkv.policy.calibration import Calibration
from pkv.policy.regime import REGIMES


# ---------------------------------------------------------------------------------------------
# keys the schema does not know: Hydra's `+key=value` and `++key=value` add them past the typed
# schema, and OmegaConf.to_object would drop them without a word


def _field_types(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _dataclass_of(hint: Any) -> type | None:
    """The dataclass a field holds (itself, Optional[...]), else None."""
    if dataclasses.is_dataclass(hint):
        return hint
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    if typing.get_origin(hint) is typing.Union and len(args) == 1 and dataclasses.is_dataclass(args[0]):
        return args[0]
    return None


def _list_item_dataclass(hint: Any) -> type | None:
    if typing.get_origin(hint) is list:
        (item,) = typing.get_args(hint) or (None,)
        return item if dataclasses.is_dataclass(item) else None
    return None


def _node_value(node: DictConfig, key: Any) -> Any:
    try:
        value = node[key]
        return OmegaConf.to_container(value) if isinstance(value, (DictConfig, ListConfig)) else value
    except OmegaConfBaseException:
        return "???"


def schema_key_problem(key: str) -> str | None:
    """Why a dotted override key (``trace.num_requests``, ``gpu.num_sms``) names no field of the
    schema, or None. Mappings typed Dict (gpu, experiment.variant_keys) take any key below them."""
    hint: Any = PkvConfig
    parts = key.split(".")
    for i, part in enumerate(parts):
        cls = _dataclass_of(hint)
        where = ".".join(parts[:i]) or "the top level"
        if cls is not None:
            types = _field_types(cls)
            if part not in types:
                return f"not a field of {where} ({cls.__name__}: {', '.join(types)})"
            hint = types[part]
        elif typing.get_origin(hint) is list:
            if not part.isdigit():
                return f"{where} is a list: expected an index, got {part!r}"
            hint = typing.get_args(hint)[0]
        elif typing.get_origin(hint) is dict or hint is Any:
            return None
        else:
            return f"{where} is a value, it has no field {part!r}"
    return None


def unknown_key(node: DictConfig, cls: type, prefix: str) -> tuple[str, Any, str] | None:
    """(field, value, why) of the first key in node that cls does not declare, depth first."""
    types = _field_types(cls)
    for key in node.keys():
        name = f"{prefix}{key}"
        if key not in types:
            return name, _node_value(node, key), f"not a field of the schema ({cls.__name__}: {', '.join(types)})"
        sub = node._get_node(key)
        if isinstance(sub, DictConfig) and _dataclass_of(types[key]) is not None:
            found = unknown_key(sub, _dataclass_of(types[key]), f"{name}.")
        elif isinstance(sub, ListConfig) and _list_item_dataclass(types[key]) is not None:
            found = next((hit for i, item in enumerate(sub) if isinstance(item, DictConfig)
                          for hit in [unknown_key(item, _list_item_dataclass(types[key]), f"{name}[{i}].")]
                          if hit), None)
        else:
            found = None
        if found:
            return found
    return None


# ---------------------------------------------------------------------------------------------
# bounds (pkv.config.schema: each numeric field's Bound, and why)


def bound_problem(bound: Bound, value: Any) -> str | None:
    values = value if isinstance(value, (list, tuple)) else [value]
    for v in values:
        if v is None:
            continue
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            return f"must be a number ({bound.why})"
        why = bound.problem(v)
        if why:
            return why
    return None


def bounds_problem(obj: Any, prefix: str, only: Sequence[str] | None = None) -> tuple[str, Any, str] | None:
    """(field, value, why) of the first bounded field of the dataclass obj out of its range (of those
    named in `only`, if given, and of the dataclasses they hold), else None. An entry of a list of
    dataclasses is named whole, with its values."""
    for f in dataclasses.fields(obj):
        if only is not None and f.name not in only:
            continue
        value, name = getattr(obj, f.name), f"{prefix}{f.name}"
        if dataclasses.is_dataclass(value):
            found = bounds_problem(value, f"{name}.")
        elif isinstance(value, list) and value and all(dataclasses.is_dataclass(v) for v in value):
            found = next(((f"{name}[{i}]", dataclasses.asdict(item), f"{hit[0]} {hit[2]}")
                          for i, item in enumerate(value) for hit in [bounds_problem(item, "")] if hit), None)
        elif "bound" in f.metadata:
            why = bound_problem(f.metadata["bound"], value)
            found = (name, value, why) if why else None
        else:
            found = None
        if found:
            return found
    return None


def calibration_bounds_problem(calib: Calibration) -> tuple[str, Any, str] | None:
    """The first constant of a calibration (a conf/gpu file or a calibration JSON) past its
    GPU_BOUNDS, as (path, value, why), else None."""
    for name, bound in GPU_BOUNDS.items():
        _, _, param = name.partition("regimes.*.")
        values = ([(f"regimes.{r}.{param}", getattr(calib.regime(r), param)) for r in REGIMES] if param
                  else [(name, getattr(calib, name))])
        for path, value in values:
            why = bound_problem(bound, value)
            if why:
                return path, value, why
    return None
