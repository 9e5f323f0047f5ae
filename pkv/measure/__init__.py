"""Measurements: device and wall timing, the trace harness, the kernel and host benchmarks, the isolated
benchmark, the calibration probes, and the inputs they time (peaked K, V and queries).
"""
