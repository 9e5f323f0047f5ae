"""The typed config: every YAML composes, and bad input fails early naming file, field and value."""

import dataclasses
import shutil

import pytest

from pkv.config import CONF_DIR, ConfigError, compose, load_trace_option
from pkv.engines import role_policy
from pkv.experiments.common import build_engines, model_shape, run_calibration
from pkv.policy import CalibrationError, KernelVariants, RoutePolicy, StepRoute
from pkv.policy.overrides import apply_engine_options
from pkv.policy.regime import FEW_ROWS, REGIMES


def test_every_experiment_composes():
    for path in sorted((CONF_DIR / "experiment").glob("*.yaml")):
        extra = ["experiment.context_len=8192"] if path.stem == "isolated" else []
        seed = ["seed=20260622"] if path.stem == "calibrate" else []
        cfg = compose([f"experiment={path.stem}", "out=x", "profile=cpu", *extra, *seed])
        assert cfg.experiment.name == path.stem


def test_every_trace_option_is_valid():
    for path in sorted((CONF_DIR / "trace").glob("*.yaml")):
        if path.stem == "external":
            continue
        trace = load_trace_option(path.stem)
        assert trace.family == path.stem


def test_typo_key_in_a_yaml_names_the_file_and_key(tmp_path):
    conf = tmp_path / "conf"
    shutil.copytree(CONF_DIR, conf)
    path = conf / "trace" / "bimodal.yaml"
    path.write_text(path.read_text().replace("num_requests:", "num_requestz:"))
    with pytest.raises(ConfigError, match=r"(?s)trace/bimodal.*num_requestz"):
        compose(["out=x"], conf_dir=conf)


def test_typo_key_on_the_command_line_is_rejected():
    with pytest.raises(ConfigError, match="num_requestz"):
        compose(["out=x", "trace.num_requestz=3"])


def test_wrong_type_names_field_and_value():
    with pytest.raises(ConfigError, match=r"trace.max_active.*abc|abc.*max_active"):
        compose(["out=x", "trace.max_active=abc"])


@pytest.mark.parametrize("override, field", [
    ("trace.num_requests=0", "trace.num_requests"),
    ("trace.page_size=12", "trace.page_size"),
    ("trace.hole_fraction=1.0", "trace.hole_fraction"),
    ("trace.decode_len_range=[9,3]", "trace.decode_len_range"),
    ("engine.route=diagonal", "engine.route"),
    ("engine.merge=diagonal", "engine.merge"),
    ("profile=tpu", "profile"),
    ("experiment.baseline=vllm", "experiment.baseline"),
])
def test_bad_value_names_file_field_and_value(override, field):
    with pytest.raises(ConfigError) as err:
        compose(["out=x", override])
    msg = str(err.value)
    assert f"'{field}'" in msg
    assert override.split("=", 1)[1].strip("[]").split(",")[0] in msg
    assert "conf/" in msg


def test_bad_trace_value_names_the_trace_file():
    with pytest.raises(ConfigError, match=r"conf/trace/zipf\.yaml.*trace\.num_requests.*-1"):
        compose(["out=x", "trace=zipf", "trace.num_requests=-1"])


def test_missing_out_is_reported():
    with pytest.raises(ConfigError, match="'out'"):
        compose([])


def test_external_trace_needs_an_existing_file(tmp_path):
    with pytest.raises(ConfigError, match="trace.path"):
        compose(["out=x", "trace=external"])
    with pytest.raises(ConfigError, match="no such file"):
        compose(["out=x", "trace=external", f"trace.path={tmp_path / 'missing.csv'}"])


def test_gpu_constants_are_checked_by_the_calibration():
    with pytest.raises((ConfigError, CalibrationError), match=r"conf/gpu/cpu\.yaml.*num_sms.*0"):
        compose(["out=x", "gpu.num_sms=0"])
    bad_regime = r"conf/gpu/cpu\.yaml: regimes\.few_rows\b.*route.*diagonal"
    with pytest.raises((ConfigError, CalibrationError), match=bad_regime):
        compose(["out=x", "gpu.regimes.few_rows.route=diagonal"])
    with pytest.raises((ConfigError, CalibrationError), match=r"conf/gpu/cpu\.yaml: regimes\.many_rows\b.*margin=0"):
        compose(["out=x", "gpu.regimes.many_rows.margin=0"])
    with pytest.raises((ConfigError, CalibrationError), match=r"regimes.many_rows.skew_target_ctas.*4294967296"):
        compose(["out=x", "gpu.regimes.many_rows.skew_target_ctas=4294967296"])
    with pytest.raises((ConfigError, CalibrationError), match=r"skew_target_ctas=-1"):
        compose(["out=x", "gpu.regimes.few_rows.skew_target_ctas=-1"])


