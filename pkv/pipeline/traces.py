"""Requests and the seeded synthetic trace families (paper 3.8).

A trace is a list of :class:`Request`. Each family isolates one scheduling factor: context length
(``homogeneous``), a small set of fixed context budgets (``bucketed``), length raggedness
(``bimodal``), broad or heavy-tailed length spreads (``uniform``, ``zipf``), and one long context
among many short ones (``skewed``).

Lengths are in tokens with K = 1024:

- ``bucketed``: prompt lengths cycle 8K, 16K, 32K, 64K in request order.
- ``homogeneous``: every prompt is 32K.
- ``bimodal``: the requests form consecutive blocks of four; each block holds one long prompt
  (64K) at a seeded position and three short prompts drawn uniformly from 4K..12K, so every
  window of four requests keeps the 1:3 ratio (a trailing partial block keeps the seeded
  positions that fall inside it).
- ``uniform``: prompts drawn uniformly from 4K..64K.
- ``zipf``: prompts drawn from a bounded power law p(n) ~ n^-ZIPF_EXPONENT on 1K..64K
  (exponent 1.2: the median is about 5.4K while about one prompt in nine is longer than 32K).
- ``skewed``: blocks of 64 requests, each holding one long prompt (128K) at a seeded position
  among its first 16 and 63 short prompts drawn uniformly from 64..1K: a long-document request
  served beside chat turns, so that in most steps of a 64-row batch one row holds most of the
  tokens (pkv.policy.choose.is_skewed). The long prompt comes early in its block, so a replay of
  the first 16 requests (the CPU profile's) holds one too.

Every draw comes from ``numpy.random.default_rng`` seeded by ``(seed, family)``, with separate
child streams for prompt lengths, decode lengths and arrivals: the same seed gives the same trace,
and switching the arrival process does not change the lengths.
"""

from __future__ import annotations

import math
import zlib
from dataclasses import dataclass

import numpy as np

K = 1024

TRACE_FAMILIES = ("bucketed", "homogeneous", "bimodal", "uniform", "zipf", "skewed")
ARRIVAL_PROCESSES = ("burst", "poisson")

BUCKETED_PROMPT_LENS = (8 * K, 16 * K, 32 * K, 64 * K)
HOMOGENEOUS_PROMPT_LEN = 32 * K
BIMODAL_LONG_LEN = 64 * K
BIMODAL_SHORT_RANGE = (4 * K, 12 * K)
BIMODAL_BLOCK = 4  # one long request per three short ones
UNIFORM_RANGE = (4 * K, 64 * K)
ZIPF_RANGE = (1 * K, 64 * K)
ZIPF_EXPONENT = 1.2
SKEWED_LONG_LEN = 128 * K
SKEWED_SHORT_RANGE = (64, 1 * K)
SKEWED_BLOCK = 64  # one long request per 63 short ones
SKEWED_LONG_WINDOW = 16  # the long request's position in its block: one of the first 16


