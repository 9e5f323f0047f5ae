import numpy as np
import pytest

from pkv.pipeline.pages import assign_pages, universe_size


def _lens(n, seed=0):
    return np.random.default_rng(seed).integers(1, 5000, size=n)


def test_rounding_to_pages_and_buckets():
    a = assign_pages([1, 16, 17, 48], page_size=16, hole_fraction=0.0, seed=1)
    assert a.reserved_pages.tolist() == [1, 1, 2, 3]
    assert [len(p) for p in a.pages] == [1, 1, 2, 3]
    b = assign_pages([1, 64, 65], page_size=16, hole_fraction=0.0, seed=1, bucket_size=64)
    assert b.reserved_pages.tolist() == [4, 4, 8]


@pytest.mark.parametrize("rho", [0.0, 0.2, 0.5, 0.73])
def test_universe_size_and_hole_fraction(rho):
    lens = _lens(50)
    a = assign_pages(lens, page_size=16, hole_fraction=rho, seed=3)
    total = int(a.reserved_pages.sum())
    assert a.num_physical_pages == universe_size(total, rho)
    assert a.num_physical_pages >= total / (1 - rho) - 1e-9
    assert a.num_physical_pages < total / (1 - rho) + 1
    assert rho <= a.realized_hole_fraction < rho + 1 / a.num_physical_pages + 1e-12
    assert a.hole_fraction == rho


def test_universe_size_is_exact_for_decimal_fractions():
    # 80 / (1 - 0.2) is 100 exactly; float division would round up to 101.
    assert universe_size(80, 0.2) == 100
    assert universe_size(100, 0.5) == 200
    assert universe_size(7, 0.5) == 14
    assert universe_size(10, 0.3) == 15  # ceil(14.28...)


def test_pages_are_disjoint_and_inside_the_universe():
    a = assign_pages(_lens(80), page_size=16, hole_fraction=0.5, seed=4)
    flat = np.concatenate(a.pages)
    assert flat.dtype == np.int32 and all(p.dtype == np.int32 for p in a.pages)
    assert len(np.unique(flat)) == flat.size
    assert flat.min() >= 0 and flat.max() < a.num_physical_pages


def test_slices_are_consecutive_in_one_seeded_permutation():
    lens = _lens(30)
    a = assign_pages(lens, page_size=16, hole_fraction=0.5, seed=20260622)
    perm = np.random.default_rng(20260622).permutation(a.num_physical_pages)
    offset = 0
    for pages, n in zip(a.pages, a.reserved_pages.tolist()):
        assert pages.tolist() == perm[offset : offset + n].tolist()
        offset += n
    # The holes are the tail of the permutation: IDs no request owns.
    holes = set(perm[offset:].tolist())
    assert holes.isdisjoint(np.concatenate(a.pages).tolist())
    assert len(holes) == a.num_physical_pages - offset


def test_no_holes_is_a_permutation_of_all_pages():
    a = assign_pages(_lens(20), page_size=8, hole_fraction=0.0, seed=5)
    flat = np.concatenate(a.pages)
    assert a.num_physical_pages == flat.size
    assert sorted(flat.tolist()) == list(range(flat.size))
    # Scattered, not the identity layout.
    assert flat.tolist() != list(range(flat.size))


def test_deterministic_and_seed_sensitive():
    lens = _lens(40)
    a = assign_pages(lens, 16, 0.5, seed=9)
    b = assign_pages(lens, 16, 0.5, seed=9)
    c = assign_pages(lens, 16, 0.5, seed=10)
    assert all((x == y).all() for x, y in zip(a.pages, b.pages))
    assert any((x != y).any() for x, y in zip(a.pages, c.pages))


def test_assignment_is_read_only():
    a = assign_pages([100, 200], 16, 0.5, seed=1)
    with pytest.raises(ValueError):
        a.pages[0][0] = 7
    with pytest.raises(ValueError):
        a.reserved_pages[0] = 7


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(page_size=0), "page_size"),
        (dict(page_size=16.0), "page_size"),
        (dict(hole_fraction=1.0), "hole_fraction"),
        (dict(hole_fraction=-0.1), "hole_fraction"),
        (dict(bucket_size=40), "bucket_size=40 must be a multiple of page_size=16"),
        (dict(bucket_size=0), "bucket_size"),
        (dict(reserved_lens=[10, 0, 3]), r"reserved_lens\[1\] must be >= 1 token, got 0"),
        (dict(reserved_lens=[]), "non-empty"),
        (dict(reserved_lens=[1.5, 2.0]), "integers"),
        (dict(seed=-3), "seed"),
    ],
)
def test_bad_input_is_refused_with_the_value(kwargs, match):
    args = dict(reserved_lens=[10, 20], page_size=16, hole_fraction=0.0, seed=1)
    args.update(kwargs)
    with pytest.raises(ValueError, match=match):
        assign_pages(**args)
