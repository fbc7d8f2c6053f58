"""Tests for pretrain.metrics: FLOPs formula, throughput/MFU, GPU peaks, memory and the sinks."""
import io
import json

import pytest

from pretrain import metrics
from pretrain.metrics import (ConsoleSink, JsonlSink, MetricsLogger, WandbSink,
                              detect_gpu, make_logger, memory_report,
                              peak_tflops, throughput_metrics, wandb_mode)
from model_shape.flops import StepFlops, gpt_flops_per_step, gpt_step_flops, layer_forward_flops_per_token


@pytest.fixture
def offline_wandb(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    for var in ("WANDB_DIR", "WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR"):
        monkeypatch.setenv(var, str(tmp_path / "wandb_home"))
    monkeypatch.delenv("WANDB_API_KEY", raising=False)


# ---------------------------------------------------------------- FLOPs


def test_flops_tiny_shape_by_hand():
    # B=4, s=32, L=2, h=64, V=128.
    # layers, one forward: 24·4·32·2·64²·(1 + 32/384) = 25,165,824 · 13/12 = 27,262,976
    # logit, one forward:  2·4·32·64·128 = 2,097,152
    layers_forward, logit_forward = 27_262_976, 2_097_152
    assert 24 * 4 * 32 * 2 * 64**2 * 13 // 12 == layers_forward
    no_recompute = 3 * layers_forward + 3 * logit_forward
    with_recompute = 4 * layers_forward + 3 * logit_forward
    assert no_recompute == 88_080_384
    assert with_recompute == 115_343_360
    assert gpt_flops_per_step(2, 64, 32, 128, 4, recompute=False) == 88_080_384.0
    assert gpt_flops_per_step(2, 64, 32, 128, 4, recompute=True) == 115_343_360.0


def test_flops_matches_megatron_closed_form():
    # 96·B·s·L·h²·(1 + s/(6h) + V/(16·L·h)) with recompute (Narayanan et al. eq. 3); exact here
    # because every fraction divides: s/(6h) = 1024/6144 = 1/6, V/(16Lh) = 51200/(16·24·2048)
    B, s, L, h, V = 8, 1024, 24, 2048, 51200
    closed_form = 96 * B * s * L * h**2 * (1 + s / (6 * h) + V / (16 * L * h))
    assert gpt_flops_per_step(L, h, s, V, B, recompute=True) == pytest.approx(closed_form, rel=1e-15)


def test_layer_flops_for_another_ffn_grouped_query_attention_and_a_gated_mlp_by_hand():
    # h = 64, 4 heads of d = 16, 2 query groups (K and V 32 wide), ffn 96 gated (three matrices), s = 32:
    # Q and output 2·64·64 each = 16,384; K and V 2·64·32 each = 8,192; QKᵀ and AV 2·32·64 each = 8,192;
    # MLP 3 · 2·64·96 = 36,864. Total 69,632 a token.
    assert layer_forward_flops_per_token(64, 32, ffn_hidden=96, num_attention_heads=4, num_query_groups=2,
                                         gated_mlp=True) == 69_632
    # multi-head, ffn = 4h, no gate: Narayanan's 24·h² + 4·s·h
    assert layer_forward_flops_per_token(64, 32, num_attention_heads=4) == 24 * 64**2 + 4 * 32 * 64
    # ffn 96 without a gate: the MLP's 2 · 2·64·96 = 24,576 in place of 16·64² = 65,536
    assert layer_forward_flops_per_token(64, 32, ffn_hidden=96, num_attention_heads=4) == (24 * 64**2 + 4 * 32 * 64
                                                                                          - 65_536 + 24_576)
    # a step: model = 3 passes of layers and logits; hardware adds one pass of the layers with recompute
    step = gpt_step_flops(2, 64, 32, 128, 4, recompute=True, ffn_hidden=96, num_attention_heads=4,
                          num_query_groups=2, gated_mlp=True)
    layers, logits = 2 * 69_632 * 4 * 32, 2 * 64 * 128 * 4 * 32
    assert (step.model, step.hardware) == (3 * (layers + logits), 4 * layers + 3 * logits)
    # the chunked loss recomputed in backward (model.loss_recompute) runs the logits GEMM once more; the fused one
    # (its two backward GEMMs in the forward pass) and megatron's do not
    recomputed = gpt_step_flops(2, 64, 32, 128, 4, recompute=True, ffn_hidden=96, num_attention_heads=4,
                                num_query_groups=2, gated_mlp=True, loss_recompute=True)
    assert (recomputed.model, recomputed.hardware) == (3 * (layers + logits), 4 * layers + 4 * logits)


# ---------------------------------------------------------------- throughput, peaks


def test_throughput_tflops_mfu_and_hfu():
    peak = peak_tflops("H100", "bf16")
    assert peak == 989.0
    # 7.912e15 hardware FLOPs in 2 s over 8 GPUs: 7.912e15 / 2 / 8 / 1e12 = 494.5 TFLOP/s/GPU = 50% of 989;
    # model FLOPs 3/4 of that (a recomputed forward on top of three passes): 370.875 TFLOP/s, 37.5%
    record = throughput_metrics(2.0, 4096, 8, StepFlops(model=5_934_000_000_000_000, hardware=7_912_000_000_000_000),
                                peak)
    # 4096 tokens in 2 s: 2048 tokens/s for the job, 2048 / 8 = 256 for each of its 8 GPUs
    assert record == {"perf/step_time_s": 2.0, "perf/tokens_per_s": 2048.0, "perf/tokens_per_s_per_gpu": 256.0,
                      "perf/tflops_per_gpu": 494.5, "perf/model_tflops_per_gpu": 370.875, "perf/mfu": 0.375,
                      "perf/hfu": 0.5}
    assert not {"perf/mfu", "perf/hfu"} & set(throughput_metrics(2.0, 4096, 8, StepFlops(6, 8), None))


@pytest.mark.parametrize("name, key", [
    ("NVIDIA H100 80GB HBM3", "H100"),
    ("NVIDIA H100 PCIe", "H100-PCIe"),
    ("NVIDIA H100 NVL", None),
    ("NVIDIA H200", "H200"),
    ("NVIDIA GH200 480GB", None),
    ("NVIDIA A100-SXM4-80GB", "A100"),
    ("NVIDIA A100-PCIE-40GB", "A100"),
    ("Tesla V100-SXM2-32GB", "V100"),
    ("Tesla V100-PCIE-16GB", "V100-PCIe"),
    ("Tesla V100S-PCIE-32GB", None),
    ("NVIDIA GeForce RTX 4090", None),
])
def test_detect_gpu(name, key):
    assert detect_gpu(name) == key


def test_peak_table_values():
    assert peak_tflops("V100", "fp16") == 125.0
    assert peak_tflops("V100", "bf16") is None  # no bf16 on Volta
    assert peak_tflops("A100", "bf16") == 312.0
    assert peak_tflops("A100", "fp32") == 19.5
    assert peak_tflops("H200", "fp16") == 989.0
    assert peak_tflops("H100", "fp32") == 67.0
    assert peak_tflops(None, "bf16") is None
    assert metrics.device_peak_tflops("cpu", "fp32") is None


def test_float8_runs_divide_by_the_float8_dense_peak():
    """precision.fp8's MFU and HFU use the GPU's dense FP8 peak: NVIDIA's data sheets state 3,958 TFLOP/s "with
    sparsity" for the H100 SXM and H200 SXM, 3,026 for the H100 PCIe, dense being half; A100 and V100 have none."""
    assert (peak_tflops("H100", "fp8"), peak_tflops("H200", "fp8"), peak_tflops("H100-PCIe", "fp8")) == (
        3958 / 2, 3958 / 2, 3026 / 2)
    assert peak_tflops("A100", "fp8") is None and peak_tflops("V100", "fp8") is None
    assert metrics.peak_dtype("bf16", "tensorwise") == metrics.peak_dtype("bf16", "rowwise") == "fp8"
    assert metrics.peak_dtype("bf16", "none") == "bf16"


def test_memory_report_cpu():
    state = {"params": 1000, "grads": 2000, "master_params": 4000, "optimizer_states": 8000}
    record = memory_report("cpu", state)
    rss = record.pop("mem/rss_bytes")
    assert isinstance(rss, int) and rss > 0
    assert record == {"mem/params_bytes": 1000, "mem/grads_bytes": 2000,
                      "mem/master_params_bytes": 4000, "mem/optimizer_states_bytes": 8000}


# ---------------------------------------------------------------- sinks

RECORD = {"train/loss": 5.12341, "train/lr": 1e-3, "train/grad_norm": 1.234,
          "perf/tokens_per_s": 1234.4, "perf/tflops_per_gpu": 0.0123, "perf/mfu": 0.4123, "perf/hfu": 0.5498,
          "mem/rss_bytes": 3 * 2**29}


def test_console_plain_format(capsys, monkeypatch):
    clock = iter([100.0, 112.0, 137.0])  # time.monotonic() at each logged step
    monkeypatch.setattr(metrics.time, "monotonic", lambda: next(clock))
    sink = ConsoleSink(total_steps=40, mode="plain")
    sink.log(10, {**RECORD, "perf/step_time_s": 0.5, "perf/tokens_per_s_per_gpu": 617.2})
    sink.log(20, {"val/loss": 4.5, "train/loss_scale": 65536.0})
    sink.log(40, {"perf/step_time_s": 0.75})
    sink.close()
    # ETA: at the first logged step its own step time × the 30 steps left (15 s); then the wall time per step since
    # it: 12 s / 10 steps × 20 left = 24 s; none left at the last
    assert capsys.readouterr().out.splitlines() == [
        "step 10/40 | loss 5.1234 | lr 1.0e-03 | grad_norm 1.23 | tok/s 1234 | tok/s/GPU 617 | TFLOP/s/GPU 0.0123"
        " | MFU 41.2% | HFU 55.0% | mem 1.50 GiB | step 0.5 s | ETA 0:00:15",
        "step 20/40 | val_loss 4.5000 | scale 65536 | ETA 0:00:24",
        "step 40/40 | step 0.75 s | ETA 0:00:00",
    ]
    assert metrics.clock_text(3 * 3600 + 2 * 60 + 5.4) == "3:02:05"


class FakeTerminal(io.StringIO):
    def isatty(self):
        return True


def test_console_auto_mode(monkeypatch):
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    assert ConsoleSink(40, "auto", stream=io.StringIO()).mode == "plain"  # not a terminal
    bar = ConsoleSink(40, "auto", stream=FakeTerminal())
    assert bar.mode == "bar"
    bar.close()
    monkeypatch.setenv("SLURM_JOB_ID", "123")
    assert ConsoleSink(40, "auto", stream=FakeTerminal()).mode == "plain"
    with pytest.raises(ValueError, match="'auto', 'bar', 'plain'"):
        ConsoleSink(40, "fancy")


def test_console_bar_advances_and_keeps_eval_lines():
    stream = FakeTerminal()
    sink = ConsoleSink(40, "bar", start_step=5, stream=stream)
    sink.log(10, RECORD)
    assert sink.bar.n == 10
    sink.log(20, {"val/loss": 4.5})
    sink.close()
    assert "step 20/40 | val_loss 4.5000 | ETA " in stream.getvalue()


def test_jsonl_appends_and_resumes(tmp_path):
    path = tmp_path / "run" / "metrics.jsonl"
    sink = JsonlSink(path)
    for step in range(1, 4):
        sink.log(step, {"train/loss": 10.0 - step, "perf/tokens_per_s": 100.0 * step})
    sink.close()
    JsonlSink(path, fsync=True).log(4, {"train/loss": 6.0})  # a resumed run reopens the file
    lines = path.read_text().splitlines()
    assert len(lines) == 4
    rows = [json.loads(line) for line in lines]
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert [r["train/loss"] for r in rows] == [9.0, 8.0, 7.0, 6.0]
    assert rows[2]["perf/tokens_per_s"] == 300.0
    assert all(isinstance(r["time"], float) for r in rows)
    assert set(rows[3]) == {"step", "time", "train/loss"}


def test_wandb_mode_choice():
    assert wandb_mode({}) == "offline"
    assert wandb_mode({"WANDB_API_KEY": "k"}) == "online"
    assert wandb_mode({"WANDB_MODE": "disabled", "WANDB_API_KEY": "k"}) is None


def test_wandb_offline_run_files_and_summary(tmp_path, offline_wandb):
    run_dir = tmp_path / "run"
    config = {"model": {"num_layers": 2}, "zero": {"stage": 2}}
    sink = WandbSink("zero3d-test", "tiny", "g", config, run_dir)
    run_id = sink.run.id
    assert sink.run.settings.mode == "offline"
    assert sink.run.config["model"] == {"num_layers": 2}
    sink.log(1, {"train/loss": 5.0})
    sink.set_summary({"final/val_loss": 4.25, "final/tflops_per_gpu": 0.5})
    assert sink.run.summary["final/val_loss"] == 4.25
    assert sink.run.summary["final/tflops_per_gpu"] == 0.5
    sink.close()
    (offline_dir,) = (run_dir / "wandb").glob(f"offline-run-*-{run_id}")
    store = (offline_dir / f"run-{run_id}.wandb").read_bytes()
    # The offline store is protobuf: a summary item's key and JSON value appear verbatim.
    assert b"final/val_loss" in store and b"4.25" in store
    assert (run_dir / "wandb_run_id").read_text() == run_id + "\n"


def test_make_logger_rank0_resumes_wandb_run(tmp_path, offline_wandb, capsys):
    args = dict(run_dir=tmp_path, config_dict={"train": {"steps": 4}}, total_steps=4,
                console_mode="plain", use_wandb=True, wandb_project="p", wandb_name="n",
                wandb_group=None)
    with make_logger(0, **args) as logger:
        logger.log(2, {"train/loss": 3.0})
        first_id = logger.sinks[0].run.id
    with make_logger(0, start_step=2, **args) as logger:
        assert logger.sinks[0].run.id == first_id
        logger.log(4, {"train/loss": 2.0})
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [(r["step"], r["train/loss"]) for r in rows] == [(2, 3.0), (4, 2.0)]
    assert "step 4/4 | loss 2.0000" in capsys.readouterr().out


def test_make_logger_other_ranks_write_nothing(tmp_path, capsys):
    logger = make_logger(1, tmp_path / "run", {}, 40, "plain", True, "p", "n", None)
    assert isinstance(logger, MetricsLogger) and logger.sinks == []
    logger.log(1, RECORD)
    logger.set_summary({"final/val_loss": 1.0})
    logger.close()
    assert not (tmp_path / "run").exists()
    assert capsys.readouterr().out == ""


def test_achieved_bandwidth_is_bytes_over_the_collectives_seconds():
    """3.2 GB sent in 2 s of collectives: 1.6 GB/s; of them 1 GB inter-node: 0.5 GB/s over the same seconds."""
    report = {"comm/total/bytes": 3.2e9, "comm/time/seconds": 2.0, "comm/intra_node_bytes": 2.2e9,
              "comm/inter_node_bytes": 1.0e9}
    assert metrics.bandwidth_report(report) == {"comm/time/gbps": 1.6, "comm/time/intra_node_gbps": 1.1,
                                                "comm/time/inter_node_gbps": 0.5}
    assert metrics.bandwidth_report({"comm/total/bytes": 0.0}) == {}  # nothing timed: no rate


def test_cuda_memory_report_has_the_allocators_retry_and_oom_counters(monkeypatch):
    """On CUDA, torch.cuda.memory_stats()'s num_alloc_retries and num_ooms (since the process started); on CPU none."""
    import torch
    stats = {"num_alloc_retries": 3, "num_ooms": 1, "allocated_bytes.all.peak": 10}
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda: 7)
    monkeypatch.setattr(torch.cuda, "max_memory_reserved", lambda: 9)
    monkeypatch.setattr(torch.cuda, "memory_stats", lambda: stats)
    assert memory_report("cuda", {"params": 4}) == {"mem/params_bytes": 4, "mem/max_allocated_bytes": 7,
                                                    "mem/max_reserved_bytes": 9, "mem/alloc_retries": 3, "mem/ooms": 1}
    assert not {"mem/alloc_retries", "mem/ooms"} & set(memory_report("cpu", {}))


def test_tensorboard_sink_writes_each_numeric_key_readable_by_tensorboard(tmp_path):
    """Read back with tensorboard's own EventAccumulator: every numeric key (booleans as 0/1) at its step, as float32;
    text values are not scalars."""
    import numpy
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    sink = metrics.TensorBoardSink(tmp_path)
    records = {1: {"train/loss": 5.123456789, "comm/total/calls": 12, "train/skipped": False,
                   "perf/straggler_host": "node7"},
               2: {"train/loss": 4.5, "comm/total/calls": 13, "train/skipped": True}}
    for step, record in records.items():
        sink.log(step, record)
    sink.close()
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    assert sorted(events.Tags()["scalars"]) == ["comm/total/calls", "train/loss", "train/skipped"]
    for key in events.Tags()["scalars"]:
        assert [(e.step, e.value) for e in events.Scalars(key)] == [
            (step, float(numpy.float32(float(r[key])))) for step, r in records.items()]
