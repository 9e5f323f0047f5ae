"""The calibration record: hardware constants, each regime's parameters, the routed group sizes,
and its JSON file.

Written by the calibrate rule, read by the route policy. The starting constants of a GPU live in
``conf/gpu/<gpu>.yaml`` in the same form. Files written before the regimes had their own names
(schema ``pkv.calibration/1``, one flat mapping with ``b8_margin``, ``boundary_route``, ...) still
load: ``LEGACY_FIELDS`` says where each of their fields went. So do files written while the skew
budget was one value for every regime (``pkv.calibration/2``, a top-level ``skew_target_ctas``).
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields
from pathlib import Path

from pkv.atomic_io import write_text_atomic
from pkv.pipeline.schedule import SPLIT_KINDS
from pkv.policy.regime import (
    FEW_ROWS,
    MANY_ROWS,
    REGIMES,
    SINGLE_ROW,
    CalibrationError,
    RegimeParams,
    is_int,
    is_number,
)
from pkv.policy.route import ROUTE_BUCKET, ROUTE_FLASHINFER, ROUTE_WORKQUEUE

CALIBRATION_SCHEMA = "pkv.calibration/3"
ONE_SKEW_BUDGET_SCHEMA = "pkv.calibration/2"
LEGACY_SCHEMA = "pkv.calibration/1"

# Hardware and host constants of the cost model, the names they have in the record and the rule
# each value must follow.
_POSITIVE = (lambda v: math.isfinite(v) and v > 0, "finite and > 0")
_NON_NEGATIVE = (lambda v: math.isfinite(v) and v >= 0, "finite and >= 0")
_CONSTANTS = {"beta_gbps": _POSITIVE, "lambda_us": _NON_NEGATIVE, "c_min": _NON_NEGATIVE,
              "flashinfer_plan_us": _NON_NEGATIVE, "persistentkv_plan_us": _NON_NEGATIVE,
              "flashinfer_ctas_per_row_head": _POSITIVE}


@dataclass(frozen=True)
class Calibration:
    gpu: str
    num_sms: int
    beta_gbps: float  # measured streaming read bandwidth
    lambda_us: float  # cost of one launch
    c_min: float  # decode CTAs per SM below which a step cannot reach bandwidth
    single_row: RegimeParams
    few_rows: RegimeParams
    many_rows: RegimeParams
    supported_group_sizes: tuple[int, ...] = (4,)  # G routed to PersistentKV at all
    workqueue_split_kind: str = "fixed"  # how the workqueue gives rows splits (SplitPolicy.kind)
    # A workqueue step whose rows have about one length takes about this many CTAs where its
    # regime's split count would give more (pkv.policy.choose, uniform_split_count); 0: no cap.
    uniform_target_ctas: int = 0
    flashinfer_plan_us: float = 0.0  # measured host planning per step, charged to each route
    persistentkv_plan_us: float = 0.0
    flashinfer_ctas_per_row_head: float = 1.0
    source: str = "config"

    def __post_init__(self):
        if not isinstance(self.gpu, str) or not self.gpu:
            raise CalibrationError(f"field gpu={self.gpu!r}: must be a non-empty name")
        if not is_int(self.num_sms) or self.num_sms < 1:
            raise CalibrationError(f"field num_sms={self.num_sms!r}: must be an integer >= 1")
        object.__setattr__(self, "num_sms", int(self.num_sms))
        for name, (ok, rule) in _CONSTANTS.items():
            value = getattr(self, name)
            if not is_number(value) or not ok(float(value)):
                raise CalibrationError(f"field {name}={value!r}: must be a number, {rule}")
            object.__setattr__(self, name, float(value))
        for name in REGIMES:
            if not isinstance(getattr(self, name), RegimeParams):
                raise CalibrationError(f"field {name}={getattr(self, name)!r}: must be a RegimeParams")
        groups = self.supported_group_sizes
        if not isinstance(groups, (list, tuple)) or not groups or not all(is_int(g) and g >= 1 for g in groups):
            raise CalibrationError(f"field supported_group_sizes={groups!r}: must be a non-empty list of integers >= 1")
        object.__setattr__(self, "supported_group_sizes", tuple(int(g) for g in groups))
        if not is_int(self.uniform_target_ctas) or self.uniform_target_ctas < 0:
            raise CalibrationError(f"field uniform_target_ctas={self.uniform_target_ctas!r}: must be an integer >= 0")
        object.__setattr__(self, "uniform_target_ctas", int(self.uniform_target_ctas))
        if self.workqueue_split_kind not in SPLIT_KINDS:
            raise CalibrationError(f"field workqueue_split_kind={self.workqueue_split_kind!r}: must be one of "
                                   f"{list(SPLIT_KINDS)}")
        if not isinstance(self.source, str):
            raise CalibrationError(f"field source={self.source!r}: must be a string")

    def regime(self, name: str) -> RegimeParams:
        if name not in REGIMES:
            raise ValueError(f"unknown regime {name!r}; regimes: {REGIMES}")
        return getattr(self, name)

    def with_regime(self, name: str, **changes) -> "Calibration":
        """A copy with some parameters of one regime replaced."""
        return dataclasses.replace(self, **{name: dataclasses.replace(self.regime(name), **changes)})

    def with_all_regimes(self, **changes) -> "Calibration":
        return dataclasses.replace(self, **{name: dataclasses.replace(self.regime(name), **changes)
                                            for name in REGIMES})

    # ---- mappings and files --------------------------------------------------------------------
    def to_json_dict(self) -> dict:
        out = {f.name: getattr(self, f.name) for f in fields(self) if f.name not in REGIMES}
        out["supported_group_sizes"] = list(self.supported_group_sizes)
        out["regimes"] = {name: dataclasses.asdict(self.regime(name)) for name in REGIMES}
        return out

    @classmethod
    def from_mapping(cls, d: Mapping, where: str) -> "Calibration":
        """Build from a YAML/JSON mapping (either form); errors name ``where``, the key and the value."""
        if not isinstance(d, Mapping):
            raise CalibrationError(f"{where}: expected a mapping of calibration fields, got {type(d).__name__}")
        d = {key: _plain(value) for key, value in d.items()}
        if "regimes" not in d:  # the flat form, defaults as it had them
            d = _from_legacy(d, where)
        d = _skew_budget_per_regime(d, where)
        top = [f.name for f in fields(cls) if f.name not in REGIMES]
        known = [*top, "regimes"]
        for key, value in d.items():
            if key not in known:
                raise CalibrationError(f"{where}: unknown key {key!r} (value {value!r}); known keys: "
                                       f"{', '.join(known)}")
        required = [f.name for f in fields(cls) if f.default is dataclasses.MISSING and f.name not in REGIMES]
        missing = [name for name in [*required, "regimes"] if name not in d]
        if missing:
            raise CalibrationError(f"{where}: missing required key(s) {', '.join(missing)}")
        regimes = d["regimes"]
        if not isinstance(regimes, Mapping) or set(regimes) != set(REGIMES):
            found = sorted(regimes) if isinstance(regimes, Mapping) else regimes
            raise CalibrationError(f"{where}: field regimes={found!r}: must map each of {list(REGIMES)} to its "
                                   f"parameters")
        values = {key: value for key, value in d.items() if key != "regimes"}
        for name in REGIMES:
            values[name] = RegimeParams.from_mapping(regimes[name], f"{where}: regimes.{name}")
        try:
            return cls(**values)
        except CalibrationError as err:
            raise CalibrationError(f"{where}: {err}") from None


def _plain(value):
    """OmegaConf containers as plain dicts and lists, so errors show plain values."""
    if isinstance(value, Mapping):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, Sequence) and not isinstance(value, (str, bytes)):
        return [_plain(v) for v in value]
    return value


# Fields of the flat form and where they went: a top-level name, or (regime, parameter). A legacy
# null context gate meant "the single-row gate".
LEGACY_FIELDS = {
    "min_context_tokens": (SINGLE_ROW, "min_context_tokens"),
    "boundary_min_context_tokens": (FEW_ROWS, "min_context_tokens"),
    "workqueue_min_context_tokens": (MANY_ROWS, "min_context_tokens"),
    "bucket_num_splits": (SINGLE_ROW, "num_splits"),
    "boundary_num_splits": (FEW_ROWS, "num_splits"),
    "workqueue_num_splits": (MANY_ROWS, "num_splits"),
    "boundary_route": (FEW_ROWS, "route"),
    "b8_margin": ((SINGLE_ROW, "margin"), (MANY_ROWS, "margin")),  # it governed B1 as well as 8+ rows
    "b4_margin": (FEW_ROWS, "margin"),
}
_LEGACY_DEFAULTS = {"min_context_tokens": 16384, "b8_margin": 1.05, "b4_margin": 1.50, "bucket_num_splits": 32,
                    "workqueue_num_splits": 20, "boundary_route": ROUTE_FLASHINFER, "boundary_num_splits": 32}


def _from_legacy(d: dict, where: str) -> dict:
    """The flat form's mapping in the regimes form (defaults as the flat record had them)."""
    flat = {**_LEGACY_DEFAULTS, **d}
    regimes = {SINGLE_ROW: {"route": ROUTE_BUCKET}, FEW_ROWS: {}, MANY_ROWS: {"route": ROUTE_WORKQUEUE}}
    out = {}
    for key, value in flat.items():
        target = LEGACY_FIELDS.get(key)
        if target is None:
            out[key] = value
            continue
        for regime, param in (target if isinstance(target[0], tuple) else (target,)):
            regimes[regime][param] = value
    for regime in (FEW_ROWS, MANY_ROWS):
        if regimes[regime].get("min_context_tokens") is None:
            regimes[regime]["min_context_tokens"] = regimes[SINGLE_ROW]["min_context_tokens"]
    if regimes[FEW_ROWS]["route"] not in (ROUTE_FLASHINFER, ROUTE_WORKQUEUE):
        raise CalibrationError(f"{where}: field boundary_route={regimes[FEW_ROWS]['route']!r}: must be one of "
                               f"{[ROUTE_FLASHINFER, ROUTE_WORKQUEUE]}")
    out["regimes"] = regimes
    return out


