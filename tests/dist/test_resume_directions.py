"""Resume with dropout and fp16 from a stage 3 checkpoint (same layout bitwise, stage 0, TP 1 → 2), and from PP + stage 0."""
import math

import pytest
import torch

from checkpoint_harness import train_segment
from pretrain.checkpoint.read import read_dcp_metadata
from ranks import run_ranks

SEED, SAVE_AT, STEPS = 1234, 4, 7
# Dropout draws from the restored generators after the resume; fp16 with a scale that doubles every 2
# clean steps: 65536 · 2^⌊4/2⌋ = 262144 at the save, what a scaler that was not restored cannot have.
TRAINING = ["model.hidden_dropout=0.1", "model.attention_dropout=0.1", "precision.dtype=fp16",
            "precision.growth_interval=2"]
# Stage 3 with the layer norms' weights and biases (32 elements) kept whole on every rank.
SAVED = TRAINING + ["zero.stage=3", "zero.param_persistence_threshold=64"]
FP16_EPS = 2.0 ** -10


@pytest.fixture(scope="module")
def stage3_run(tmp_path_factory):
    """TP 1 × DP 2, stage 3, 7 steps, saving after step 4: the run every resume here must continue."""
    save_dir = tmp_path_factory.mktemp("stage3")
    return save_dir, run_ranks(train_segment, 2, SAVED, save_dir, 0, STEPS, (SAVE_AT,), timeout=300)


