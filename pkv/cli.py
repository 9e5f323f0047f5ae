"""The package's Hydra entry point: compose a config, validate it, run one experiment driver.

    python -m pkv.cli experiment=evaluate trace=bimodal gpu=h200 seed=20260623 \
        out=artifacts/h200/evaluate/bimodal_b8/seed20260623 hydra.run.dir=<under the rule's output>

The workflow always passes an explicit hydra.run.dir under the rule's output folder, so a run's
saved config (.hydra/) sits beside what it produced.
"""

from __future__ import annotations

import importlib
import sys

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from pkv.config import ConfigError, apply_variant, validate

# conf/ lives at the repository root, next to the package (editable installs and checkouts).
_CONF_PATH = "../conf"


def run_experiment(cfg, overrides=()) -> list:
    """Dispatch a validated PkvConfig to its driver module and return the paths it wrote."""
    module = importlib.import_module(f"pkv.experiments.{cfg.experiment.driver}")
    if cfg.experiment.driver == "profile":
        return module.run(cfg, overrides=list(overrides))
    return module.run(cfg)


@hydra.main(config_path=_CONF_PATH, config_name="config", version_base="1.3")
def _main(raw: DictConfig) -> None:
    hc = HydraConfig.get()
    try:
        cfg = validate(apply_variant(raw), hc.runtime.choices)
    except ConfigError as exc:
        print(f"pkv: {exc}", file=sys.stderr)
        sys.exit(2)
    for path in run_experiment(cfg, hc.overrides.task):
        print(f"pkv: wrote {path}", file=sys.stderr)


def main() -> None:
    _main()


if __name__ == "__main__":
    main()
