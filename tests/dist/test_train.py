"""The whole training path on the shipped corpus: layouts agree, metrics are complete, resume is exact."""
import json
import math
from pathlib import Path

import pytest

from ranks import run_ranks

REPO = Path(__file__).resolve().parents[2]
SMALL = ["model.num_layers=2", "model.hidden_size=64", "model.num_attention_heads=4", "model.seq_length=32",
         "model.vocab_size=512", "train.micro_batch_size=2", "train.global_batch_size=8",
         "train.eval_interval=5", "train.eval_iters=1", "logging.wandb=false", "logging.console=plain",
         "optimizer.warmup_steps=2"]


@pytest.fixture(scope="module")
def data_cache(tmp_path_factory):
    """Tokenizer and .bin/.idx built once for the module (what rank 0 does at the start of a run)."""
    from pretrain.config import DataConfig
    from pretrain.data.datasets import prepare_files
    cache = tmp_path_factory.mktemp("data")
    prepare_files(DataConfig(corpus=str(REPO / "data/corpus.jsonl"), cache_dir=str(cache)), vocab_size=512)
    return [f"data.corpus={json.dumps(str(REPO / 'data/corpus.jsonl'))}",
            f"data.cache_dir={json.dumps(str(cache))}"]


def _train(rank, world_size, overrides):
    from pretrain.config import load_config
    from pretrain.runtime.layout import destroy_layout
    from pretrain.train import train
    try:
        train(load_config(REPO / "configs/tiny.toml", overrides))
    finally:
        destroy_layout()


def records(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def run_train(world, overrides):
    run_ranks(_train, world, overrides, timeout=300)


@pytest.mark.parametrize("stage", [0, 2])
def test_loss_agrees_across_tp_dp_layouts(tmp_path, data_cache, stage):
    """(TP, DP) = (1,1), (2,1), (1,2), (2,2), same data and global batch: the same 10 losses, and the
    same val/loss (eval_iters × global batch, as Megatron; not × micro-batch × DP)."""
    losses, val = {}, {}
    for tp, dp in [(1, 1), (2, 1), (1, 2), (2, 2)]:
        run_dir = tmp_path / f"tp{tp}dp{dp}"
        run_train(tp * dp, SMALL + data_cache + [f"parallel.tensor={tp}", f"zero.stage={stage}", "train.steps=10",
                                                 f"logging.run_dir={json.dumps(str(run_dir))}"])
        losses[(tp, dp)] = [r["train/loss"] for r in records(run_dir)]
        val[(tp, dp)] = [r["val/loss"] for r in records(run_dir) if "val/loss" in r]
    ref = losses[(1, 1)]
    assert len(ref) == 10 and ref[-1] < ref[0]
    for layout, values in losses.items():
        assert values == pytest.approx(ref, rel=1e-4), layout
    assert len(val[(1, 1)]) == 2
    for layout, values in val.items():
        assert values == pytest.approx(val[(1, 1)], rel=1e-4), layout


def test_metrics_file_has_every_field(tmp_path, data_cache):
    run_dir = tmp_path / "run"
    run_train(4, SMALL + data_cache + ["parallel.tensor=2", "zero.stage=1", "train.steps=5",
                                       f"logging.run_dir={json.dumps(str(run_dir))}"])
    rows = records(run_dir)
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5]
    required = {"train/loss", "train/lr", "train/grad_norm", "train/loss_scale", "perf/tokens_per_s",
                "perf/tflops_per_gpu", "perf/step_time_s", "mem/params_bytes", "mem/grads_bytes",
                "mem/master_params_bytes", "mem/optimizer_states_bytes", "mem/rss_bytes",
                "comm/reduce_scatter/grads/bytes", "comm/reduce_scatter/grads/calls", "comm/all_gather/params/bytes",
                "comm/total/bytes", "comm/time/hidden_fraction", "comm/intra_node_bytes", "comm/inter_node_bytes"}
    for row in rows:
        assert required <= row.keys(), required - row.keys()
    assert {"val/loss", "val/ppl"} <= rows[-1].keys()
    for row in rows:
        # the step's phases tile it: data, forward, backward and optimizer (each less the communication it was
        # blocked on) plus that exposed communication add up to the loop's own clock of the step, within 5%
        phases = {k.removeprefix("perf/phase/"): v for k, v in row.items() if k.startswith("perf/phase/")}
        assert set(phases) == {"data_s", "forward_s", "backward_s", "optimizer_s", "comm_exposed_s"}, phases
        assert sum(phases.values()) == pytest.approx(row["perf/step_time_s"], rel=0.05), (row["step"], phases)
        assert min(phases.values()) > 0
        assert phases["comm_exposed_s"] == pytest.approx(row["comm/time/exposed_seconds"], rel=1e-9)
        assert row["perf/tokens_per_s_per_gpu"] == pytest.approx(row["perf/tokens_per_s"] / 4, rel=1e-12)
        assert row["comm/time/gbps"] == pytest.approx(row["comm/total/bytes"] / row["comm/time/seconds"] / 1e9)
    # TensorBoard's own reader finds the JSONL's numeric keys, each value at its step (TensorBoard keeps float32)
    import numpy
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    events = EventAccumulator(str(run_dir / "tensorboard"), size_guidance={"scalars": 0})
    events.Reload()
    numeric = {k for r in rows for k, v in r.items() if isinstance(v, (int, float)) and k not in ("step", "time")}
    assert set(events.Tags()["scalars"]) == numeric
    for key in numeric:
        assert [(e.step, e.value) for e in events.Scalars(key)] == [
            (r["step"], float(numpy.float32(r[key]))) for r in rows if key in r], key
    assert (run_dir / "checkpoints" / "latest").read_text().strip() == "step_00000005"
    assert json.loads((run_dir / "status.json").read_text()) == {"status": "ok", "reason": "", "world_size": 4,
                                                                  "steps": 5, "exit_code": 0, "error": ""}


