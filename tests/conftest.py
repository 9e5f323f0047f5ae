import os

import numpy as np
import pytest

from pkv.pipeline.pages import assign_pages
from pkv.pipeline.step import build_step


def _cuda_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


def pytest_collection_modifyitems(config, items):
    if _cuda_available():
        return
    skip = pytest.mark.skip(reason="no CUDA GPU on this machine")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def pytest_runtest_logreport(report):
    """PKV_TEST_TIMES=<file>: each test phase's seconds appended as it ends (node id, phase,
    seconds, outcome), so a GPU run stopped at its time limit still says where its time went."""
    path = os.environ.get("PKV_TEST_TIMES")
    if path and (report.when == "call" or report.duration >= 0.5):
        with open(path, "a") as times:
            times.write(f"{report.nodeid}\t{report.when}\t{report.duration:.2f}\t{report.outcome}\n")


def _build_step(seq_lens, page_size=16, *, hole_fraction=None, seed=0, reverse_pages=False):
    """A StepBatch (step 0, request ids 0..B-1) for ``seq_lens``.

    By default row ``i`` owns the next ``ceil(seq_lens[i] / page_size)`` physical pages, in
    ascending order, after row ``i - 1``'s. ``hole_fraction`` scatters the pages instead, as
    ``pkv.pipeline.pages.assign_pages(seq_lens, page_size, hole_fraction, seed)`` does (its
    universe of ``universe_size(step.num_pages_used, hole_fraction)`` pages). ``reverse_pages``
    lists each row's contiguous pages in descending order, so a block table is not its own index.
    """
    lens = np.asarray(seq_lens, dtype=np.int64)
    if hole_fraction is not None:
        if reverse_pages:
            raise ValueError("reverse_pages applies to the contiguous layout, not to hole_fraction")
        page_lists = assign_pages(lens, page_size, hole_fraction, seed).pages
    else:
        pages = -(-lens // page_size)
        starts = np.concatenate(([0], np.cumsum(pages)[:-1]))
        page_lists = [np.arange(s, s + n, dtype=np.int32) for s, n in zip(starts, pages)]
        if reverse_pages:
            page_lists = [p[::-1].copy() for p in page_lists]
    return build_step(0, np.arange(lens.size), lens, page_lists, page_size)


@pytest.fixture
def make_step():
    """The step builder: ``make_step(seq_lens, page_size=16, *, hole_fraction=None, seed=0,
    reverse_pages=False)`` (see _build_step)."""
    return _build_step
