"""The optimizer step's moment (the estimator's `step_bytes`: stage 1's joined shard, the chunks a mixed-precision step
casts to fp32, Muon's whole-matrix step) held against the rank-local probe, which runs the engine: with little
activation memory the rank peaks there; offloaded, the step keeps no fp32 gradient on the device."""
import json

import pytest

from optim.spec import STEP_CHUNK
from pretrain.probe import cli as probe

# configs/tiny.toml in bf16 with a vocabulary megatron pads (1000 -> 1024), full recomputation, one sequence a
# micro-batch: 0.13 MB of checkpoints and a layer's 1.6 MB against 4 MB of fp32 gradient on one rank
TINY = ['model.vocab_size=1000', 'precision.dtype="bf16"', 'model.recompute="full"', "train.micro_batch_size=1"]


def _probe(capsys, world: int, stage: int, *extra: str, tp: int = 1) -> dict:
    assert probe.main(["--config", "configs/tiny.toml", "--world", str(world), "--steps", "2", "--json", *TINY,
                       f"parallel.tensor={tp}", f"train.global_batch_size={world // tp}", f"zero.stage={stage}",
                       *extra]) == 0
    return json.loads(capsys.readouterr().out)


@pytest.mark.parametrize("world,stage", [(1, 0), (3, 0), (1, 1), (2, 1), (1, 2), (1, 3)])
def test_a_step_with_little_activation_memory_peaks_at_its_casts_as_estimated(capsys, world, stage):
    """What backward holds beside the model states is less than what the step casts to fp32 at once: this rank's
    gradient (Ψ/N_d, stage 0's whole Ψ) in chunks of at most STEP_CHUNK elements, 4 bytes each — here the whole
    shard, under one chunk — and at stage 1 over two ranks the shard's pieces of the whole gradient joined in bf16
    first (2Ψ/N_d; one rank's pieces are the whole buffer: none). So the rank peaks in its step, and the estimate
    (model states + that) gives the peak: less than 1 KiB below it (the step's scalars) and at most 2% above (stages
    1 and 3 count a few buffers the step has freed). Without the step's moment it would be 9% below."""
    out = _probe(capsys, world, stage)
    run, estimate = out["run"], out["estimate"]
    shard = estimate["params_per_rank"] / (world if stage else 1)
    assert shard < STEP_CHUNK
    vectors = 4 * (384 + 128 + 512 + 128 + 2 * 2 * 128) + 2 * 128  # biases and layernorms: their group, one bucket
    joined = 2 * (estimate["params_per_rank"] - vectors) / world if stage == 1 and world > 1 else 0
    assert estimate["step_bytes"] == pytest.approx(4 * shard + joined)
    assert run["peak_phase"] in ("reduction", "optimizer step"), run["phase_peaks"]
    peak = estimate["total_bytes"] - estimate["margin_bytes"]
    assert -1024 < peak - run["peak_bytes"] <= 0.02 * run["peak_bytes"], (peak, run["peak_bytes"])


@pytest.mark.parametrize("state_dtype,stage", [("fp32", 2), ("bf16", 2), ("fp32", 3), ("bf16", 1)])
def test_a_shard_past_one_chunk_is_cast_a_chunk_at_a_time(capsys, state_dtype, stage):
    """A rank of 25M parameters in bf16 (hidden 512, 8 layers, one rank): past STEP_CHUNK (4.2M elements), so the step
    holds beside the model states one chunk of fp32 gradient (16 MiB) and, with bf16 AdamW states, the chunk's two
    states upcast (32 MiB more) — not the 100 MB fp32 copy of the shard it made before. The probe's step phase is the
    model states plus that, to within 1 KiB below (the step's scalars) and 1% above."""
    out = _probe(capsys, 1, stage, "model.hidden_size=512", "model.num_layers=8", "model.num_attention_heads=8",
                 f'optimizer.state_dtype="{state_dtype}"')
    run, estimate = out["run"], out["estimate"]
    assert estimate["params_per_rank"] > 6 * STEP_CHUNK
    chunk = 4 * STEP_CHUNK * (3 if state_dtype == "bf16" else 1)
    assert estimate["step_bytes"] == chunk
    step = sum(estimate[k] for k in ("param_bytes", "grad_bytes", "optimizer_bytes")) + chunk
    measured = run["phase_peaks"]["optimizer step"]
    assert -1024 < step - measured <= 0.01 * measured, (step, measured, run["phase_peaks"])


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_an_offloaded_step_keeps_no_fp32_gradient_on_the_device(capsys, stage):
    """ZeRO-Offload ("cpu"), two ranks: the step reads the host gradient shard (stage 1's device pieces are copied down
    into it), and the host optimizer's states are host memory from its first step on. Through the optimizer step the
    device holds its model states (parameters, stage 1's gradients, the step counters) and under 1 KiB more; the
    estimate counts no step moment."""
    out = _probe(capsys, 2, stage, 'zero.offload_optimizer="cpu"')
    run = out["run"]
    beyond = run["phase_peaks"]["optimizer step"] - sum(run["model_states"].values())
    assert 0 <= beyond < 1024, (beyond, run["phase_peaks"], run["model_states"])
    assert out["estimate"]["step_bytes"] == 0
    assert run["host_peak_by_category"]["optimizer"] == 12 * run["host_peak_by_category"]["temporaries"] // 2


@pytest.mark.parametrize("world,stage,tp,placement", [(1, 2, 1, "none"), (3, 1, 1, "none"), (3, 3, 1, "none"),
                                                      (2, 0, 1, "none"), (4, 2, 2, "none"), (2, 2, 1, "cpu")])
def test_muons_whole_matrix_step_is_the_moment_the_estimate_gives(capsys, world, stage, tp, placement):
    """Muon: its whole-matrix step gathers each matrix's direction to the rank that computes it, runs Newton–Schulz
    and sends the updates back (zero3d/whole_matrix.py), holding two fp32 copies of the larger of this rank's part of
    the matrices and the matrices it computes (plus, at TP 2, their TP shards), or one beside Newton–Schulz's iterates
    (analysis/step_moment.py). With full recomputation it is the rank's peak, and the estimate of the step (model
    states + its moment: that, and stage 1's joined shard) is that peak to 2% (never 1 KiB below) at stages 0-3, three
    ranks, TP 2, and with the AdamW part of the optimizer on the host. The step used to keep every copy to the end,
    twice this (docs/estimator.md). Buckets of 100,000 elements: every group of stage 1's but the 1-D one spans
    several (the estimate takes a group of more than one bucket's elements as joined)."""
    out = _probe(capsys, world, stage, 'optimizer.name="muon"', f'zero.offload_optimizer="{placement}"',
                 "zero.bucket_elements=100000", tp=tp)
    run, estimate = out["run"], out["estimate"]
    assert estimate["matrix_step_bytes"] > 0 and run["peak_phase"] == "optimizer step", run["phase_peaks"]
    step = sum(estimate[k] for k in ("param_bytes", "grad_bytes", "optimizer_bytes")) + estimate["step_bytes"]
    assert -1024 < step - run["peak_bytes"] <= 0.02 * run["peak_bytes"], (step, run["peak_bytes"])
