from collections import defaultdict

import numpy as np
import pytest

from pkv.pipeline.pages import assign_pages
from pkv.pipeline.serving import ContinuousDecoder, decode_plan_summary
from pkv.pipeline.step import StepBatch, build_step
from pkv.pipeline.traces import Request, synthetic_trace


def _check_flashinfer_matches_block_table(step: StepBatch):
    P = step.page_size
    B = step.batch_size
    assert step.request_ids.dtype == np.int64 and step.request_ids.shape == (B,)
    for name in ("seq_lens", "block_table", "kv_indptr", "kv_indices", "kv_last_page_len"):
        assert getattr(step, name).dtype == np.int32, name
    assert step.kv_indptr.shape == (B + 1,) and step.kv_indptr[0] == 0
    assert step.kv_indices.shape == (int(step.kv_indptr[-1]),)
    num_pages = -(-step.seq_lens.astype(np.int64) // P)
    assert step.block_table.shape == (B, int(num_pages.max()))
    for i in range(B):
        n = int(num_pages[i])
        lo, hi = step.kv_indptr[i], step.kv_indptr[i + 1]
        assert hi - lo == n
        assert step.kv_indices[lo:hi].tolist() == step.block_table[i, :n].tolist()
        assert (step.block_table[i, n:] == 0).all()
        assert 1 <= step.kv_last_page_len[i] <= P
        assert (n - 1) * P + int(step.kv_last_page_len[i]) == int(step.seq_lens[i])
    assert step.num_pages_used == int(num_pages.sum())
    assert step.max_seq_len == int(step.seq_lens.max())


# ---------------------------------------------------------------- build_step


def test_build_step_by_hand():
    pages = [np.array([7], np.int32), np.array([3, 9], np.int32), np.array([5, 1, 8], np.int32), np.array([2, 4, 6], np.int32)]
    step = build_step(12, [10, 11, 12, 13], [1, 4, 5, 9], pages, page_size=4)
    assert step.step == 12 and step.batch_size == 4 and step.page_size == 4
    assert step.block_table.tolist() == [[7, 0, 0], [3, 0, 0], [5, 1, 0], [2, 4, 6]]
    assert step.kv_indptr.tolist() == [0, 1, 2, 4, 7]
    assert step.kv_indices.tolist() == [7, 3, 5, 1, 2, 4, 6]
    assert step.kv_last_page_len.tolist() == [1, 4, 1, 1]
    assert step.request_ids.tolist() == [10, 11, 12, 13]
    assert step.num_pages_used == 7 and step.max_seq_len == 9
    _check_flashinfer_matches_block_table(step)


def test_build_step_random_rows_match_both_forms():
    rng = np.random.default_rng(0)
    for P in (1, 16, 64):
        lens = rng.integers(1, 3000, size=9)
        a = assign_pages(lens, P, 0.5, seed=int(P))
        seq_lens = np.maximum(1, lens - rng.integers(0, 40, size=9))
        step = build_step(0, np.arange(9), seq_lens, a.pages, P)
        _check_flashinfer_matches_block_table(step)
        for i in range(9):
            n = -(-int(seq_lens[i]) // P)
            assert step.block_table[i, :n].tolist() == a.pages[i][:n].tolist()


def test_build_step_does_not_alias_its_inputs():
    ids = np.array([1, 2])
    lens = np.array([3, 4])
    step = build_step(0, ids, lens, [np.array([5]), np.array([6])], 4)
    ids[0] = 99
    lens[0] = 99
    assert step.request_ids.tolist() == [1, 2] and step.seq_lens.tolist() == [3, 4]


def test_build_step_refuses_bad_rows():
    pages = [np.array([1, 2], np.int32)]
    with pytest.raises(ValueError, match=r"seq_lens\[0\] \(request 5\).*got 0"):
        build_step(0, [5], [0], pages, 4)
    with pytest.raises(ValueError, match="request 5.*needs 3 pages.*owns 2"):
        build_step(0, [5], [9], pages, 4)
    with pytest.raises(ValueError, match="page_size"):
        build_step(0, [5], [4], pages, 0)
    with pytest.raises(ValueError, match="one entry per row"):
        build_step(0, [5, 6], [4], pages, 4)
    with pytest.raises(ValueError, match="at least one"):
        build_step(0, [], [], [], 4)


# ---------------------------------------------------------------- ContinuousDecoder


def _decoder(requests, max_active, max_steps=None, page_size=4, hole_fraction=0.5):
    a = assign_pages([r.total_len for r in requests], page_size, hole_fraction, seed=1)
    return ContinuousDecoder(requests, a, max_active, max_steps), a


def test_admission_growth_departure_and_idle_jump():
    # Listed out of order: admission must follow (arrival_step, request_id), pages the list position.
    requests = [
        Request(request_id=2, arrival_step=0, prompt_len=5, decode_len=2),
        Request(request_id=3, arrival_step=10, prompt_len=7, decode_len=1),
        Request(request_id=0, arrival_step=0, prompt_len=10, decode_len=3),
        Request(request_id=1, arrival_step=0, prompt_len=20, decode_len=1),
    ]
    decoder, assignment = _decoder(requests, max_active=2)
    steps = list(decoder.steps())
    got = [(s.step, s.request_ids.tolist(), s.seq_lens.tolist()) for s in steps]
    assert got == [
        (0, [0, 1], [11, 21]),  # ids 0 and 1 first; id 2 waits for a slot
        (1, [0, 2], [12, 6]),  # id 1 left after one step, id 2 takes its slot
        (2, [0, 2], [13, 7]),
        (10, [3], [8]),  # steps 3..9 are idle: skipped, not yielded
    ]
    position = {r.request_id: i for i, r in enumerate(requests)}
    for s in steps:
        _check_flashinfer_matches_block_table(s)
        for row, rid in enumerate(s.request_ids.tolist()):
            n = -(-int(s.seq_lens[row]) // 4)
            assert s.block_table[row, :n].tolist() == assignment.pages[position[rid]][:n].tolist()


def test_admission_waits_for_arrival_even_with_free_slots():
    requests = [Request(0, 0, 3, 4), Request(1, 2, 3, 1)]
    decoder, _ = _decoder(requests, max_active=4)
    got = [(s.step, s.request_ids.tolist()) for s in decoder.steps()]
    assert got == [(0, [0]), (1, [0]), (2, [0, 1]), (3, [0])]


def test_max_steps_stops_early_and_steps_replay_identically():
    requests = synthetic_trace("bimodal", 12, 3, length_scale=1 / 256, arrivals="poisson", arrival_rate=0.5)
    decoder, _ = _decoder(requests, max_active=3, max_steps=7, page_size=16)
    first = list(decoder.steps())
    again = list(decoder)
    assert len(first) == 7
    for x, y in zip(first, again):
        assert x.step == y.step
        assert (x.block_table == y.block_table).all() and (x.seq_lens == y.seq_lens).all()


@pytest.mark.parametrize("max_active", [1, 3, 8])
@pytest.mark.parametrize("family", ["bimodal", "zipf"])
def test_every_request_decodes_its_tokens_in_order(family, max_active):
    requests = synthetic_trace(family, 20, 5, length_scale=1 / 512, decode_len_range=(1, 12), arrivals="poisson", arrival_rate=0.7)
    decoder, _ = _decoder(requests, max_active, page_size=16)
    seen = defaultdict(list)
    by_id = {r.request_id: r for r in requests}
    last_step = -1
    for s in decoder.steps():
        assert s.step > last_step
        last_step = s.step
        assert 1 <= s.batch_size <= max_active
        for rid, seq_len in zip(s.request_ids.tolist(), s.seq_lens.tolist()):
            assert s.step >= by_id[rid].arrival_step
            seen[rid].append((s.step, seq_len))
    for rid, r in by_id.items():
        stamps = seen[rid]
        assert [seq for _, seq in stamps] == [r.prompt_len + k + 1 for k in range(r.decode_len)]
        # Once admitted a request runs every step until it leaves.
        assert [t for t, _ in stamps] == list(range(stamps[0][0], stamps[0][0] + r.decode_len))


def test_summary_matches_the_replayed_steps():
    for seed in range(6):
        requests = synthetic_trace("uniform", 25, seed, length_scale=1 / 1024, decode_len_range=(1, 20), arrivals="poisson", arrival_rate=0.3)
        for max_active in (1, 2, 5):
            for max_steps in (None, 13):
                decoder, _ = _decoder(requests, max_active, max_steps, page_size=16)
                steps = list(decoder.steps())
                summary = decode_plan_summary(requests, max_active, max_steps)
                tokens = sum(s.batch_size for s in steps)
                assert summary["steps"] == len(steps)
                assert summary["decode_tokens"] == tokens
                assert summary["mean_active"] == pytest.approx(tokens / len(steps))
                assert summary["peak_active"] == max(s.batch_size for s in steps)
                assert summary["end_step"] == steps[-1].step + 1
                assert decoder.summary() == summary
                if max_steps is None:
                    assert summary["requests_finished"] == len(requests)
                    assert tokens == sum(r.decode_len for r in requests)


def test_decoder_refuses_mismatched_input():
    requests = [Request(0, 0, 10, 5), Request(1, 0, 30, 5)]
    small = assign_pages([15, 20], 4, 0.0, seed=1)
    with pytest.raises(ValueError, match="request 1 needs 9 pages.*gives it 5"):
        ContinuousDecoder(requests, small, 2)
    with pytest.raises(ValueError, match="covers 1 requests but the trace has 2"):
        ContinuousDecoder(requests, assign_pages([15], 4, 0.0, seed=1), 2)
    good = assign_pages([15, 35], 4, 0.0, seed=1)
    with pytest.raises(ValueError, match="max_active"):
        ContinuousDecoder(requests, good, 0)
    with pytest.raises(ValueError, match="max_steps"):
        ContinuousDecoder(requests, good, 2, max_steps=0)
    with pytest.raises(ValueError, match="request_id 0 appears more than once"):
        ContinuousDecoder([Request(0, 0, 10, 5), Request(0, 0, 30, 5)], good, 2)
    with pytest.raises(ValueError, match="empty"):
        decode_plan_summary([], 2)