def test_offload_through_the_loop(tmp_path, data_cache):
    """The training loop with the optimizer states in files (ZeRO-Infinity): the losses of the run
    without offload, the mem/ keys split device / host / NVMe, a final checkpoint saved from the
    files, and nothing left in zero.nvme_path."""
    nvme_dir = tmp_path / "nvme_files"
    nvme_dir.mkdir()
    runs = {}
    for name, extra in (("device", []), ("nvme", ["zero.offload_optimizer=nvme", f"zero.nvme_path={json.dumps(str(nvme_dir))}",
                                                   "zero.nvme_buffer_bytes=300000"])):
        run_dir = tmp_path / name
        run_train(2, SMALL + data_cache + ["zero.stage=2", "train.steps=4", *extra,
                                           f"logging.run_dir={json.dumps(str(run_dir))}"])
        runs[name] = records(run_dir)
    device, nvme = runs["device"], runs["nvme"]
    assert [r["train/loss"] for r in nvme] == pytest.approx([r["train/loss"] for r in device], rel=1e-6)
    last = nvme[-1]
    assert last["mem/optimizer_states_bytes"] == 0 and last["mem/master_params_bytes"] == 0
    assert last["mem/nvme_optimizer_states_bytes"] == device[-1]["mem/optimizer_states_bytes"] > 0
    # zero3d/nvme.py's two host buffers, each a chunk of master, exp_avg, exp_avg_sq and gradient in fp32 (16
    # bytes an element, the model being fp32): chunk = 300000 // (2 · 16) = 9375 elements, down to a multiple of
    # 4096 = 8192, smaller than the largest group's shard (TP 2 × DP 1: the word embedding's half alone, 512·64/2)
    per_element, budget, align = 4 * 4, 300000, 4096
    chunk = budget // (2 * per_element) // align * align
    assert chunk == 8192 < 512 * 64 // 2
    assert last["mem/host_buffers_bytes"] == 2 * chunk * per_element == 262144
    assert (tmp_path / "nvme" / "checkpoints" / "latest").read_text().strip() == "step_00000004"
    assert list(nvme_dir.iterdir()) == []


