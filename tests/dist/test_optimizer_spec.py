"""OptimizerSpec: a checkpoint of the code before it resumes; an SGD spec, defined here alone, trains and resumes
(the named optimizers against their published rules: test_optimizers.py)."""
import json
import shutil
from pathlib import Path

import pytest
import torch

import checkpoint_harness
from checkpoint_harness import CKPT_BASE, train_segment
from gpt_harness import SyntheticTokens, Unwrapped
from pretrain.checkpoint.read import read_json
from ranks import run_ranks
from optim import OptimizerSpec

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "adamw_dp2_stage2"

# ------------------------------------------------------------ a second optimizer, here only

MOMENTUM = 0.9
SGD_STATES = ("momentum_buffer",)  # torch.optim.SGD's own name for it


def sgd_update(params, grads, states, steps, lr, weight_decay, hyper, fused):
    """torch's functional single-tensor SGD with momentum over the lists; a zero buffer updates as torch's first step
    (buffer = grad). The step count, hyper and fused are not read."""
    from torch.optim.sgd import sgd
    sgd(params, grads, states["momentum_buffer"], weight_decay=weight_decay, momentum=MOMENTUM, lr=lr,
        dampening=0.0, nesterov=False, maximize=False, foreach=False)


SGD = OptimizerSpec(name="sgd_momentum", hyper=None, states=SGD_STATES, update=sgd_update)

# lr 1: steps large enough that a wrong momentum moves the loss by 1e-3 or more; weight decay 0.1, clip 1.0
SGD_RUN = ["model.num_layers=1", "optimizer.lr=1.0", "optimizer.min_lr=1.0"]


def sgd_segment(rank, world_size, *args):
    """train_segment with the engine built over SGD (the harness's settings, the spec added, in this rank only)."""
    base = checkpoint_harness.engine_settings
    checkpoint_harness.engine_settings = lambda cfg: base(cfg, optimizer_spec=SGD)
    return train_segment(rank, world_size, *args)


def plain_sgd(rank, world_size, overrides, steps):
    """The independent expectation: one process, no zero3d, torch.optim.SGD over the model's own parameters
    (matrices decay), the gradient clipped by the engine's rule (coefficient 1 / (norm + 1e-6) below 1)."""
    from pretrain.config import load_config
    from pretrain.model.gpt import build_model
    from pretrain.runtime.layout import destroy_layout, init_layout
    from pretrain.step import forward_backward, mean_loss
    from pretrain.train import Batches
    cfg = load_config(None, CKPT_BASE + list(overrides))
    topo = init_layout(cfg)
    try:
        model = build_model(cfg, topo.device)
        params = list(model.parameters())
        decay = cfg.optimizer.weight_decay
        opt = torch.optim.SGD([{"params": [p for p in params if p.dim() > 1], "weight_decay": decay},
                               {"params": [p for p in params if p.dim() <= 1], "weight_decay": 0.0}],
                              lr=cfg.optimizer.lr, momentum=MOMENTUM, foreach=False)
        batches = Batches(SyntheticTokens(cfg.model.vocab_size, cfg.model.seq_length), cfg.train, cfg.data, topo)
        losses = []
        for step in range(steps):
            losses.append(mean_loss(forward_backward(Unwrapped(model), batches, step, cfg, topo), topo))
            norm = sum(p.grad.double().pow(2).sum() for p in params).sqrt().item()
            coef = cfg.optimizer.clip_grad / (norm + 1e-6)
            if coef < 1.0:
                for p in params:
                    p.grad.mul_(coef)
            opt.step()
            opt.zero_grad()
        return losses
    finally:
        destroy_layout()


