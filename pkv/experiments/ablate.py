"""Ablations (Tables 7, 8 and paper 4.4-4.6): trace runs with one setting changed by the variant.

The variant ("splits=24", "G=8", "route=bucket_masked") names a key of experiment.variant_keys;
pkv.config.apply_variant has already written its value into the config before validation, so an
ablation run is an evaluate run whose result files also record the variant.
"""

from __future__ import annotations

from pathlib import Path

from pkv.config import ConfigError, PkvConfig
from pkv.experiments.evaluate import run_trace_experiment


def ablation_name(experiment_name: str) -> str:
    """The results folder of an ablation: artifacts/<gpu>/ablate/<ablation_name>/..."""
    return experiment_name.removeprefix("ablate_")


def run(cfg: PkvConfig) -> list[Path]:
    if cfg.experiment.variant_keys and cfg.variant is None:
        raise ConfigError(
            f"conf/experiment/{cfg.experiment.name}.yaml: field 'variant' = None: this ablation needs "
            f"variant=<name>=<value> with <name> one of {sorted(cfg.experiment.variant_keys)}")
    return run_trace_experiment(cfg)
