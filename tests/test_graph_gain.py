"""pkv.report.graph_gain: Table 2's attention lead carried into Table 9's graphed step, per seed."""

from __future__ import annotations

import json

import pytest

from pkv.config import ConfigError
from pkv.report import graph_gain as gg


def _write(path, engine, **metrics):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"schema": "pkv.result/1", "experiment": "x", "engine": engine, "run_id": "r",
                                "trace": {"name": path.parent.parent.name}, "performance_result": True,
                                "metrics": metrics, "provenance": {}}))


def _run(root, seed=20260623, pkv_tok_s=110.0, fi_tok_s=100.0, graph_tok_s=102.0, share=0.5, wrong=0,
         host_ms=0.1):
    ev = root / "evaluate" / "bimodal_b8" / f"seed{seed}"
    _write(ev / "adaptive.json", "adaptive", cuda_tok_s=pkv_tok_s, wrong_steps=0)
    # A baseline found wrong on measured steps (an engine under study that is wrong stops its run).
    _write(ev / "flashinfer.json", "flashinfer", cuda_tok_s=fi_tok_s, wrong_steps=wrong,
           **({"first_wrong_step": "step 3"} if wrong else {}))
    ms = root / "model_step" / "bimodal_b8" / f"seed{seed}"
    _write(ms / "adaptive_graph.json", "adaptive_graph", cuda_tok_s=graph_tok_s, wrong_steps=0)
    _write(ms / "flashinfer_graph.json", "flashinfer_graph", cuda_tok_s=100.0, wrong_steps=0, attention_share=share,
           cuda_ms_per_step=10.0, floor_step_ms_per_step=8.0, host_ms_per_step=host_ms,
           attention_cuda_ms_per_step=5.0, floor_attention_ms_per_step=3.0)


def test_the_prediction_is_the_step_with_only_attention_faster():
    # Attention half the step and 10% faster in throughput: the step is 1 - 0.5 (1 - 1/1.1) of itself.
    assert gg.predicted_ratio(1.1, 0.5) == pytest.approx(1 / (1 - 0.5 / 11))
    assert gg.predicted_ratio(1.0, 0.7) == 1.0


def test_a_run_gives_each_seed_its_prediction_beside_the_measured_ratio(tmp_path):
    _run(tmp_path, 20260623)
    _run(tmp_path, 20260624, graph_tok_s=103.0)
    _run(tmp_path, 20260622)  # the calibration seed is not evidence
    _run(tmp_path, 20260625, wrong=2)
    report = gg.graph_gain(tmp_path)
    seeds = report["bimodal_b8"]["seeds"]
    assert sorted(seeds) == [20260623, 20260624, 20260625]
    assert seeds[20260625] == "an output was wrong on measured steps"
    row = seeds[20260623]
    assert row["table2_ratio"] == pytest.approx(1.1) and row["measured"] == pytest.approx(1.02)
    assert row["predicted"] == pytest.approx(gg.predicted_ratio(1.1, 0.5)) and row["ceiling"] == pytest.approx(1.25)
    assert report["bimodal_b8"]["mean"]["measured"] == pytest.approx(1.025)
    text = gg.render_markdown(report)
    # Records without per-step times or the adaptive graph's attention time leave those columns empty.
    assert ("| Bimodal B8 | 2 | 1.100 ± 0.000 | – | 0.500 ± 0.000 | 1.048 ± 0.000 | – | 1.025 ± 0.007 "
            "| 1.250 ± 0.000 |") in text
    assert "- Bimodal B8, seed 20260625: left out, an output was wrong on measured steps" in text


def test_the_same_steps_and_attention_inside_the_graph_say_where_the_lead_went(tmp_path):
    _run(tmp_path)
    ev = tmp_path / "evaluate" / "bimodal_b8" / "seed20260623"
    ms = tmp_path / "model_step" / "bimodal_b8" / "seed20260623"
    # Table 2 measured steps 1-3; the model step measured steps 2, 3 and 9 (no eager record of 9).
    _write(ev / "adaptive.json", "adaptive", cuda_tok_s=110.0, wrong_steps=0,
           per_step=[{"step": 1, "cuda_us": 50.0}, {"step": 2, "cuda_us": 90.0}, {"step": 3, "cuda_us": 100.0}])
    _write(ev / "flashinfer.json", "flashinfer", cuda_tok_s=100.0, wrong_steps=0,
           per_step=[{"step": 1, "cuda_us": 80.0}, {"step": 2, "cuda_us": 100.0}, {"step": 3, "cuda_us": 110.0}])
    _write(ms / "adaptive_graph.json", "adaptive_graph", cuda_tok_s=102.0, wrong_steps=0,
           attention_cuda_ms_per_step=5.2, per_step=[{"step": s, "cuda_us": 1.0} for s in (2, 3, 9)])
    row = gg.graph_gain(tmp_path)["bimodal_b8"]["seeds"][20260623]
    assert row["table2_same_steps"] == pytest.approx(210 / 190)  # steps 2 and 3 only
    assert row["graph_attention_ratio"] == pytest.approx(5.0 / 5.2)  # FlashInfer's 5.0 ms over 5.2


