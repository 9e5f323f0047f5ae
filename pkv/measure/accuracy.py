"""Error metrics and the paper's correctness bounds."""

from __future__ import annotations

import math

import torch

# The paper's serving correctness threshold (section 3.6), FP32 compare against the baseline.
PAPER_MAX_ABS = 2e-3
PAPER_MEAN_ABS = 3e-4


class AccuracyError(ValueError):
    """An engine's output is outside the correctness bounds."""


def compare(out: torch.Tensor, ref: torch.Tensor) -> dict:
    """max |e|, mean |e| and ||e|| / ||ref||, in float32 (float64 when either side is float64).

    Non-finite outputs give infinite errors so they can never pass a bound.
    """
    if out.shape != ref.shape:
        raise ValueError(f"compare: output shape {tuple(out.shape)} != reference {tuple(ref.shape)}")
    dtype = torch.float64 if torch.float64 in (out.dtype, ref.dtype) else torch.float32
    a = out.detach().to(device=ref.device, dtype=dtype)
    b = ref.detach().to(dtype)
    if not bool(torch.isfinite(a).all()) or not bool(torch.isfinite(b).all()):
        return {"max_abs_err": math.inf, "mean_abs_err": math.inf, "rel_err": math.inf}
    err = (a - b).abs()
    ref_norm = float(torch.linalg.vector_norm(b))
    err_norm = float(torch.linalg.vector_norm(a - b))
    rel = err_norm / ref_norm if ref_norm > 0 else (0.0 if err_norm == 0 else math.inf)
    return {
        "max_abs_err": float(err.max()) if err.numel() else 0.0,
        "mean_abs_err": float(err.mean()) if err.numel() else 0.0,
        "rel_err": rel,
    }


def check_within(errors: dict, *, max_abs: float = PAPER_MAX_ABS, mean_abs: float = PAPER_MEAN_ABS,
                 rel: float | None = None) -> bool:
    """True when ``errors`` (from ``compare``) is inside every given bound; NaN never passes."""
    checks = [errors["max_abs_err"] < max_abs, errors["mean_abs_err"] < mean_abs]
    if rel is not None:
        checks.append(errors["rel_err"] < rel)
    return all(checks)


def require_within(errors: dict, label: str, **bounds) -> None:
    """Raise AccuracyError naming ``label`` and the errors when ``check_within`` fails."""
    if not check_within(errors, **bounds):
        limits = {"max_abs": PAPER_MAX_ABS, "mean_abs": PAPER_MEAN_ABS, **bounds}
        raise AccuracyError(
            f"{label}: max|e|={errors['max_abs_err']:.3e}, mean|e|={errors['mean_abs_err']:.3e}, "
            f"rel={errors['rel_err']:.3e} outside the bounds {limits}"
        )
