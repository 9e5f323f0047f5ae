import numpy as np
import pytest

from pkv.pipeline.traces import K, TRACE_FAMILIES, ZIPF_EXPONENT, Request, synthetic_trace


def _prompts(trace):
    return np.array([r.prompt_len for r in trace])


def _decodes(trace):
    return np.array([r.decode_len for r in trace])


def test_request_total_len_and_validation():
    r = Request(request_id=3, arrival_step=2, prompt_len=100, decode_len=7)
    assert r.total_len == 107
    with pytest.raises(ValueError, match="decode_len"):
        Request(0, 0, 10, 0)
    with pytest.raises(ValueError, match="prompt_len"):
        Request(0, 0, -1, 5)
    with pytest.raises(ValueError, match="arrival_step"):
        Request(0, -1, 10, 5)
    with pytest.raises(ValueError, match="prompt_len"):
        Request(0, 0, 10.5, 5)


@pytest.mark.parametrize("family", TRACE_FAMILIES)
def test_same_seed_same_trace(family):
    kwargs = dict(arrivals="poisson", arrival_rate=0.5)
    a = synthetic_trace(family, 40, 20260622, **kwargs)
    b = synthetic_trace(family, 40, 20260622, **kwargs)
    assert a == b
    assert [r.request_id for r in a] == list(range(40))


@pytest.mark.parametrize("family", TRACE_FAMILIES)
def test_different_seed_changes_the_trace(family):
    a = synthetic_trace(family, 64, 20260622)
    b = synthetic_trace(family, 64, 20260623)
    assert _decodes(a).tolist() != _decodes(b).tolist()


def test_families_draw_from_independent_streams():
    # Same seed, different family: the decode-length streams must not coincide.
    decodes = {f: tuple(_decodes(synthetic_trace(f, 64, 7))) for f in TRACE_FAMILIES}
    assert len(set(decodes.values())) == len(TRACE_FAMILIES)


def test_arrival_process_does_not_change_lengths():
    burst = synthetic_trace("uniform", 50, 11)
    poisson = synthetic_trace("uniform", 50, 11, arrivals="poisson", arrival_rate=0.3)
    assert _prompts(burst).tolist() == _prompts(poisson).tolist()
    assert _decodes(burst).tolist() == _decodes(poisson).tolist()
    assert all(r.arrival_step == 0 for r in burst)


def test_bucketed_cycles_the_four_budgets():
    trace = synthetic_trace("bucketed", 10, 1)
    assert _prompts(trace).tolist() == [8 * K, 16 * K, 32 * K, 64 * K] * 2 + [8 * K, 16 * K]


def test_homogeneous_is_32k():
    assert set(_prompts(synthetic_trace("homogeneous", 17, 1)).tolist()) == {32 * K}


def test_bimodal_keeps_one_long_per_three_short_in_every_block():
    prompts = _prompts(synthetic_trace("bimodal", 400, 5))
    blocks = prompts.reshape(-1, 4)
    is_long = blocks == 64 * K
    assert (is_long.sum(axis=1) == 1).all()
    short = blocks[~is_long]
    assert short.min() >= 4 * K and short.max() <= 12 * K
    # The long request's slot is shuffled per block, not fixed.
    slots = np.argmax(is_long, axis=1)
    assert len(set(slots.tolist())) == 4


def test_bimodal_partial_block_has_at_most_one_long():
    for seed in range(20):
        prompts = _prompts(synthetic_trace("bimodal", 6, seed))
        assert (prompts[:4] == 64 * K).sum() == 1
        assert (prompts[4:] == 64 * K).sum() <= 1