def _skew_budget_per_regime(d: dict, where: str) -> dict:
    """Files written while the skew budget was one value for every regime hold a top-level
    ``skew_target_ctas``: it governed each regime's workqueue steps, so each regime gets it."""
    if "skew_target_ctas" not in d:
        return d
    d = dict(d)
    budget = d.pop("skew_target_ctas")
    regimes = d.get("regimes")
    if isinstance(regimes, Mapping):
        for name, params in regimes.items():
            if isinstance(params, Mapping) and "skew_target_ctas" in params:
                raise CalibrationError(f"{where}: field skew_target_ctas={budget!r}: set per regime "
                                       f"(regimes.{name}.skew_target_ctas), not at the top as well")
        d["regimes"] = {name: {**params, "skew_target_ctas": budget} if isinstance(params, Mapping) else params
                        for name, params in regimes.items()}
    return d


def regime_field(regime: str, param: str) -> str:
    """A regime parameter's path in the record: how the calibration's measurements name what a fit set."""
    return f"regimes.{regime}.{param}"


def load_calibration(path) -> Calibration:
    """Read a calibration JSON written by save_calibration (either schema)."""
    return load_calibration_record(path)[0]


def recorded_profile(record: Mapping) -> str | None:
    """The profile ("gpu" or "cpu") the run that wrote a calibration record ran under: its
    provenance's resolved config says, else its measurements (marked not a performance result on
    the CPU profile), else its source line; None where the record does not say (a hand-written
    file). The one place a calibration's profile is read."""
    provenance = record.get("provenance")
    provenance = provenance if isinstance(provenance, Mapping) else {}
    config = provenance.get("config")
    profile = config.get("profile") if isinstance(config, Mapping) else None
    if isinstance(profile, str):
        return profile
    measured = provenance.get("measurements")
    if isinstance(measured, Mapping) and isinstance(measured.get("performance_result"), bool):
        return "gpu" if measured["performance_result"] else "cpu"
    calib = record.get("calibration")
    source = str(calib.get("source", "")) if isinstance(calib, Mapping) else ""
    return "cpu" if "profile cpu" in source else None


