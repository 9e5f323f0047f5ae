"""The package's Hydra entry point: compose a config, validate it, run one experiment driver.

    python -m pkv.cli experiment=evaluate trace=bimodal gpu=h200 seed=20260623 \
        out=artifacts/h200/evaluate/bimodal_b8/seed20260623 hydra.run.dir=<under the rule's output>

The workflow always passes an explicit hydra.run.dir under the rule's output folder, so a run's
saved config (.hydra/) sits beside what it produced.

One error path: every refusal (a bad key, value or file, a trace or calibration that cannot be
read, a device that is not there, an output another run holds) is one line on stderr,
``pkv: <file>: field '<field>' = <value>: <why>``, and exit status 2, before or after validation.
Before Hydra starts, the overrides are composed and checked, and the output's lock is taken
(pkv.atomic_io.OutputLock): a second run into the same out= is refused at once, naming the
holder. The run's Hydra config (.hydra/) is written after its results, so a run that fails
leaves the previous run's results and config together.
"""

from __future__ import annotations

import importlib
import os
import sys
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf

from pkv.atomic_io import OutputLock, OutputLocked, write_files_atomic
from pkv.config import ConfigError, apply_variant, compose, validate
from pkv.refusal import REFUSALS, refuse
from pkv.worker import with_jit_cache

# conf/ lives at the repository root, next to the package (editable installs and checkouts).
_CONF_PATH = "../conf"
# Where Hydra would save the composed config; the CLI saves it there itself, after the results.
_HYDRA_SUBDIR = ".hydra"

# Set by main() when it took the lock and turned Hydra's own saving off.
_save_config = False


def run_experiment(cfg, overrides=()) -> list:
    """Dispatch a validated PkvConfig to its driver module and return the paths it wrote."""
    module = importlib.import_module(f"pkv.experiments.{cfg.experiment.driver}")
    if cfg.experiment.driver == "profile":
        return module.run(cfg, overrides=list(overrides))
    return module.run(cfg)


def save_hydra_config(raw: DictConfig) -> list:
    """.hydra/config.yaml, hydra.yaml and overrides.yaml in the run dir, as Hydra writes them, as one set."""
    hydra_cfg = HydraConfig.instance().cfg
    folder = Path(hydra_cfg.hydra.runtime.output_dir) / _HYDRA_SUBDIR
    return write_files_atomic({
        folder / "config.yaml": OmegaConf.to_yaml(raw),
        folder / "hydra.yaml": OmegaConf.to_yaml(hydra_cfg),
        folder / "overrides.yaml": OmegaConf.to_yaml(hydra_cfg.hydra.overrides.task),
    })


@hydra.main(config_path=_CONF_PATH, config_name="config", version_base="1.3")
def _main(raw: DictConfig) -> None:
    hc = HydraConfig.get()
    try:
        cfg = validate(apply_variant(raw), hc.runtime.choices)
        paths = run_experiment(cfg, hc.overrides.task)
        if _save_config:
            save_hydra_config(raw)
    except REFUSALS as exc:
        refuse(exc)
    for path in paths:
        print(f"pkv: wrote {path}", file=sys.stderr)
    if cfg.profile == "cpu":
        # So a console shows what these numbers are not (a refusal stays one line: this comes after).
        print(f"pkv: CPU profile ({cfg.experiment.name}): reference engines on scaled traces; "
              "not a performance result", file=sys.stderr)


def _lock(out: str) -> OutputLock:
    lock = OutputLock(out)
    try:
        lock.acquire()
    except OSError as exc:
        refuse(ConfigError(f"{out}: field 'out' = {out!r}: cannot take the output's lock {lock.path}: "
                           f"{exc.strerror or exc}"))
    except OutputLocked as exc:
        refuse(exc)
    if lock.stale:
        s = lock.stale
        print(f"pkv: {lock.path}: took over the lock of pid {s.get('pid')} on {s.get('host')} (started "
              f"{s.get('started')}), which ended without releasing it", file=sys.stderr)
    return lock


def main(argv: list[str] | None = None) -> None:
    global _save_config
    argv = list(sys.argv[1:] if argv is None else argv)
    # FlashInfer compiles its JIT modules under the project's build cache, as in the DAG's jobs (set
    # before any driver imports FlashInfer, which reads it once).
    with_jit_cache(os.environ)
    if any(arg.startswith("-") for arg in argv):
        # Hydra's own flags (--help, --cfg job, --info, --multirun): no run of ours to guard.
        _main()
        return
    try:
        cfg = compose(argv)
    except ConfigError as exc:
        refuse(exc)
    lock = _lock(cfg.out)
    try:
        # Hydra would write .hydra/ before the run starts; a failed run would then leave a config
        # beside results it did not make. save_hydra_config writes it after the results instead.
        _save_config = True
        sys.argv = [sys.argv[0], *argv, "hydra.output_subdir=null"]
        _main()
    finally:
        lock.release()


if __name__ == "__main__":
    main()