def test_a_host_bound_step_has_no_share_to_carry_the_lead(tmp_path):
    _run(tmp_path, host_ms=20.0)  # the host takes longer than the device's 10 ms step
    row = gg.graph_gain(tmp_path)["bimodal_b8"]["seeds"][20260623]
    assert row == "FlashInfer's graphed step is bound by its host"


def test_a_folder_without_model_steps_is_refused_in_one_line(tmp_path, capsys):
    with pytest.raises(ConfigError, match="model_step"):
        gg.graph_gain(tmp_path)
    with pytest.raises(SystemExit) as exit_:
        gg.main([str(tmp_path)])
    assert exit_.value.code == 2 and "model_step" in capsys.readouterr().err


def test_the_json_holds_every_seed(tmp_path):
    _run(tmp_path)
    out = tmp_path / "gain.json"
    assert gg.main([str(tmp_path), "--json", str(out)]) == 0
    assert json.loads(out.read_text())["traces"]["bimodal_b8"]["seeds"]["20260623"]["measured"] == pytest.approx(1.02)


def test_kernel_traces_take_attention_apart_per_layer(tmp_path, capsys):
    _run(tmp_path)
    ms = tmp_path / "model_step" / "bimodal_b8"
    for seed, decode_us in ((20260623, 64.0), (20260624, 96.0)):
        profile = {"steps": 4, "attention_kernel_us_per_step": decode_us + 32.0, "attention_gap_us_per_step": 48.0,
                   "attention_span_us_per_step": 160.0, "other_kernels_extra_us_per_step": 16.0,
                   "other_kernels_extra": {"gemm after merge_kernel": 32.0, "norm": -16.0},
                   "kernels": {"gemm": {"us_per_step": 900.0, "count_per_step": 96, "attention": False},
                               "decode_kernel": {"us_per_step": decode_us, "count_per_step": 32, "attention": True},
                               "merge_kernel": {"us_per_step": 32.0, "count_per_step": 32, "attention": True}}}
        _write(ms / f"seed{seed}" / "adaptive_graph.json", "adaptive_graph", cuda_tok_s=102.0, wrong_steps=0,
               kernel_profile=profile, model={"layers_run": 32})
    # A record whose run could not trace has no row.
    _write(ms / "seed20260623" / "flashinfer_graph.json", "flashinfer_graph", cuda_tok_s=100.0, wrong_steps=0,
           kernel_profile={"skipped": "not available: no kernel trace on a cpu device"}, model={"layers_run": 32})
    (row,) = gg.kernel_rows(tmp_path)
    assert (row["trace"], row["path"], row["seeds"], row["steps"]) == ("bimodal_b8", "adaptive_graph", 2, 8)
    assert row["attention_kernel_us"] == pytest.approx((96 / 32 + 128 / 32) / 2)  # 3.5 us a layer
    assert row["attention_gap_us"] == pytest.approx(1.5) and row["attention_span_us"] == pytest.approx(5.0)
    assert row["kernels"] == [("decode_kernel", pytest.approx(2.5), pytest.approx(1.0)),
                              ("merge_kernel", pytest.approx(1.0), pytest.approx(1.0))]
    text = gg.render_kernels([row])
    assert row["other_kernels_extra_us"] == pytest.approx(0.5)
    assert row["other_kernels"] == [("gemm after merge_kernel", pytest.approx(1.0)), ("norm", pytest.approx(-0.5))]
    assert ("| Bimodal B8 | adaptive_graph | +0.50 | `gemm after merge_kernel` +1.00; `norm` -0.50 |"
            in gg.render_other_kernels([row]))
    assert ("| Bimodal B8 | adaptive_graph | 2 | 8 | 3.50 | 1.50 | 5.00 | 0.50 "
            "| `decode_kernel` 2.50 (1.00); `merge_kernel` 1.00") in text
    assert gg.main([str(tmp_path)]) == 0
    assert "Attention's kernels, per layer" in capsys.readouterr().out
