"""The float64 dense reference against an independent contiguous computation, and SDPA."""

import math

import numpy as np
import pytest
import torch

from pkv.measure.accuracy import compare
from pkv.engines.dense import dense_decode
from pkv.engines.sdpa import SdpaEngine
from pkv.measure.kv_data import make_kv_pages, make_queries, stored_nhd
from pkv.shape import ModelShape

pages_mod = pytest.importorskip("pkv.pipeline.pages")
step_mod = pytest.importorskip("pkv.pipeline.step")

P = 16


def paged_inputs(lens, shape, dtype, seed=0, hole_fraction=0.5):
    assignment = pages_mod.assign_pages(lens, P, hole_fraction, seed)
    step = step_mod.build_step(0, np.arange(len(lens)), lens, assignment.pages, P)
    k, v = make_kv_pages(assignment.num_physical_pages, shape, P, dtype, "cpu", seed)
    q = make_queries(len(lens), shape, dtype, "cpu", seed + 1)
    return step, q, k, v


def contiguous_attention(q, keys, values, group):
    """Textbook attention per query head over contiguous [n, d] K and V."""
    out = torch.empty_like(q, dtype=torch.float64)
    for h in range(q.shape[0]):
        kvh = h // group
        scores = keys[kvh].double() @ q[h].double() / math.sqrt(q.shape[-1])
        weights = torch.softmax(scores, dim=0)
        out[h] = weights @ values[kvh].double()
    return out


@pytest.mark.parametrize("group_size", [1, 4])
def test_dense_matches_attention_over_tokens_read_page_by_page(group_size):
    shape = ModelShape(num_qo_heads=2 * group_size, num_kv_heads=2, head_dim=16)
    lens = [1, 15, 16, 17, 100]
    step, q, k, v = paged_inputs(lens, shape, torch.float32)
    out = dense_decode(q, k, v, step.seq_lens, step.block_table)
    assert out.dtype == torch.float64
    for row, n in enumerate(lens):
        tokens = np.arange(n)
        pages = step.block_table[row, tokens // P]
        keys = k[pages, :, tokens % P].transpose(0, 1)  # [Hkv, n, d]
        values = v[pages, :, tokens % P].transpose(0, 1)
        expected = contiguous_attention(q[row], keys, values, group_size)
        torch.testing.assert_close(out[row], expected, rtol=1e-12, atol=1e-12)


def test_dense_reports_bad_inputs_by_name():
    shape = ModelShape(num_qo_heads=4, num_kv_heads=2, head_dim=16)
    step, q, k, v = paged_inputs([20, 30], shape, torch.float32)
    with pytest.raises(ValueError, match="seq_lens"):
        dense_decode(q, k, v, step.seq_lens[:1], step.block_table)
    lens = step.seq_lens.copy()
    lens[1] = 0
    with pytest.raises(ValueError, match=r"seq_lens\[1\]"):
        dense_decode(q, k, v, lens, step.block_table)
    lens[1] = 10_000
    with pytest.raises(ValueError, match="row 1"):
        dense_decode(q, k, v, lens, step.block_table)


@pytest.mark.parametrize("dtype,bound", [(torch.float64, 1e-12), (torch.float32, 1e-5)])
def test_sdpa_engine_equals_dense(dtype, bound):
    shape = ModelShape(num_qo_heads=8, num_kv_heads=2, head_dim=32)
    lens = [1, 16, 17, 33, 257, 1000]
    step, q, k, v = paged_inputs(lens, shape, dtype, seed=4)
    engine = SdpaEngine(shape, "cpu")
    plan = engine.plan(step)
    assert plan.route == "flashinfer" and plan.schedule is None
    out = engine.run(q, k, v, plan)
    assert out.dtype == dtype and out.shape == q.shape
    assert compare(out, dense_decode(q, k, v, step.seq_lens, step.block_table))["rel_err"] < bound


def test_sdpa_engine_rejects_mismatched_shapes():
    shape = ModelShape(num_qo_heads=8, num_kv_heads=2, head_dim=32)
    step, q, k, v = paged_inputs([40], shape, torch.float32)
    engine = SdpaEngine(shape, "cpu")
    with pytest.raises(ValueError, match="q must be"):
        engine.run(q[:, :4], k, v, engine.plan(step))
    with pytest.raises(ValueError, match="k_pages"):
        engine.run(q, k[:, :1], v, engine.plan(step))


def test_pages_stored_nhd_hold_the_same_values_with_the_token_stride_of_nhd():
    shape = ModelShape(num_qo_heads=8, num_kv_heads=2, head_dim=16)
    k, _ = make_kv_pages(5, shape, 4, torch.float32, "cpu", seed=3)
    nhd = stored_nhd(k)
    assert nhd.shape == k.shape and torch.equal(nhd, k)
    assert nhd.stride() == (4 * 2 * 16, 16, 2 * 16, 1)  # [num_pages, Hkv, P, d] over [num_pages, P, Hkv, d]
    step_lens = np.array([7, 20])
    table = np.array([[4, 1, 0, 0, 0], [0, 2, 3, 1, 4]])
    q = make_queries(2, shape, torch.float32, "cpu", seed=4)
    assert torch.equal(dense_decode(q.double(), nhd.double(), nhd.double(), step_lens, table),
                       dense_decode(q.double(), k.double(), k.double(), step_lens, table))


def test_pages_are_drawn_in_chunks_that_bound_the_temporaries_and_one_chunk_draws_the_whole_pool(monkeypatch):
    """A pool within one chunk draws the bits of one draw of all its pages (keys, values, needles,
    strengths, in that order); a pool of several chunks is as reproducible and as peaked."""
    import pkv.measure.kv_data as kv_data

    shape = ModelShape(num_qo_heads=8, num_kv_heads=2, head_dim=16)
    k, v = make_kv_pages(6, shape, 4, torch.float64, "cpu", seed=7)
    gen = torch.Generator().manual_seed(7)
    dims = (6, 2, 4, 16)
    keys, values = torch.randn(dims, generator=gen), torch.randn(dims, generator=gen) * kv_data.VALUE_STD
    needle = torch.rand(dims[:3], generator=gen) < 1.0 / kv_data.NEEDLE_EVERY
    strength = torch.empty(dims[:3]).exponential_(generator=gen) * kv_data.NEEDLE_SCALE
    u = kv_data.attention_directions(shape)
    keys = keys + torch.where(needle, strength, torch.zeros_like(strength))[..., None] * u[None, :, None, :]
    assert torch.equal(k, keys.double()) and torch.equal(v, values.double())

    monkeypatch.setattr(kv_data, "GENERATION_CHUNK_ELEMENTS", 2 * 4 * 16 * 2)  # two pages a chunk
    big = make_kv_pages(301, shape, 4, torch.float32, "cpu", seed=7)
    again = make_kv_pages(301, shape, 4, torch.float32, "cpu", seed=7)
    assert all(torch.equal(a, b) for a, b in zip(big, again))
    assert big[0].shape == (301, 2, 4, 16) and torch.isfinite(big[0]).all() and torch.isfinite(big[1]).all()
    # Every chunk draws its own keys: no two chunks repeat.
    assert not torch.equal(big[0][:2], big[0][2:4])
    # Needles along u in every part of the pool: scores along u reach well above the noise.
    along = torch.einsum("phtd,hd->pht", big[0], u)
    assert float(along.max()) > 5.0 and abs(float(big[1].std()) - kv_data.VALUE_STD) < 0.02