def test_sgd_spec_trains_offloads_and_resumes_at_another_layout(tmp_path):
    """SGD (one state) through every seam: stage 2 × DP 2 with the cpu offload saves after step 3; the
    checkpoint holds optim/momentum_buffer/ and no Adam state; stage 3 × DP 1 resumes it; stage 1 × DP 2
    on the device trains too. Each run's losses equal plain torch SGD's to 1e-6 relative (fp32: the DP sum
    and the fp64 norm round apart from the single process by ulps, not more)."""
    expected = torch.tensor(run_ranks(plain_sgd, 1, SGD_RUN, 6, timeout=300)[0])
    assert (expected - expected[0]).abs().max() > 0.05  # the updates are not negligible
    saved = run_ranks(sgd_segment, 2, SGD_RUN + ["zero.stage=2", 'zero.offload_optimizer="cpu"'],
                      tmp_path, 0, 6, (3,), False, timeout=300)
    resumed = run_ranks(sgd_segment, 1, SGD_RUN + ["zero.stage=3"], tmp_path, 3, 6, (), True, timeout=300)
    stage1 = run_ranks(sgd_segment, 2, SGD_RUN + ["zero.stage=1"], tmp_path / "s1", 0, 6, timeout=300)
    for run, first in ((saved, 0), (resumed, 3), (stage1, 0)):
        torch.testing.assert_close(torch.tensor(run[0]["loss"]), expected[first:], rtol=1e-6, atol=0)
    manifest = read_json(tmp_path / "step_00000003" / "checkpoint.json")
    assert (manifest["optimizer"], manifest["optimizer_step"]) == ("sgd_momentum", 3) and "adam_step" not in manifest
    keys = json.dumps(list(_dcp_keys(tmp_path / "step_00000003")))
    assert "optim/momentum_buffer/" in keys and "optim/master/" in keys and "exp_avg" not in keys
    # Its manifest edited to claim AdamW: AdamW refuses it for the states its shards lack, before loading any.
    claimed = tmp_path / "claimed"
    shutil.copytree(tmp_path / "step_00000003", claimed / "step_00000003")
    (claimed / "latest").write_text("step_00000003")
    manifest["optimizer"] = "adamw"
    (claimed / "step_00000003" / "checkpoint.json").write_text(json.dumps(manifest))
    with pytest.raises(RuntimeError, match=r"holds no optim/exp_avg/, optim/exp_avg_sq/ tensors; this run's adamw "
                                           r"optimizer resumes from master, exp_avg, exp_avg_sq; the checkpoint "
                                           r"holds master, momentum_buffer"):
        run_ranks(train_segment, 1, SGD_RUN, claimed, 3, 4, (), True, timeout=300)


def _dcp_keys(step_dir):
    from pretrain.checkpoint.read import read_dcp_metadata
    return read_dcp_metadata(step_dir).state_dict_metadata.keys()


# ------------------------------------------------------------ a checkpoint of the code before the spec

@pytest.mark.parametrize("world,layout,rtol", [
    (2, ["zero.stage=2"], 0.0),  # the layout that wrote it: bit for bit
    (1, ["zero.stage=3"], 1e-6),  # DP 1 sums the micro-batches in another order: equal to 1e-6 relative
], ids=["dp2_stage2", "dp1_stage3"])
def test_checkpoint_from_before_the_spec_resumes(tmp_path, world, layout, rtol):
    """tests/fixtures/adamw_dp2_stage2 was written by commit 6869690 (manifest `adam_step`, no `optimizer`):
    resumed by this code, steps 3-5 lose what that code's uninterrupted run lost (expected.json); Adam's bias
    correction depends on the count, so the losses also say adam_step was read — and the next save
    records it grown by one under both keys."""
    expected = json.loads((FIXTURE / "expected.json").read_text())
    shutil.copytree(FIXTURE / "step_00000003", tmp_path / "step_00000003")
    (tmp_path / "latest").write_text("step_00000003")
    assert "optimizer_step" not in read_json(tmp_path / "step_00000003" / "checkpoint.json")
    overrides = [o for o in expected["overrides"] if not o.startswith("zero.stage")] + layout
    ranks = run_ranks(train_segment, world, overrides, tmp_path, 3, 6, (4,), True, timeout=300)
    assert ranks[0]["resumed"]["step"] == 3
    torch.testing.assert_close(torch.tensor(ranks[0]["loss"]), torch.tensor(expected["losses_after"]),
                               rtol=rtol, atol=0)
    manifest = read_json(tmp_path / "step_00000004" / "checkpoint.json")
    assert (manifest["optimizer"], manifest["optimizer_step"], manifest["adam_step"]) == ("adamw", 4, 4)