@dataclass(frozen=True)
class Request:
    """One decode request: it arrives at ``arrival_step`` with ``prompt_len`` tokens of context
    already cached and then generates ``decode_len`` tokens, one per decode step."""

    request_id: int
    arrival_step: int
    prompt_len: int
    decode_len: int

    def __post_init__(self) -> None:
        for name in ("request_id", "arrival_step", "prompt_len", "decode_len"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
                raise ValueError(f"Request.{name} must be an integer, got {value!r}")
            # Plain ints, so requests serialise to JSON and compare equal whatever built them.
            object.__setattr__(self, name, int(value))
        if self.arrival_step < 0:
            raise ValueError(f"Request.arrival_step must be >= 0, got {self.arrival_step}")
        if self.prompt_len < 0:
            raise ValueError(f"Request.prompt_len must be >= 0, got {self.prompt_len}")
        if self.decode_len < 1:
            raise ValueError(f"Request.decode_len must be >= 1, got {self.decode_len}")

    @property
    def total_len(self) -> int:
        """Context length after the last decode step: what the page allocator must reserve."""
        return self.prompt_len + self.decode_len


def family_seed_sequence(seed: int, family: str) -> np.random.SeedSequence:
    """The root seed sequence of one (seed, family) stream.

    crc32 rather than ``hash()``: string hashing is salted per process, and traces must be
    identical across processes and machines."""
    return np.random.SeedSequence([int(seed), zlib.crc32(family.encode("utf-8"))])


def _check_args(family, num_requests, seed, length_scale, decode_len_range, arrivals, arrival_rate):
    if family not in TRACE_FAMILIES:
        raise ValueError(f"trace family must be one of {TRACE_FAMILIES}, got {family!r}")
    if isinstance(num_requests, bool) or not isinstance(num_requests, (int, np.integer)) or num_requests < 1:
        raise ValueError(f"num_requests must be an integer >= 1, got {num_requests!r}")
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or seed < 0:
        raise ValueError(f"seed must be a non-negative integer, got {seed!r}")
    if not (isinstance(length_scale, (int, float)) and math.isfinite(length_scale) and length_scale > 0):
        raise ValueError(f"length_scale must be a finite number > 0, got {length_scale!r}")
    try:
        lo, hi = decode_len_range
    except (TypeError, ValueError):
        raise ValueError(f"decode_len_range must be a pair (lo, hi), got {decode_len_range!r}") from None
    if not all(isinstance(v, (int, np.integer)) and not isinstance(v, bool) for v in (lo, hi)) or not 1 <= lo <= hi:
        raise ValueError(f"decode_len_range must be integers with 1 <= lo <= hi, got {decode_len_range!r}")
    if arrivals not in ARRIVAL_PROCESSES:
        raise ValueError(f"arrivals must be one of {ARRIVAL_PROCESSES}, got {arrivals!r}")
    if not (isinstance(arrival_rate, (int, float)) and math.isfinite(arrival_rate) and arrival_rate > 0):
        raise ValueError(f"arrival_rate must be a finite number > 0 (requests per step), got {arrival_rate!r}")


def _prompt_lens(family: str, n: int, rng: np.random.Generator) -> np.ndarray:
    if family == "bucketed":
        return np.resize(np.array(BUCKETED_PROMPT_LENS, dtype=np.int64), n)
    if family == "homogeneous":
        return np.full(n, HOMOGENEOUS_PROMPT_LEN, dtype=np.int64)
    if family == "bimodal":
        num_blocks = -(-n // BIMODAL_BLOCK)
        long_slot = rng.integers(0, BIMODAL_BLOCK, size=num_blocks)
        is_long = (np.arange(num_blocks * BIMODAL_BLOCK) % BIMODAL_BLOCK) == np.repeat(long_slot, BIMODAL_BLOCK)
        short = rng.integers(BIMODAL_SHORT_RANGE[0], BIMODAL_SHORT_RANGE[1], size=n, endpoint=True)
        return np.where(is_long[:n], BIMODAL_LONG_LEN, short).astype(np.int64)
    if family == "uniform":
        return rng.integers(UNIFORM_RANGE[0], UNIFORM_RANGE[1], size=n, endpoint=True, dtype=np.int64)
    if family == "zipf":
        # Inverse CDF of the bounded power law with density ~ x^-a on [lo, hi].
        lo, hi = ZIPF_RANGE
        a1 = 1.0 - ZIPF_EXPONENT
        u = rng.random(n)
        x = (lo**a1 + u * (hi**a1 - lo**a1)) ** (1.0 / a1)
        return np.clip(np.rint(x), lo, hi).astype(np.int64)
    if family == "skewed":
        num_blocks = -(-n // SKEWED_BLOCK)
        long_at = np.arange(num_blocks) * SKEWED_BLOCK + rng.integers(0, SKEWED_LONG_WINDOW, size=num_blocks)
        prompt = rng.integers(SKEWED_SHORT_RANGE[0], SKEWED_SHORT_RANGE[1], size=n, endpoint=True, dtype=np.int64)
        prompt[long_at[long_at < n]] = SKEWED_LONG_LEN
        return prompt
    raise AssertionError(family)  # unreachable: checked by _check_args


def _arrival_steps(arrivals: str, n: int, rate: float, rng: np.random.Generator) -> np.ndarray:
    if arrivals == "burst":
        return np.zeros(n, dtype=np.int64)
    # The first request opens the trace at step 0, like a replayed log measured from its first
    # timestamp; the others follow after exponential gaps.
    gaps = rng.exponential(1.0 / rate, size=n)
    gaps[0] = 0.0
    return np.floor(np.cumsum(gaps)).astype(np.int64)


def synthetic_trace(
    family: str,
    num_requests: int,
    seed: int,
    *,
    length_scale: float = 1.0,
    decode_len_range: tuple[int, int] = (32, 128),
    arrivals: str = "burst",
    arrival_rate: float = 1.0,
) -> list[Request]:
    """A seeded synthetic trace of ``num_requests`` requests with ids 0..n-1.

    ``length_scale`` multiplies every prompt length (the CPU profile replays the same shapes at
    e.g. 1/64 scale), rounding to the nearest token and keeping at least one. Decode lengths are
    uniform on the inclusive ``decode_len_range``. ``arrivals="burst"`` puts every request at
    step 0; ``"poisson"`` draws exponential inter-arrival gaps with mean ``1 / arrival_rate``
    steps and floors the arrival times to steps.
    """
    _check_args(family, num_requests, seed, length_scale, decode_len_range, arrivals, arrival_rate)
    prompt_ss, decode_ss, arrival_ss = family_seed_sequence(seed, family).spawn(3)
    n = int(num_requests)
    prompt = _prompt_lens(family, n, np.random.default_rng(prompt_ss))
    if length_scale != 1.0:
        prompt = np.maximum(1, np.rint(prompt * float(length_scale))).astype(np.int64)
    lo, hi = decode_len_range
    decode = np.random.default_rng(decode_ss).integers(lo, hi, size=n, endpoint=True, dtype=np.int64)
    arrival = _arrival_steps(arrivals, n, float(arrival_rate), np.random.default_rng(arrival_ss))
    return [
        Request(request_id=i, arrival_step=int(a), prompt_len=int(p), decode_len=int(d))
        for i, (a, p, d) in enumerate(zip(arrival.tolist(), prompt.tolist(), decode.tolist()))
    ]