def test_every_gpu_option_is_in_the_regimes_form():
    for path in sorted((CONF_DIR / "gpu").glob("*.yaml")):
        cfg = compose(["out=x", f"gpu={path.stem}"])
        assert set(cfg.gpu["regimes"]) == set(REGIMES), path.name
        assert not {"b8_margin", "boundary_route", "bucket_num_splits"} & set(cfg.gpu), path.name


def test_variants_set_the_key_the_experiment_names():
    cfg = compose(["out=x", "experiment=ablate_splits", 'variant="splits=24"'])
    assert cfg.engine.num_splits == 24 and cfg.variant == "splits=24"
    cfg = compose(["out=x", "experiment=ablate_gqa", 'variant="G=8"'])
    assert (cfg.model.num_qo_heads, cfg.model.num_kv_heads) == (32, 4)
    cfg = compose(["out=x", "experiment=ablate_raggedness", 'variant="route=bucket_masked"'])
    assert cfg.engine.route == "bucket_masked"


def test_unknown_variant_is_rejected():
    with pytest.raises(ConfigError, match=r"'variant' = 'G=8'.*\['splits'\]"):
        compose(["out=x", "experiment=ablate_splits", 'variant="G=8"'])
    with pytest.raises(ConfigError, match="G must divide"):
        compose(["out=x", "experiment=ablate_gqa", 'variant="G=3"'])


def test_experiments_may_set_trace_and_engine_keys():
    cfg = compose(["out=x", "experiment=ablate_b4"])
    assert cfg.engine.open_few_rows and cfg.trace.max_active == 4
    cfg = compose(["out=x", "experiment=isolated", "experiment.context_len=8192"])
    assert cfg.trace.hole_fraction == 0.5


@pytest.mark.parametrize("override, value", [
    ("experiment.gate_probes.0.length_scale=0", "'length_scale': 0"),
    ("experiment.gate_probes.8.group_size=0", "'group_size': 0"),
    ("experiment.gate_probes.1.max_active=0", "'max_active': 0"),
])
def test_bad_gate_probe_names_the_entry_and_its_values(override, value):
    with pytest.raises(ConfigError) as err:
        compose(["out=x", "experiment=calibrate", override])
    msg = str(err.value)
    assert "experiment.gate_probes[" in msg and value in msg and "conf/" in msg


