"""Generate the redistributable synthetic request traces under traces/.

The fixtures are synthetic, so they can ship with the project.

- ``fixture_mixed.csv``: 32 requests whose prompts mix the regimes of the synthetic families
  (short interactive contexts, mid-size documents and 32K-64K long contexts) and which arrive as
  a Poisson stream. At max_active 8 its steps are ragged and admission keeps refilling freed
  slots, which is what the trace-file replay path must exercise.
- ``long_context_conv.jsonl``: 1024 conversation requests in the timestamped JSON-lines form
  (``timestamp`` in ms, ``input_length``, ``output_length``), with context lengths drawn from a
  log-normal whose median, 90th and 99th percentiles (6.9K, 27K, about 82K tokens) match those of
  public long-context conversation traces. Replayed whole, its requests together hold far more KV
  than one device, so it exercises the recycled KV pool: requests finish, their pages go back to
  the pool and later requests take them again.

    python -m pkv.pipeline.make_fixture [output.csv]
    python -m pkv.pipeline.make_fixture --long-context [output.jsonl]
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np

from pkv.atomic_io import write_text_atomic
from pkv.pipeline.trace_readers import write_trace_csv
from pkv.pipeline.traces import K, Request

FIXTURE_SEED = 20260601
FIXTURE_NUM_REQUESTS = 32
FIXTURE_ARRIVAL_RATE = 0.25  # requests per decode step
FIXTURE_DECODE_RANGE = (32, 128)
# (share of requests, prompt length range in tokens)
FIXTURE_MIX = (
    (0.50, (1 * K, 12 * K)),
    (0.25, (12 * K, 32 * K)),
    (0.25, (32 * K, 64 * K)),
)
DEFAULT_OUTPUT = Path(__file__).resolve().parents[2] / "traces" / "fixture_mixed.csv"

LONG_CONTEXT_SEED = 20261206
LONG_CONTEXT_NUM_REQUESTS = 1024
# log-normal context lengths: median exp(mu), 90th percentile exp(mu + 1.2816 sigma)
LONG_CONTEXT_MEDIAN = 6900
LONG_CONTEXT_P90 = 27_000
LONG_CONTEXT_RANGE = (64, 192 * K)
LONG_CONTEXT_OUTPUT_MEDIAN = 96
LONG_CONTEXT_OUTPUT_SIGMA = 0.8
LONG_CONTEXT_OUTPUT_RANGE = (8, 1024)
LONG_CONTEXT_RATE_PER_S = 2.0  # arrivals per second: at 50 ms a step, more than max_active 8 admits
LONG_CONTEXT_OUTPUT = DEFAULT_OUTPUT.with_name("long_context_conv.jsonl")


def make_mixed_fixture(seed: int = FIXTURE_SEED, num_requests: int = FIXTURE_NUM_REQUESTS) -> list[Request]:
    rng = np.random.default_rng(seed)
    shares = np.array([share for share, _ in FIXTURE_MIX])
    component = rng.choice(len(FIXTURE_MIX), size=num_requests, p=shares / shares.sum())
    lo = np.array([FIXTURE_MIX[c][1][0] for c in component])
    hi = np.array([FIXTURE_MIX[c][1][1] for c in component])
    prompt = rng.integers(lo, hi, endpoint=True)
    decode = rng.integers(FIXTURE_DECODE_RANGE[0], FIXTURE_DECODE_RANGE[1], size=num_requests, endpoint=True)
    gaps = rng.exponential(1.0 / FIXTURE_ARRIVAL_RATE, size=num_requests)
    gaps[0] = 0.0
    arrival = np.floor(np.cumsum(gaps)).astype(np.int64)
    return [
        Request(request_id=i, arrival_step=int(a), prompt_len=int(p), decode_len=int(d))
        for i, (a, p, d) in enumerate(zip(arrival.tolist(), prompt.tolist(), decode.tolist()))
    ]


def long_context_records(seed: int = LONG_CONTEXT_SEED, num_requests: int = LONG_CONTEXT_NUM_REQUESTS) -> list[dict]:
    """The long-context conversation fixture's records, in the timestamped JSON-lines form."""
    rng = np.random.default_rng(seed)
    mu = np.log(LONG_CONTEXT_MEDIAN)
    sigma = np.log(LONG_CONTEXT_P90 / LONG_CONTEXT_MEDIAN) / 1.2816
    context = np.clip(np.rint(rng.lognormal(mu, sigma, num_requests)), *LONG_CONTEXT_RANGE).astype(np.int64)
    output = np.clip(np.rint(rng.lognormal(np.log(LONG_CONTEXT_OUTPUT_MEDIAN), LONG_CONTEXT_OUTPUT_SIGMA,
                                           num_requests)), *LONG_CONTEXT_OUTPUT_RANGE).astype(np.int64)
    gaps_ms = rng.exponential(1000.0 / LONG_CONTEXT_RATE_PER_S, num_requests)
    gaps_ms[0] = 0.0
    stamps = np.floor(np.cumsum(gaps_ms)).astype(np.int64)
    return [{"timestamp": int(t), "input_length": int(c), "output_length": int(o)}
            for t, c, o in zip(stamps.tolist(), context.tolist(), output.tolist())]


def write_long_context_fixture(path) -> Path:
    text = "".join(json.dumps(record, separators=(",", ":")) + "\n" for record in long_context_records())
    return write_text_atomic(path, text)


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    long_context = "--long-context" in args
    if long_context:
        args.remove("--long-context")
    if len(args) > 1:
        print("usage: python -m pkv.pipeline.make_fixture [--long-context] [output]", file=sys.stderr)
        return 2
    if long_context:
        out = write_long_context_fixture(Path(args[0]) if args else LONG_CONTEXT_OUTPUT)
    else:
        out = Path(args[0]) if args else DEFAULT_OUTPUT
        write_trace_csv(out, make_mixed_fixture())
    print(out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