def load_calibration_record(path) -> tuple[Calibration, dict]:
    """load_calibration, and the whole record it read (its provenance included)."""
    path = Path(path)
    try:
        record = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as err:
        raise CalibrationError(f"{path}: not valid JSON ({err})") from None
    except UnicodeDecodeError as err:
        raise CalibrationError(f"{path}: not UTF-8 text ({err})") from None
    except IsADirectoryError:
        raise CalibrationError(f"{path}: is a folder, not a calibration file") from None
    if not isinstance(record, dict) or record.get("schema") not in (CALIBRATION_SCHEMA, ONE_SKEW_BUDGET_SCHEMA,
                                                                    LEGACY_SCHEMA):
        found = record.get("schema") if isinstance(record, dict) else type(record).__name__
        raise CalibrationError(f"{path}: field schema={found!r}: expected {CALIBRATION_SCHEMA!r} "
                               f"(or the older {ONE_SKEW_BUDGET_SCHEMA!r} or {LEGACY_SCHEMA!r})")
    if "calibration" not in record:
        raise CalibrationError(f"{path}: missing field 'calibration'")
    return Calibration.from_mapping(record["calibration"], where=f"{path}: calibration"), record


def save_calibration(path, calib: Calibration, provenance: Mapping) -> None:
    """Write the calibration JSON atomically."""
    record = {"schema": CALIBRATION_SCHEMA, "calibration": calib.to_json_dict(), "provenance": dict(provenance)}
    write_text_atomic(path, json.dumps(record, indent=2, sort_keys=True, allow_nan=False) + "\n")