@pytest.mark.parametrize("overrides, field, value", [
    (["experiment.calibration_traces.3.fits=gates"], "experiment.calibration_traces[3].fits", "gates"),
    (["experiment.calibration_traces.3.max_active=1"], "experiment.calibration_traces[3].fits",
     "uniform_target_ctas"),
    (["experiment.calibration_traces.3.route=bucket_exact"], "experiment.calibration_traces[3].fits",
     "uniform_target_ctas"),
    (["experiment.calibration_traces.2.trace=homogeneous", "experiment.calibration_traces.2.max_active=8"],
     "experiment.calibration_traces[3]", "second time"),
    (["experiment.calibration_traces.2.fits=uniform_target_ctas"], "experiment.calibration_traces",
     "one max_active"),
    (["experiment.calibration_traces.4.wave_candidates=[]"], "experiment.calibration_traces[4]",
     "needs wave_candidates"),
    (["experiment.calibration_traces.4.split_candidates=[20]"], "experiment.calibration_traces[4]",
     "no split_candidates"),
    (["experiment.calibration_traces.4.route=bucket_exact"], "experiment.calibration_traces[4].fits",
     "skew_target_ctas"),
    (["experiment.calibration_traces.1.wave_candidates=[2]"], "experiment.calibration_traces[1]",
     "wave_candidates only"),
    (["experiment.calibration_traces.4.wave_candidates=[65]"], "experiment.calibration_traces[4]", "in [1, 64]"),
    # The B4 trace fits both its split count and its regime's skew budget, but each only once.
    (["experiment.calibration_traces.5.trace=skewed", "experiment.calibration_traces.5.max_active=64"],
     "experiment.calibration_traces[5]", "for a skew budget a second time"),
    # Each regime's skew traces share a wave candidate; other regimes' do not count.
    (["experiment.calibration_traces.5.max_active=8", "experiment.calibration_traces.5.wave_candidates=[5]"],
     "experiment.calibration_traces", "regime many_rows need a shared wave candidate"),
    # The short-row rule: one row on the bucket route, 1 (the rule off) among its tiles a split.
    (["experiment.calibration_traces.6.tile_candidates=[2,3]"], "experiment.calibration_traces[6]",
     "1 (the rule off)"),
    (["experiment.calibration_traces.6.max_active=2"], "experiment.calibration_traces[6]", "max_active 1"),
    (["experiment.calibration_traces.6.split_candidates=[8]"], "experiment.calibration_traces[6]",
     "no split or wave candidates"),
    (["experiment.calibration_traces.6.tile_candidates=[1,2048]"], "experiment.calibration_traces[6]",
     "in [1, 1024]"),
    (["experiment.calibration_traces.0.tile_candidates=[2]"], "experiment.calibration_traces[0].tile_candidates",
     "only a trace that fits bucket_tiles_per_split"),
    (["experiment.calibration_traces.6.length_scale=0"], "experiment.calibration_traces[6]", "length_scale"),
])
def test_a_bad_calibration_trace_names_the_entry_and_its_value(overrides, field, value):
    """The uniform cap's and the skew budget's traces: a known fit, the workqueue at two rows or more,
    one max_active and a shared candidate among the uniform ones, wave candidates (in bounds) only
    and all of them for the skew budget, and no trace swept or fitted twice (its record would be
    overwritten)."""
    with pytest.raises(ConfigError) as err:
        compose(["out=x", "experiment=calibrate", *overrides])
    msg = str(err.value)
    assert f"field '{field}'" in msg and value in msg and "conf/" in msg, msg


def test_every_engine_option_is_the_default_with_its_own_lines():
    default = dataclasses.asdict(compose(["out=x", "engine=default"]).engine)
    changed = {}
    for path in sorted((CONF_DIR / "engine").glob("*.yaml")):
        engine = dataclasses.asdict(compose(["out=x", f"engine={path.stem}"]).engine)
        changed[path.stem] = {k: v for k, v in engine.items() if v != default[k]}
    assert changed["default"] == {}
    assert changed["open_few_rows"] == {"open_few_rows": True}
    assert changed["fused_merge"] == {"merge": "fused"}
    assert changed["cluster_merge"] == {"merge": "cluster", "route": "bucket_exact", "bucket_num_splits": 16}
    assert changed["cuda_graph"] == {"cuda_graph": True}
    assert changed["bucket_masked"] == {"route": "bucket_masked"}
    assert "allow_b4" not in changed and "allow_b4" not in default and "fused_merge" not in default


# --------------------------------------------------------------------------------------
# A run's engine options: applied to its calibration once, or refused when they cannot hold


def _cpu_calibration(*overrides):
    return run_calibration(compose(["out=x", "profile=cpu", *overrides]))


def test_apply_engine_options_sets_split_counts_rule_and_the_few_rows_regime():
    calib = _cpu_calibration()
    assert apply_engine_options(calib) == calib
    # num_splits fixes every regime's count; bucket_num_splits then the single-row one.
    fixed = apply_engine_options(calib, num_splits=12)
    assert {fixed.regime(r).num_splits for r in REGIMES} == {12}
    both = apply_engine_options(calib, num_splits=12, bucket_num_splits=6)
    assert (both.single_row.num_splits, both.few_rows.num_splits, both.many_rows.num_splits) == (6, 12, 12)
    bucket = apply_engine_options(calib, bucket_num_splits=6)
    assert bucket.single_row.num_splits == 6
    assert (bucket.few_rows, bucket.many_rows) == (calib.few_rows, calib.many_rows)
    assert apply_engine_options(calib, split_kind="balanced").workqueue_split_kind == "balanced"
    # Nothing else of a regime changes: routes, gates, margins.
    for regime in REGIMES:
        assert dataclasses.replace(both.regime(regime), num_splits=1) == \
            dataclasses.replace(calib.regime(regime), num_splits=1)