WSD_MID_DECAY = ['optimizer.schedule="wsd"', "optimizer.decay_fraction=0.7", 'optimizer.decay_shape="1-sqrt"']


@pytest.mark.parametrize("stage, schedule", [(2, []), (3, WSD_MID_DECAY)], ids=["2-cosine", "3-wsd"])
def test_resume_continues_exactly(tmp_path, data_cache, stage, schedule):
    """Stop after 3 steps and resume to 6: steps 4-6 equal an uninterrupted 6-step run, their learning rates
    too (WSD: the resumed steps cross from its stable phase into its decay)."""
    base = SMALL + data_cache + ["parallel.tensor=2", f"zero.stage={stage}", "train.save_interval=3", *schedule]
    whole, split = tmp_path / "whole", tmp_path / "split"
    run_train(4, base + ["train.steps=6", f"logging.run_dir={json.dumps(str(whole))}"])
    run_train(4, base + ["train.steps=3", "optimizer.decay_steps=6", f"logging.run_dir={json.dumps(str(split))}"])
    run_train(4, base + ["train.steps=6", f"logging.run_dir={json.dumps(str(split))}"])
    expected = {r["step"]: (r["train/loss"], r["train/lr"]) for r in records(whole)}
    resumed = {r["step"]: (r["train/loss"], r["train/lr"]) for r in records(split)}
    assert sorted(resumed) == [1, 2, 3, 4, 5, 6]
    for step in (4, 5, 6):
        assert resumed[step] == expected[step], step
    lrs = [expected[step][1] for step in (3, 4, 5, 6)]
    if schedule:  # WSD over 4 steps after a 2-step warmup: 0.7 × 4 → the last 3 decay (steps 4, 5, 6 logged)
        assert lrs[0] == lrs[1] > lrs[2] > lrs[3]


