"""Generate traces/fixture_mixed.csv, the redistributable mixed request trace.

The fixture is synthetic, so it can ship with the project: 32 requests whose prompts mix the
regimes of the synthetic families (short interactive contexts, mid-size documents and 32K-64K
long contexts) and which arrive as a Poisson stream. At max_active 8 its steps are ragged and
admission keeps refilling freed slots, which is what the trace-file replay path must exercise.

    python -m pkv.pipeline.make_fixture [output.csv]
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

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


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) > 1:
        print("usage: python -m pkv.pipeline.make_fixture [output.csv]", file=sys.stderr)
        return 2
    out = Path(args[0]) if args else DEFAULT_OUTPUT
    write_trace_csv(out, make_mixed_fixture())
    print(out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