def test_open_few_rows_opens_the_few_rows_regime_only_where_it_was_closed():
    calib = _cpu_calibration()
    assert calib.few_rows.route == "flashinfer"
    opened = apply_engine_options(calib, open_few_rows=True)
    assert opened.few_rows == dataclasses.replace(calib.few_rows, route="persistentkv_workqueue")
    assert (opened.single_row, opened.many_rows) == (calib.single_row, calib.many_rows)
    # A regime the calibration already routed keeps its route.
    routed = calib.with_regime(FEW_ROWS, route="persistentkv_bucket")
    assert apply_engine_options(routed, open_few_rows=True) == routed
    assert apply_engine_options(calib, open_few_rows=False) == calib


def test_run_calibration_applies_the_engine_options_of_the_run():
    calib = _cpu_calibration()
    assert _cpu_calibration("engine=open_few_rows").few_rows.route == "persistentkv_workqueue"
    splits = _cpu_calibration("engine.num_splits=12", "engine.bucket_num_splits=6", "engine.split_kind=balanced")
    assert (splits.single_row.num_splits, splits.few_rows.num_splits, splits.many_rows.num_splits) == (6, 12, 12)
    assert splits.workqueue_split_kind == "balanced"
    assert _cpu_calibration("engine.bucket_tiles_per_split=4").single_row == dataclasses.replace(
        calib.single_row, bucket_tiles_per_split=4)
    assert splits.with_all_regimes(num_splits=1) == dataclasses.replace(
        calib.with_all_regimes(num_splits=1), workqueue_split_kind="balanced")
    # The ablation's engine options reach the policy its engines decide with.
    cfg = compose(["out=x", "profile=cpu", "experiment=ablate_b4"])
    shape = model_shape(cfg)
    policy = role_policy("adaptive", {"route": "workqueue"}, shape, run_calibration(cfg))
    assert policy.candidate(4) == StepRoute("persistentkv_workqueue", policy.calib.few_rows.num_splits)
    assert policy.candidate(1).name == "persistentkv_bucket" and policy.candidate(8).name == "persistentkv_workqueue"


@pytest.mark.parametrize("overrides, labels, pattern", [
    (["engine.merge=cluster"], ["persistentkv"], r"engine 'persistentkv'.*cluster merge is a bucket-route merge"),
    (["engine.merge=cluster", "engine.bucket_num_splits=16"], ["adaptive"],
     r"engine 'adaptive'.*cluster merge is a bucket-route merge.*persistentkv_workqueue"),
    (["engine=cluster_merge", "engine.bucket_num_splits=32"], ["persistentkv"],
     r"engine 'persistentkv'.*cluster merge takes at most 16 splits.*num_splits=32"),
])
def test_engine_options_that_cannot_hold_fail_naming_the_engine_and_why(overrides, labels, pattern):
    cfg = compose(["out=x", "profile=cpu", *overrides])
    with pytest.raises(ConfigError, match=pattern):
        build_engines(labels, cfg, model_shape(cfg), "cpu", run_calibration(cfg))


def test_the_cluster_merge_holds_on_buckets_of_at_most_16_splits():
    cfg = compose(["out=x", "profile=cpu", "engine=cluster_merge", "engine.bucket_num_splits=16"])
    engines, skipped = build_engines(["persistentkv", "flashinfer"], cfg, model_shape(cfg), "cpu", run_calibration(cfg))
    assert skipped == {} and engines["persistentkv"].implementation == "reference:bucket_exact+cluster_merge"
    # The route itself refuses what cannot hold, whoever builds it.
    with pytest.raises(ValueError, match="cluster merge is a bucket-route merge"):
        StepRoute("persistentkv_workqueue", 8, merge="cluster")
    with pytest.raises(ValueError, match="at most 16 splits"):
        StepRoute("persistentkv_bucket", 17, merge="cluster")
    shape = model_shape(cfg)
    with pytest.raises(ValueError, match="cluster merge is a bucket-route merge"):
        RoutePolicy(run_calibration(cfg), num_kv_heads=shape.num_kv_heads, group_size=shape.group_size,
                    head_dim=shape.head_dim, variants=KernelVariants(merge="cluster"))


# ---------------------------------------------------------------------------------------------
# A conf/gpu file names its own GPU, and the device a GPU-profile run times on