def wandb_summary(store) -> dict:
    """The summary an offline wandb run recorded: its .wandb store parsed record by record with wandb's
    protobuf schema. (Offline runs write no files/wandb-summary.json, and wandb 0.31 ships no Python
    reader.) The store is a LevelDB log: a 7-byte W&B header, then 32 KiB blocks of chunks, each
    crc32c (4 bytes), length (2), type (1: whole, 2: first, 3: middle, 4: last) and data."""
    from wandb.proto import wandb_internal_pb2
    raw = store.read_bytes()
    assert raw[:4] == b":W&B", raw[:7]
    summary, pending, pos = {}, b"", 7
    while pos + 7 <= len(raw):
        if 32768 - pos % 32768 < 7:  # block trailer too short for a header: padding
            pos += 32768 - pos % 32768
            continue
        length, kind = int.from_bytes(raw[pos + 4:pos + 6], "little"), raw[pos + 6]
        pending = (b"" if kind in (1, 2) else pending) + raw[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            if record.WhichOneof("record_type") == "summary":
                for item in record.summary.update:
                    summary[item.key or "/".join(item.nested_key)] = json.loads(item.value_json)
    return summary


def test_final_checkpoint_can_be_skipped_and_wandb_summary_holds_the_table(tmp_path, data_cache, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    run_dir = tmp_path / "run"
    run_train(2, SMALL + data_cache + ["train.steps=4", "train.save_final=false", "logging.wandb=true",
                                       "logging.summary_warmup_steps=1", f"logging.run_dir={json.dumps(str(run_dir))}"])
    assert not (run_dir / "checkpoints").exists()
    (store,) = run_dir.glob("wandb/offline-run-*/run-*.wandb")
    stored = wandb_summary(store)
    rows = records(run_dir)
    median = sorted(r["perf/tflops_per_gpu"] for r in rows[1:])[1]  # steps 2-4 (warm-up 1)
    for key, value in {"summary/tflops_per_gpu": median, "summary/pflops": median * 2 / 1000,
                       "summary/final_loss": rows[-1]["train/loss"], "summary/world_size": 2}.items():
        assert stored[key] == pytest.approx(value, rel=1e-12), key


def test_the_start_up_check_counts_the_node_topologys_dp_ranks(tmp_path, data_cache, capfd):
    """hpZ (stage 3, zero.secondary_partition = node) on 4 ranks as 2 nodes × 2: the table the run prints at its start
    is --estimate's of the same config, its secondary copy Ψ·b/m counted with the m = 2 DP ranks a node the run's node
    topology holds (Layout.dp_per_node), not one."""
    from pretrain.config import load_config
    from pretrain.memory_check import config_report
    overrides = SMALL + data_cache + ["parallel.tensor=1", "zero.stage=3", "zero.secondary_partition=node",
                                      "cluster.gpus_per_node=2", "model.compile=false", "train.steps=1",
                                      "train.save_final=false",
                                      f"logging.run_dir={json.dumps(str(tmp_path / 'run'))}"]
    capfd.readouterr()
    run_train(4, overrides)
    cfg = load_config(REPO / "configs/tiny.toml", overrides)
    note = (f"CPU run: no device memory check (the estimate is for {cfg.cluster.gpu}, "
            f"{cfg.cluster.gpu_memory_gb:g} GiB)")
    estimate, table = config_report(cfg, 4, note)
    one_per_node, _ = config_report(load_config(REPO / "configs/tiny.toml", overrides + ["cluster.gpus_per_node=1"]),
                                    4, note)
    assert estimate.param_bytes < one_per_node.param_bytes  # the secondary copy: Ψ·b/2 of it, not Ψ·b
    assert table in capfd.readouterr().out


def test_pipeline_run_logs_and_resumes(tmp_path, data_cache):
    """TP 2 × PP 2 through the real loop: loss on every rank's log, eval, exact resume."""
    base = SMALL + data_cache + ["parallel.tensor=2", "parallel.pipeline=2", "zero.stage=1", "train.save_interval=2"]
    whole, split = tmp_path / "whole", tmp_path / "split"
    run_train(4, base + ["train.steps=4", f"logging.run_dir={json.dumps(str(whole))}"])
    run_train(4, base + ["train.steps=2", "optimizer.decay_steps=4", f"logging.run_dir={json.dumps(str(split))}"])
    run_train(4, base + ["train.steps=4", f"logging.run_dir={json.dumps(str(split))}"])
    rows = records(whole)
    assert [r["step"] for r in rows] == [1, 2, 3, 4] and "val/loss" in rows[-1]
    assert {r["step"]: r["train/loss"] for r in records(split)} == {r["step"]: r["train/loss"] for r in rows}


def test_resume_at_another_layout_through_the_loop(tmp_path, data_cache):
    """Saved at TP 2 × DP 1, resumed at TP 1 × DP 2: steps 3-4 equal the uninterrupted run's (to 1e-6)."""
    whole, split = tmp_path / "whole", tmp_path / "split"
    base = SMALL + data_cache + ["zero.stage=1", "optimizer.decay_steps=4"]
    run_train(2, base + ["parallel.tensor=2", "train.steps=4", f"logging.run_dir={json.dumps(str(whole))}"])
    run_train(2, base + ["parallel.tensor=2", "train.steps=2", f"logging.run_dir={json.dumps(str(split))}"])
    run_train(2, base + ["parallel.tensor=1", "train.steps=4", f"logging.run_dir={json.dumps(str(split))}"])
    expected = {r["step"]: r["train/loss"] for r in records(whole)}
    resumed = {r["step"]: r["train/loss"] for r in records(split)}
    assert sorted(resumed) == [1, 2, 3, 4]
    for step in (3, 4):
        assert resumed[step] == pytest.approx(expected[step], rel=1e-6, abs=0), step



@pytest.mark.parametrize("keys", [[], ["data.eod_mask_loss=true"]], ids=["loss", "eod-masked-loss"])
def test_context_parallel_logs_the_one_rank_run(tmp_path, data_cache, keys):
    """parallel.context = 2 through the training loop: what it logs — train/loss (the value the non-finite guard
    reads), train/grad_norm, val/loss — equals the one-rank run's, step for step (fp32, 1e-6; the norm's squares
    summed in another order, 2e-6). With data.eod_mask_loss each context rank's loss is its share of the masked
    sum over the micro-batch's unmasked tokens (the step's count over every micro-batch and rank), so the loss and
    its gradient are the one-rank run's mean over the global batch's unmasked tokens."""
    base = SMALL + data_cache + keys + ["parallel.tensor=1", "zero.stage=2", "train.steps=4", "train.eval_interval=4",
                                        'model.attention="sdpa"']
    runs = {}
    for name, world, layout in (("one", 1, []), ("context", 2, ["parallel.context=2"])):
        run_dir = tmp_path / name
        run_train(world, base + layout + [f"logging.run_dir={json.dumps(str(run_dir))}"])
        runs[name] = records(run_dir)
    one, context = runs["one"], runs["context"]
    assert [r["step"] for r in context] == [r["step"] for r in one] == [1, 2, 3, 4]
    for key, rtol in (("train/loss", 1e-6), ("train/grad_norm", 2e-6)):
        assert [r[key] for r in context] == pytest.approx([r[key] for r in one], rel=rtol, abs=0), key
    assert context[-1]["val/loss"] == pytest.approx(one[-1]["val/loss"], rel=1e-6, abs=0)
    assert one[-1]["train/loss"] < one[0]["train/loss"]  # it trained: the steps moved the loss past the tolerance


def test_a_non_finite_streak_at_context_2_stops_every_rank_where_one_rank_stops(tmp_path, data_cache):
    """lr = 1e30 (finite, so accepted) makes the weights NaN producers. At parallel.context = 2 the guard reads the
    loss the context ranks' shares sum to: both ranks stop with the one-rank run's error at its step (the second
    non-finite step in a row), after the same logged losses, the last good checkpoint kept."""
    base = SMALL + data_cache + ["parallel.tensor=1", "zero.stage=1", "train.steps=8", "train.save_interval=1",
                                 "train.max_nonfinite_steps=2", "optimizer.lr=1e30", "optimizer.min_lr=0",
                                 "optimizer.warmup_steps=0", "train.eval_interval=0", 'model.attention="sdpa"']
    runs, errors = {}, {}
    for name, world, layout in (("one", 1, []), ("context", 2, ["parallel.context=2"])):
        run_dir = tmp_path / name
        with pytest.raises(RuntimeError) as err:
            run_train(world, base + layout + [f"logging.run_dir={json.dumps(str(run_dir))}"])
        runs[name], errors[name] = records(run_dir), str(err.value)
    losses = {name: [r["train/loss"] for r in rows] for name, rows in runs.items()}
    finite = [i + 1 for i, loss in enumerate(losses["one"]) if math.isfinite(loss)]
    assert len(losses["one"]) == finite[-1] + 2  # stopped at the second non-finite step in a row
    assert len(losses["context"]) == len(losses["one"])
    assert losses["context"][:len(finite)] == pytest.approx(losses["one"][:len(finite)], rel=1e-6, abs=0)
    assert not any(math.isfinite(loss) for loss in losses["context"][len(finite):])
    line = f"loss or gradient norm not finite for 2 consecutive steps (steps {len(finite) + 1}-{len(finite) + 2}: loss nan"
    assert errors["one"].count(line) == 1 and errors["context"].count(line) == 2  # every rank's own error
    for name in runs:
        assert (tmp_path / name / "checkpoints" / "latest").read_text() == f"step_{finite[-1]:08d}\n"

def test_data_error_reaches_every_rank(tmp_path):
    """A missing corpus is found before the process group starts; every rank raises the same clear error (no hang)
    and nothing is written."""
    with pytest.raises(RuntimeError) as err:
        run_train(2, SMALL + ["data.corpus=\"/nonexistent/corpus.jsonl\"",
                              f"data.cache_dir={json.dumps(str(tmp_path))}",
                              f"logging.run_dir={json.dumps(str(tmp_path / 'run'))}"])
    assert str(err.value).count("data.corpus = '/nonexistent/corpus.jsonl' does not exist") == 2
    assert not (tmp_path / "run").exists()  # a refused start writes nothing (the rank's line says why)


def _train_with_signal(rank, world_size, overrides, signal_rank, signal_step):
    """As _train, but `signal_rank` gets SIGUSR1 (Slurm's pre-emption warning) during step `signal_step`."""
    import os
    import signal

    import pretrain.step as training_step
    lr_at = training_step.lr_at

    def lr_at_with_signal(step, cfg):
        if rank == signal_rank and step == signal_step:
            os.kill(os.getpid(), signal.SIGUSR1)
        return lr_at(step, cfg)
    training_step.lr_at = lr_at_with_signal
    _train(rank, world_size, overrides)


def test_signal_on_one_rank_stops_all_ranks_at_one_checkpoint(tmp_path, data_cache):
    base = SMALL + data_cache + ["parallel.tensor=2", "zero.stage=2", "train.steps=6"]
    whole, stopped = tmp_path / "whole", tmp_path / "stopped"
    run_train(4, base + [f"logging.run_dir={json.dumps(str(whole))}"])
    run_ranks(_train_with_signal, 4, base + [f"logging.run_dir={json.dumps(str(stopped))}"], 3, 2, timeout=300)
    assert [r["step"] for r in records(stopped)] == [1, 2, 3]  # stopped after the step it was signalled in
    assert (stopped / "checkpoints" / "latest").read_text().strip() == "step_00000003"
    assert json.loads((stopped / "status.json").read_text())["status"] == "interrupted"
    run_train(4, base + [f"logging.run_dir={json.dumps(str(stopped))}"])  # the requeued job
    expected = {r["step"]: r["train/loss"] for r in records(whole)}
    assert {r["step"]: r["train/loss"] for r in records(stopped)} == expected


def _train_with_a_slow_rank(rank, world_size, overrides):
    """Rank 1 sleeps 0.4 s before each step's work (outside every collective): a straggler."""
    import time
    import pretrain.train as loop
    if rank == 1:
        step = loop.train_step
        loop.train_step = lambda *args, **kwargs: (time.sleep(0.4), step(*args, **kwargs))[1]
    _train(rank, world_size, overrides)


def test_a_slow_rank_is_named_with_its_host(tmp_path, data_cache, capfd):
    import socket
    from pretrain.summary import worst_offenders
    run_dir = tmp_path / "run"
    run_ranks(_train_with_a_slow_rank, 2, SMALL + data_cache + [
        "parallel.tensor=1", "zero.stage=1", "train.steps=4", "logging.log_interval=2", "train.eval_interval=0",
        f"logging.run_dir={json.dumps(str(run_dir))}"], timeout=300)
    rows = records(run_dir)
    assert [r["step"] for r in rows] == [2, 4]
    for row in rows:  # rank 1's compute is 0.4 s more than rank 0's (a tiny step is well under 0.4 s)
        assert row["perf/slowest_rank"] == 1 and row["perf/straggler_rank"] == 1
        assert row["perf/straggler_host"] == socket.gethostname()
        assert row["perf/slowest_ratio"] > 1.5
        assert row["perf/straggler_compute_s"] >= 0.4  # its sleep is compute, not time blocked on a collective
    assert f"step 2: straggler: rank 1 on {socket.gethostname()} computes" in capfd.readouterr().err
    assert worst_offenders(rows) == (f"rank 1 ({socket.gethostname()}): 2 of 2 intervals, "
                                     f"worst {max(r['perf/slowest_ratio'] for r in rows):.2f}×")
