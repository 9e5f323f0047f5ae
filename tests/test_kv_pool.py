"""The recycled KV pool: pages taken at admission and on growth, returned and reused, requests that
wait for pages, the default pool size, the config fields that set it, and a harness replay of a
long-context JSON-lines trace whose up-front layout would not fit a device."""

import dataclasses
from pathlib import Path

import numpy as np
import pytest

from pkv.config import ConfigError, compose
from pkv.engines.reference import ReferenceEngine
from pkv.engines.sdpa import SdpaEngine
from pkv.measure.harness import TraceRunSpec, run_trace
from pkv.pipeline.kv_pool import KVPool, KVPoolSpec, pool_pages_for
from pkv.pipeline.make_fixture import LONG_CONTEXT_OUTPUT, long_context_records
from pkv.pipeline.pages import PageAssignment
from pkv.pipeline.serving import ContinuousDecoder, decode_plan_summary, page_layout
from pkv.pipeline.trace_readers import read_trace
from pkv.pipeline.traces import Request, synthetic_trace
from pkv.policy import ROUTE_WORKQUEUE, PinnedRoutePolicy, StepRoute
from pkv.shape import ModelShape

REPO = Path(__file__).resolve().parents[1]
SHAPE = ModelShape(num_qo_heads=8, num_kv_heads=2, head_dim=32)