def test_a_gpu_file_copied_without_its_gpu_field_changed_is_refused(tmp_path):
    """README 'A new GPU' copies conf/gpu/h200.yaml: a copy whose `gpu` still says h200 would label
    the new GPU's calibration and results as the H200's."""
    conf = tmp_path / "conf"
    shutil.copytree(CONF_DIR, conf)
    (conf / "gpu" / "newcard.yaml").write_text((CONF_DIR / "gpu" / "h200.yaml").read_text())
    with pytest.raises(ConfigError, match=r"^conf/gpu/newcard\.yaml: field 'gpu' = 'h200': must be 'newcard', "
                                          r"this file's name .*set `gpu: newcard` in conf/gpu/newcard\.yaml$"):
        compose(["out=x", "gpu=newcard", "profile=cpu"], conf_dir=conf)
    # Set as the README says, it composes.
    path = conf / "gpu" / "newcard.yaml"
    path.write_text(path.read_text().replace("gpu: h200", "gpu: newcard"))
    assert compose(["out=x", "gpu=newcard", "profile=cpu"], conf_dir=conf).gpu["gpu"] == "newcard"
    # An override of the field is refused the same way.
    with pytest.raises(ConfigError, match=r"conf/gpu/h200\.yaml: field 'gpu' = 'h100': must be 'h200'"):
        compose(["out=x", "gpu=h200", "gpu.gpu=h100"])


def test_every_gpu_file_names_itself_and_the_h100_file_is_the_h200_copy_the_readme_makes():
    import yaml

    for path in sorted((CONF_DIR / "gpu").glob("*.yaml")):
        assert compose(["out=x", f"gpu={path.stem}", "profile=cpu"]).gpu["gpu"] == path.stem
    h100, h200 = (yaml.safe_load((CONF_DIR / "gpu" / f"{name}.yaml").read_text()) for name in ("h100", "h200"))
    # Its own name and the device's SM count (an H100 SXM has the H200's 132); every other value is
    # the H200's starting value, which the calibrate rule refits on the H100.
    assert h100["gpu"] == "h100" and h100["num_sms"] == 132
    assert {k: v for k, v in h100.items() if k != "gpu"} == {k: v for k, v in h200.items() if k != "gpu"}


@pytest.mark.parametrize("option, device, refused", [
    ("h100", "NVIDIA H100 80GB HBM3", None),
    ("h100", "NVIDIA H200", r"'NVIDIA H200', which conf/gpu/h200\.yaml is for: pass gpu=h200"),
    ("h200", "NVIDIA H100 80GB HBM3", r"conf/gpu/h100\.yaml is for"),
    ("h200", "NVIDIA H200 NVL", None),
    ("h100", "NVIDIA A100-SXM4-80GB", r"names another card than the device torch sees, 'NVIDIA A100-SXM4-80GB'"),
    ("rtx3060", "NVIDIA GeForce RTX 3060 Laptop GPU", None),
    ("h100_lab", "NVIDIA H100 80GB HBM3", None),  # a file of its own for one H100 machine
    ("mycard", "NVIDIA A100-SXM4-80GB", None),  # names no card: cannot be judged
])
def test_a_gpu_option_is_judged_against_the_device_where_it_names_a_card(option, device, refused):
    from pkv.config.checks import gpu_device_problem

    problem = gpu_device_problem(option, device, ["cpu", "h100", "h200", "rtx3060"])
    if refused is None:
        assert problem is None
    else:
        assert problem is not None and __import__("re").search(refused, problem), problem


def test_a_gpu_profile_run_on_another_cards_device_is_refused(monkeypatch):
    from pkv.config import checks

    monkeypatch.setattr(checks, "_visible_device_name", lambda: "NVIDIA H200")
    with pytest.raises(ConfigError, match=r"^command line: field 'gpu' = 'h100': the device is 'NVIDIA H200', "
                                          r"which conf/gpu/h200\.yaml is for"):
        compose(["out=x", "gpu=h100", "profile=gpu"])
    assert compose(["out=x", "gpu=h200", "profile=gpu"]).gpu["gpu"] == "h200"
    # The CPU profile times no GPU, and neither does the cpu option: neither is judged.
    assert compose(["out=x", "gpu=h100", "profile=cpu"]).gpu["gpu"] == "h100"
    assert compose(["out=x", "gpu=cpu", "profile=cpu"]).gpu["gpu"] == "cpu"
    # Without a CUDA device there is nothing to judge.
    monkeypatch.setattr(checks, "_visible_device_name", lambda: None)
    assert compose(["out=x", "gpu=h100", "profile=gpu"]).gpu["gpu"] == "h100"
