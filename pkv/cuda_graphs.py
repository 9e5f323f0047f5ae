"""Capturing a step into a CUDA graph."""

from __future__ import annotations

import torch


def capture_graph(fn) -> torch.cuda.CUDAGraph:
    """A CUDA graph of ``fn()``, after one run of it outside capture on a side stream: first
    launches do what a graph cannot hold (kernel loading and JIT, shared-memory opt-ins), and the
    side stream keeps that run off the caller's stream, as torch's capture docs ask."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph
