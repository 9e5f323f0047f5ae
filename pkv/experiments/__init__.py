"""Experiment drivers: each turns one validated PkvConfig into result files (docs/architecture.md).

`experiment.driver` names the module: evaluate (evaluate, mlp), isolated, calibrate, ablate
(ablate_*), profile. Each exposes run(cfg) and writes its outputs atomically.
"""