def test_skewed_holds_one_long_prompt_early_in_every_block_of_64():
    prompts = _prompts(synthetic_trace("skewed", 64 * 40, 5))
    blocks = prompts.reshape(-1, 64)
    is_long = blocks == 128 * K
    assert (is_long.sum(axis=1) == 1).all()
    slots = np.argmax(is_long, axis=1)
    assert slots.max() < 16 and len(set(slots.tolist())) > 8  # seeded among the first 16
    short = blocks[~is_long]
    assert short.min() >= 64 and short.max() <= 1 * K
    # The CPU profile replays the first 16 requests: the long one is among them.
    for seed in range(20):
        assert (_prompts(synthetic_trace("skewed", 16, seed)) == 128 * K).sum() == 1


def test_uniform_covers_its_range():
    prompts = _prompts(synthetic_trace("uniform", 2000, 3))
    assert prompts.min() >= 4 * K and prompts.max() <= 64 * K
    # Uniform: each quarter of the range holds about a quarter of the requests.
    counts, _ = np.histogram(prompts, bins=4, range=(4 * K, 64 * K))
    assert (np.abs(counts / 2000 - 0.25) < 0.05).all()


def test_zipf_is_heavy_tailed_on_1k_to_64k():
    prompts = _prompts(synthetic_trace("zipf", 20000, 3))
    assert prompts.min() >= 1 * K and prompts.max() <= 64 * K
    lo, hi, a1 = 1 * K, 64 * K, 1.0 - ZIPF_EXPONENT
    # Median of the bounded power law, from its inverse CDF.
    median = (lo**a1 + 0.5 * (hi**a1 - lo**a1)) ** (1.0 / a1)
    assert abs(np.median(prompts) / median - 1) < 0.05
    assert prompts.mean() > 2 * np.median(prompts)  # the long tail pulls the mean up
    assert 0.05 < (prompts > 32 * K).mean() < 0.2


def test_length_scale_and_min_one_token():
    scaled = _prompts(synthetic_trace("bucketed", 4, 1, length_scale=1 / 64))
    assert scaled.tolist() == [128, 256, 512, 1024]
    tiny = _prompts(synthetic_trace("uniform", 50, 1, length_scale=1e-9))
    assert (tiny == 1).all()


def test_decode_range_is_inclusive():
    decodes = _decodes(synthetic_trace("homogeneous", 300, 9, decode_len_range=(3, 5)))
    assert set(decodes.tolist()) == {3, 4, 5}
    default = _decodes(synthetic_trace("homogeneous", 300, 9))
    assert default.min() >= 32 and default.max() <= 128


def test_poisson_arrivals():
    rate = 0.25
    trace = synthetic_trace("zipf", 4000, 13, arrivals="poisson", arrival_rate=rate)
    steps = np.array([r.arrival_step for r in trace])
    assert steps[0] == 0
    assert (np.diff(steps) >= 0).all()
    # Floored times of a rate-0.25 process: the last arrival is near n / rate.
    assert abs(steps[-1] / (4000 / rate) - 1) < 0.05


@pytest.mark.parametrize(
    "kwargs, name",
    [
        (dict(family="gaussian"), "family"),
        (dict(num_requests=0), "num_requests"),
        (dict(seed=-1), "seed"),
        (dict(length_scale=0.0), "length_scale"),
        (dict(decode_len_range=(0, 4)), "decode_len_range"),
        (dict(decode_len_range=(9, 4)), "decode_len_range"),
        (dict(arrivals="uniform"), "arrivals"),
        (dict(arrivals="poisson", arrival_rate=0), "arrival_rate"),
    ],
)
def test_bad_arguments_name_the_argument(kwargs, name):
    args = dict(family="uniform", num_requests=4, seed=1)
    args.update(kwargs)
    family, n, seed = args.pop("family"), args.pop("num_requests"), args.pop("seed")
    with pytest.raises(ValueError, match=name):
        synthetic_trace(family, n, seed, **args)


def test_request_fields_are_plain_ints():
    r = Request(np.int64(1), np.int32(0), np.int64(5), np.int64(2))
    assert all(type(getattr(r, f)) is int for f in ("request_id", "arrival_step", "prompt_len", "decode_len"))
    assert r == Request(1, 0, 5, 2)
