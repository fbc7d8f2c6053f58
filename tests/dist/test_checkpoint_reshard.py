"""A checkpoint written at TP 2 × DP 2, stage 2 resumes at other layouts and stages; each element once."""
import math

import pytest
import torch

from checkpoint_harness import train_segment
from pretrain.checkpoint.read import read_json
from pretrain.checkpoint.read import read_dcp_metadata
from ranks import run_ranks

SAVED = ["parallel.tensor=2", "zero.stage=2"]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """10 steps at TP 2 × DP 2 (4 ranks), stage 2, saving after step 5."""
    save_dir = tmp_path_factory.mktemp("ckpt")
    ranks = run_ranks(train_segment, 4, SAVED, save_dir, 0, 10, (5,), timeout=300)
    return save_dir, ranks[0]["loss"]


@pytest.mark.parametrize("world,layout", [
    (3, ["parallel.tensor=1", "zero.stage=3"]),  # (a) TP 1 × DP 3, stage 3
    (2, ["parallel.tensor=2", "zero.stage=1"]),  # (b) TP 2 × DP 1, stage 1
    (4, ["parallel.tensor=1", "parallel.pipeline=2", "zero.stage=1"]),  # (c) PP 2 × DP 2, stage 1
], ids=["tp1_dp3_stage3", "tp2_dp1_stage1", "pp2_dp2_stage1"])
def test_resume_at_another_layout_continues_the_run(uninterrupted, world, layout):
    save_dir, expected = uninterrupted
    ranks = run_ranks(train_segment, world, layout, save_dir, 5, 10, (), True, timeout=300)
    assert ranks[0]["resumed"]["step"] == 5 and ranks[0]["resumed"]["consumed_samples"] == 5 * 12
    # Another TP size sums in another order: equal to 1e-6 relative, not bitwise.
    torch.testing.assert_close(torch.tensor(ranks[0]["loss"]), torch.tensor(expected[5:]), rtol=1e-6, atol=0)
    assert any(note.startswith("RNG states re-derived from seed 1234 + step 5") for note in ranks[0]["notes"])


def test_resume_at_the_same_layout_is_bitwise(uninterrupted):
    save_dir, expected = uninterrupted
    ranks = run_ranks(train_segment, 4, SAVED, save_dir, 5, 10, (), True, timeout=300)
    assert ranks[0]["loss"] == expected[5:]
    assert ranks[0]["notes"] == []  # each rank's own RNG state restored


def _payload_and_items(step_dir):
    """(bytes of tensor elements, number of stored items) from DCP's metadata."""
    md = read_dcp_metadata(step_dir)
    payload = sum(math.prod(chunk.sizes) * torch.empty((), dtype=meta.properties.dtype).element_size()
                  for meta in md.state_dict_metadata.values() for chunk in meta.chunks)
    return payload, len(md.storage_data), md


@pytest.mark.parametrize("stage,dtype,param_bytes", [(1, "fp32", 4), (3, "bf16", 2)])
def test_bytes_written_do_not_grow_with_dp(tmp_path, stage, dtype, param_bytes):
    """Each element is written by one rank: at DP 4 the tensors hold exactly the bytes they hold at DP 1,
    param_bytes·Ψ (model dtype) + 12Ψ (fp32 master, 2 Adam moments), Ψ counted on the model itself;
    on disk only per-item headers come on top."""
    results = {}
    for dp in (1, 4):
        save_dir = tmp_path / f"dp{dp}"
        overrides = [f"zero.stage={stage}", f"precision.dtype={dtype}", "train.global_batch_size=8"]
        ranks = run_ranks(train_segment, dp, overrides, save_dir, 0, 1, (1,), timeout=300)
        step_dir = save_dir / "step_00000001"
        payload, items, md = _payload_and_items(step_dir)
        manifest = read_json(step_dir / "checkpoint.json")
        on_disk = sum(rec["bytes"] for rec in manifest["files"].values())
        assert ranks[0]["reports"][-1]["ckpt/bytes"] == on_disk + (step_dir / "checkpoint.json").stat().st_size
        distcp = sum(f.stat().st_size for f in step_dir.iterdir() if f.suffix == ".distcp")
        results[dp] = (payload, items, distcp, ranks[0]["psi"])
    (p1, i1, d1, psi), (p4, i4, d4, psi4) = results[1], results[4]
    assert psi == psi4 and p1 == p4 == (param_bytes + 12) * psi
    # What is not tensor bytes is per-item container overhead (torch.save zip records), under 4 KiB each.
    assert 0 <= d4 - p4 < 4096 * i4 and 0 <= d1 - p1 < 4096 * i1