def test_same_layout_resume_with_dropout_and_fp16_is_bitwise(stage3_run):
    save_dir, ref = stage3_run
    assert ref[0]["loss_scale"][SAVE_AT - 1] == 2.0 ** 16 * 2 ** (SAVE_AT // 2)  # no overflow: the scale grew
    out = run_ranks(train_segment, 2, SAVED, save_dir, SAVE_AT, STEPS, (), True, timeout=300)
    assert out[0]["notes"] == []  # the per-rank generators restored, nothing re-derived
    for r_ref, r_out in zip(ref, out):
        assert r_out["loss"] == r_ref["loss"][SAVE_AT:]  # dropout masks and every update the same
        assert r_out["loss_scale"] == r_ref["loss_scale"][SAVE_AT:]
        for name, p in r_ref["params"].items():
            assert torch.equal(r_out["params"][name], p), name


def test_resume_into_stage0_at_dp2_continues_the_stage3_run(stage3_run):
    """Same world, TP, PP and DP, so the generators are restored; stage 0 accumulates the fp16 gradient
    before reducing it, stage 3 reduces each micro-batch's (3 of them): a few fp16 roundings a step."""
    save_dir, ref = stage3_run
    out = run_ranks(train_segment, 2, TRAINING + ["zero.stage=0"], save_dir, SAVE_AT, STEPS, (), True, timeout=300)
    assert out[0]["notes"] == []
    for r_ref, r_out in zip(ref, out):
        for name, p in r_ref["saved_params"][SAVE_AT].items():  # every element, replicated groups whole
            assert torch.equal(r_out["params_at_resume"][name], p), name
        assert r_out["loss_scale"] == r_ref["loss_scale"][SAVE_AT:]
        steps = STEPS - SAVE_AT
        torch.testing.assert_close(torch.tensor(r_out["loss"]), torch.tensor(r_ref["loss"][SAVE_AT:]),
                                   rtol=8 * steps * FP16_EPS, atol=0)


def test_resume_at_tp2_rederives_the_generators_from_seed_and_step(stage3_run):
    """TP 1 × DP 2 → TP 2 × DP 1, stage 1: the generators are those start-up makes from seed + step
    (docs), the weights are the saved ones split over TP, and the fp16 scale carries on."""
    save_dir, ref = stage3_run
    out = run_ranks(train_segment, 2, TRAINING + ["parallel.tensor=2", "zero.stage=1"], save_dir, SAVE_AT,
                    SAVE_AT + 1, (), True, 0, True, None, None, 3, None, SEED + SAVE_AT, timeout=300)
    saved = ref[0]["saved_params"][SAVE_AT]
    for r in out:
        assert any(n.startswith(f"RNG states re-derived from seed {SEED} + step {SAVE_AT}") for n in r["notes"])
        for key, state in r["seeded"].items():
            assert torch.equal(r["rng_at_resume"][key], state), key
        for name, p in r["params_at_resume"].items():
            dim = r["tp_dims"][name]
            whole = saved[name]
            expected = whole if dim is None else whole.chunk(2, dim=dim)[r["tp_rank"]]
            assert torch.equal(p, expected), name
        assert r["loss_scale"] == ref[0]["loss_scale"][SAVE_AT:SAVE_AT + 1]  # 262144 carried on


def test_checkpoint_from_pp2_stage0_resumes_at_one_rank_and_holds_16_bytes_a_parameter(tmp_path):
    """Saved from PP 2 × DP 1 at stage 0 (fp32, no dropout); resumed at one rank, stage 2: the losses
    continue to fp32 rounding, and the files hold 4Ψ + 12Ψ bytes (Ψ counted on the PP 1 model) plus
    headers under 4 KiB an item."""
    fp32 = ["parallel.pipeline=2", "zero.stage=0", "train.global_batch_size=4"]
    ref = run_ranks(train_segment, 2, fp32, tmp_path, 0, 3, (2,), timeout=300)
    out = run_ranks(train_segment, 1, ["zero.stage=2", "train.global_batch_size=4"], tmp_path, 2, 3, (), True,
                    timeout=300)[0]
    assert out["resumed"]["step"] == 2
    torch.testing.assert_close(torch.tensor(out["loss"]), torch.tensor(ref[0]["loss"][2:]), rtol=1e-6, atol=0)
    assert_checkpoint_bytes(tmp_path / "step_00000002", out["psi"], 4)


def assert_checkpoint_bytes(step_dir, psi: int, param_bytes: int) -> None:
    """Tensor bytes as DCP recorded them (each stored chunk's elements × its dtype's size):
    param_bytes·Ψ (model) + 12Ψ (fp32 master, Adam's two moments); the files on disk hold those plus
    per-item headers (torch.save zip records) under 4 KiB each."""
    md = read_dcp_metadata(step_dir)
    payload = sum(math.prod(chunk.sizes) * torch.empty((), dtype=meta.properties.dtype).element_size()
                  for meta in md.state_dict_metadata.values() for chunk in meta.chunks)
    on_disk = sum(p.stat().st_size for p in step_dir.iterdir() if p.suffix == ".distcp")
    assert payload == (param_bytes + 12) * psi, (payload, psi)
    assert 0 <= on_disk - payload < 4096 * len(md.storage_data)


def test_fp16_checkpoint_holds_14_bytes_a_parameter(stage3_run):
    save_dir, ref = stage3_run
    assert_checkpoint_bytes(save_dir / f"step_{SAVE_AT:08d}", ref[0]["psi"], 2)


# fp16 from a scale of 2^30, backing off ×2^-10 after every second overflow: the first 3 steps all overflow
# (2^30, 2^30, 2^20), so the save after them holds no optimizer step and a scaler mid-hysteresis
ALL_SKIPPED = ["precision.dtype=fp16", f"precision.initial_loss_scale={2 ** 30}", f"precision.backoff_factor={2 ** -10}",
               "precision.hysteresis=2", "zero.stage=2"]


def test_a_save_after_only_skipped_steps_resumes_bitwise(tmp_path):
    """Issue #40's combination fp16 skip × checkpoint fields: saved after 3 steps that all overflowed, the
    manifest says step 3, adam_step 0 and the scaler's state by hand (scale 2^20, one overflow left before the
    next back-off, no clean step); the resumed run backs off at step 3 as the whole run did, and from step 4
    on trains bit for bit the same (the moments and Adam's step start where an untouched optimizer's do)."""
    from pretrain.checkpoint.read import read_json
    whole = run_ranks(train_segment, 2, ALL_SKIPPED, tmp_path, 0, 7, (3,), timeout=300)
    assert whole[0]["loss_scale"] == [2.0 ** 30, 2.0 ** 20, 2.0 ** 20, 2.0 ** 10, 2.0 ** 10, 2.0 ** 10, 2.0 ** 10]
    manifest = read_json(tmp_path / "step_00000003" / "checkpoint.json")
    assert (manifest["step"], manifest["adam_step"]) == (3, 0)
    assert manifest["scaler"] == {"scale": 2.0 ** 20, "overflows_left": 1, "clean_steps": 0}
    out = run_ranks(train_segment, 2, ALL_SKIPPED, tmp_path, 3, 7, (), True, timeout=300)
    for r_whole, r_out in zip(whole, out):
        assert r_out["loss_scale"] == r_whole["loss_scale"][3:]
        assert r_out["loss"] == r_whole["loss"][3:]
        assert r_whole["loss"][-1] != r_whole["loss"][3]  # steps 4-6 did update the model
        for name, p in r_whole["params"].items():
            assert torch.equal(r_out["params"][name], p), name
