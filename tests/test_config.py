"""The typed config: every YAML composes, and bad input fails early naming file, field and value."""

import shutil

import pytest

from pkv.config import CONF_DIR, ConfigError, compose, load_trace_option


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


def test_gpu_constants_are_checked_by_the_cost_model():
    with pytest.raises(Exception, match=r"conf/gpu/cpu\.yaml.*num_sms"):
        compose(["out=x", "gpu.num_sms=0"])


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
    assert cfg.engine.allow_b4 and cfg.trace.max_active == 4
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