def _pages_of(step, row):
    n = -(-int(step.seq_lens[row]) // step.page_size)
    return step.block_table[row, :n].tolist()


def _replay(requests, pool_pages, page_size=4, max_active=3, seed=5, max_steps=None):
    spec = KVPoolSpec(pool_pages, page_size, seed)
    return spec, list(ContinuousDecoder(requests, spec, max_active, max_steps).steps())


def test_free_list_is_first_in_first_out_from_a_seeded_permutation():
    pool = KVPool(KVPoolSpec(10, 16, 3))
    first = pool.take(4)
    assert first == np.random.default_rng(3).permutation(10)[:4].tolist()
    assert pool.num_free == 6
    pool.give_back(first[::-1])
    rest = pool.take(6)
    assert rest == np.random.default_rng(3).permutation(10)[4:].tolist()
    assert pool.take(4) == first[::-1]  # freed pages come back after the never-used ones
    with pytest.raises(RuntimeError, match="has 0 free"):
        pool.take(1)


def test_an_in_order_pool_hands_out_ascending_ids_and_each_prompt_gets_neighbours():
    pool = KVPool(KVPoolSpec(10, 16, 3, "in_order"))
    assert pool.take(4) == [0, 1, 2, 3]
    requests = [Request(i, 0, 40 + 7 * i, 3) for i in range(4)]
    spec, steps = _replay(requests, pool_pages=200, page_size=4, max_active=4)
    ordered = KVPoolSpec(200, 4, 5, "in_order")
    first = next(ContinuousDecoder(requests, ordered, 4).steps())
    for row in range(first.batch_size):  # admitted together: each prompt's pages are one run of IDs
        pages = _pages_of(first, row)
        assert pages == list(range(pages[0], pages[0] + len(pages)))
    shuffled = next(ContinuousDecoder(requests, spec, 4).steps())
    assert (shuffled.seq_lens == first.seq_lens).all() and (shuffled.block_table != first.block_table).any()
    up_front = page_layout(requests, layout="up_front", page_size=4, hole_fraction=0.5, seed=2, max_active=4,
                           page_order="in_order")
    assert np.concatenate(up_front.pages).tolist() == list(range(up_front.num_assigned_pages))
    with pytest.raises(ValueError, match=r"KVPoolSpec.page_order must be one of \('shuffled', 'in_order'\)"):
        KVPoolSpec(10, 16, 3, "sorted")
    with pytest.raises(ValueError, match="page order must be one of"):
        page_layout(requests, layout="up_front", page_size=4, hole_fraction=0.0, seed=2, max_active=4,
                    page_order="sorted")


def test_pages_are_taken_on_growth_kept_in_order_and_never_shared():
    requests = synthetic_trace("zipf", 24, 9, length_scale=1 / 512, arrivals="poisson", arrival_rate=0.7)
    spec, steps = _replay(requests, pool_pages=200)
    held: dict[int, list[int]] = {}
    for step in steps:
        used = [page for row in range(step.batch_size) for page in _pages_of(step, row)]
        assert len(set(used)) == len(used), "two rows share a page"
        assert all(0 <= page < spec.num_physical_pages for page in used)
        for row, rid in enumerate(step.request_ids.tolist()):
            pages = _pages_of(step, row)
            before = held.get(rid, [])
            # A request's earlier pages never move; it takes at most one page a decode step.
            assert pages[:len(before)] == before and len(pages) - len(before) <= (1 if before else len(pages))
            held[rid] = pages
        # FlashInfer's form lists the same pages.
        assert step.kv_indices.tolist() == used


def test_finished_requests_pages_are_handed_out_again():
    requests = [Request(0, 0, 15, 2), Request(1, 0, 15, 2), Request(2, 1, 30, 3)]
    _, steps = _replay(requests, pool_pages=10, max_active=2)
    first_owner = {}
    reused = 0
    for step in steps:
        for row, rid in enumerate(step.request_ids.tolist()):
            for page in _pages_of(step, row):
                reused += first_owner.setdefault(page, rid) != rid
    assert reused > 0
    assert {rid for s in steps for rid in s.request_ids.tolist()} == {0, 1, 2}


def test_a_request_waits_for_pages_first_come_first_served():
    # The first three reserve 4 pages of 4 tokens each; a 9-page pool holds two at once, so the
    # third waits with a row free, and the fourth, whose one page would fit, waits behind it.
    requests = [Request(0, 0, 15, 1), Request(1, 0, 12, 3), Request(2, 0, 15, 1), Request(3, 0, 3, 1)]
    spec, steps = _replay(requests, pool_pages=9, max_active=4)
    got = [(s.step, s.request_ids.tolist()) for s in steps]
    assert got == [(0, [0, 1]), (1, [1, 2, 3]), (2, [1])]
    summary = decode_plan_summary(requests, 4, pool=spec)
    assert summary["steps"] == len(steps) and summary["decode_tokens"] == sum(s.batch_size for s in steps)
    assert summary["peak_reserved_pages"] <= spec.num_physical_pages


@pytest.mark.parametrize("pool_pages", [40, 64, 500])
def test_summary_matches_the_replay_on_a_bounded_pool(pool_pages):
    requests = synthetic_trace("bimodal", 20, 4, length_scale=1 / 512, arrivals="poisson", arrival_rate=0.6)
    spec, steps = _replay(requests, pool_pages=pool_pages, page_size=8, max_active=4)
    summary = decode_plan_summary(requests, 4, pool=spec)
    assert summary["steps"] == len(steps)
    assert summary["decode_tokens"] == sum(s.batch_size for s in steps)
    assert summary["end_step"] == steps[-1].step + 1
    assert summary["requests_finished"] == len(requests)


def test_a_request_longer_than_the_pool_is_refused():
    with pytest.raises(ValueError, match="request 1 needs 5 pages .* more than the KV pool's 4 pages"):
        ContinuousDecoder([Request(0, 0, 3, 1), Request(1, 0, 17, 2)], KVPoolSpec(4, 4, 0), 2)


def test_page_layout_sizes_the_pool_to_the_peak_and_keeps_the_up_front_form():
    requests = synthetic_trace("uniform", 16, 2, length_scale=1 / 256)
    peak = decode_plan_summary(requests, 4, 10, page_size=16)["peak_reserved_pages"]
    pool = page_layout(requests, layout="recycled", page_size=16, hole_fraction=0.5, seed=2, max_active=4,
                       max_steps=10)
    assert pool == KVPoolSpec(2 * peak, 16, 2) and pool_pages_for(peak, 0.5) == 2 * peak
    assert pool_pages_for(peak, 0.5, max_pages=peak) == peak
    assert pool_pages_for(peak, 0.5, longest_pages=3 * peak, max_pages=peak) == 3 * peak
    # A trace whose longest request comes after the steps the peak is taken over still gets a pool it fits.
    late = [Request(0, 0, 30, 2), Request(1, 50, 3000, 2)]
    assert page_layout(late, layout="recycled", page_size=16, hole_fraction=0.0, seed=2, max_active=1,
                       max_steps=2).num_physical_pages == -(-3002 // 16)
    fixed = page_layout(requests, layout="recycled", page_size=16, hole_fraction=0.5, seed=2, max_active=4,
                        pool_pages=1234)
    assert fixed.num_physical_pages == 1234
    up_front = page_layout(requests, layout="up_front", page_size=16, hole_fraction=0.5, seed=2, max_active=4)
    assert isinstance(up_front, PageAssignment) and up_front.num_requests == len(requests)
    with pytest.raises(ValueError, match="page layout must be one of"):
        page_layout(requests, layout="paged", page_size=16, hole_fraction=0.0, seed=2, max_active=4)


def test_the_long_context_fixture_is_the_generators_output_and_needs_a_recycled_pool():
    path = REPO / "traces" / "long_context_conv.jsonl"
    assert path.read_text().splitlines() == [
        f'{{"timestamp":{r["timestamp"]},"input_length":{r["input_length"]},"output_length":{r["output_length"]}}}'
        for r in long_context_records()]
    assert LONG_CONTEXT_OUTPUT == path
    requests = read_trace(path)
    contexts = np.array([r.prompt_len for r in requests])
    p50, p90, p99 = np.percentile(contexts, [50, 90, 99])
    assert 6_000 < p50 < 8_000 and 22_000 < p90 < 32_000 and 70_000 < p99 < 100_000
    # Up front, 384 of its requests would hold more than 2^32 K elements at 8 KV heads x 128 dims;
    # recycled, the pool is the batch's peak.
    first = requests[:384]
    up_front = sum(-(-r.total_len // 16) for r in first) * 16 * 8 * 128
    peak = decode_plan_summary(first, 8, page_size=16)["peak_reserved_pages"] * 16 * 8 * 128
    assert up_front > 2**32 and peak < 2**31


def test_harness_replays_many_requests_over_a_small_recycled_pool():
    """Every request of a long trace passes through a pool that holds a few of them at once, each
    step checked against the float64 reference, pages reused under the engines' feet."""
    # Its first 32 requests, all waiting at once, with short decodes: a busy server's queue.
    requests = tuple(read_trace(REPO / "traces" / "long_context_conv.jsonl", length_scale=1 / 256)[:32])
    requests = tuple(dataclasses.replace(r, arrival_step=0, decode_len=min(r.decode_len, 6)) for r in requests)
    summary = decode_plan_summary(requests, 4, page_size=4)
    longest = max(-(-r.total_len // 4) for r in requests)
    pool_pages = max(longest, summary["peak_reserved_pages"] // 2)
    bounded = decode_plan_summary(requests, 4, pool=KVPoolSpec(pool_pages, 4, 1))
    assert bounded["steps"] > summary["steps"] and bounded["requests_finished"] == len(requests)
    spec = TraceRunSpec(name="long_b4", family="external", seed=1, requests=requests, page_size=4,
                        max_active=4, warmup_steps=0, measured_steps=bounded["steps"], dtype="float32",
                        device="cpu", check_every=7, flush_l2=False, kv_pool_pages=pool_pages)
    engines = {"sdpa": SdpaEngine(SHAPE, "cpu"),
               "workqueue": ReferenceEngine(SHAPE, policy=PinnedRoutePolicy(StepRoute(ROUTE_WORKQUEUE, 3)))}
    results = run_trace(spec, SHAPE, engines, "sdpa", progress=False)
    assert results["workqueue"]["steps"] == bounded["steps"]
    assert results["workqueue"]["decode_tokens"] == bounded["decode_tokens"]
    assert 0 < results["workqueue"]["ref_max_rel_err"] < 1e-4


def test_config_names_the_pool_fields():
    with pytest.raises(ConfigError, match=r"trace.page_layout' = 'paged'.*must be one of \['recycled', 'up_front'\]"):
        compose(["trace.page_layout=paged", "out=x"])
    with pytest.raises(ConfigError, match=r"trace.page_order' = 'sorted'.*must be one of \['shuffled', 'in_order'\]"):
        compose(["trace.page_order=sorted", "out=x"])
    with pytest.raises(ConfigError, match=r"trace.kv_pool_tokens' = 100: must be a multiple of trace.page_size=16"):
        compose(["trace.kv_pool_tokens=100", "out=x"])
    with pytest.raises(ConfigError, match=r"trace.kv_pool_tokens' = 1024: sizes the recycled pool"):
        compose(["trace.page_layout=up_front", "trace.kv_pool_tokens=1024", "out=x"])


def test_a_named_pool_smaller_than_a_request_is_refused_naming_the_field():
    from pkv.experiments.common import kv_pool_pages, load_requests, resolve_settings
    cfg = compose(["profile=cpu", "trace=bimodal", "trace.kv_pool_tokens=1024", "out=x"])
    settings = resolve_settings(cfg)
    with pytest.raises(ConfigError, match=r"conf/trace/bimodal.yaml: field 'trace.kv_pool_tokens' = 1024: request \d+ "
                                          r"needs \d+ tokens, more than the whole pool holds"):
        load_requests(cfg.trace, cfg.seed, settings)
    ok = compose(["profile=cpu", "trace=bimodal", "trace.kv_pool_tokens=65536", "out=x"])
    requests = load_requests(ok.trace, ok.seed, resolve_settings(ok))
    assert kv_pool_pages(ok.trace, resolve_settings(ok), requests) == 65536 // 16


def test_the_default_pool_is_the_runs_peak_capped_by_the_device(monkeypatch):
    from pkv.experiments import common
    cfg = compose(["profile=cpu", "trace=bimodal", "trace.hole_fraction=0.5", "out=x"])
    settings = common.resolve_settings(cfg)
    requests = common.load_requests(cfg.trace, cfg.seed, settings)
    steps = settings.warmup_steps + settings.measured_steps
    peak = decode_plan_summary(requests, cfg.trace.max_active, steps, page_size=16)["peak_reserved_pages"]
    assert common.kv_pool_pages(cfg.trace, settings, requests) == 2 * peak
    page_bytes = 16 * settings.kv_bytes_per_token
    longest = max(-(-r.total_len // 16) for r in requests)
    monkeypatch.setattr(common, "MAX_KV_POOL_BYTES", (longest + 3) * page_bytes)
    assert common.kv_pool_pages(cfg.trace, settings, requests) == longest + 3
    up_front = compose(["profile=cpu", "trace=bimodal", "trace.page_layout=up_front", "out=x"])
    assert common.kv_pool_pages(up_front.trace, settings, requests) is None
