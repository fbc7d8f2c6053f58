"""ZeRO-DP stage 3 (Pos+g+p) against stage 0 on a tiny megatron GPTModel, over Megatron TP and gloo DP."""
import functools
from fractions import Fraction

import pytest
import torch

from ranks import run_ranks
from gpt_harness import REFERENCE_STEPS, assert_bucket_layout, assert_close_runs, run_gpt_steps

LAYOUTS = [(1, 2), (1, 4), (2, 2), (2, 4)]  # (TP, DP)


def run(gpt_run, tp, dp, stage, extra=(), steps=REFERENCE_STEPS):
    """Cached: stage-0 references are shared between tests (and with test_zero.py's)."""
    overrides = [f"parallel.tensor={tp}", f"zero.stage={stage}", *extra]
    return gpt_run(tp * dp, overrides, steps)


@pytest.mark.parametrize("tp,dp", LAYOUTS)
def test_matches_stage0_fp32(tp, dp, gpt_run):
    extra = (f"train.global_batch_size={2 * dp}",)
    ref = run(gpt_run, tp, dp, 0, extra)
    assert sum(ref[0]["loss"][-3:]) < sum(ref[0]["loss"][:3])  # it trains
    assert_close_runs(ref, run(gpt_run, tp, dp, 3, extra), rtol=1e-5)


@pytest.mark.parametrize("tp,dp", [(1, 2), (2, 2)])
def test_gradient_accumulation_matches_stage0(tp, dp, gpt_run):
    extra = (f"train.global_batch_size={4 * dp}",)  # micro 2 × DP × 2 micro-batches
    assert_close_runs(run(gpt_run, tp, dp, 0, extra), run(gpt_run, tp, dp, 3, extra), rtol=1e-5)


@pytest.mark.parametrize("tp,dp", [(1, 2), (2, 2)])
def test_full_recompute_matches_stage0(tp, dp, gpt_run):
    """megatron's CheckpointFunction re-runs each layer inside backward: the unit stays gathered."""
    extra = (f"train.global_batch_size={2 * dp}",)
    out = run(gpt_run, tp, dp, 3, extra + ("model.recompute=full",))
    assert_close_runs(run(gpt_run, tp, dp, 0, extra), out, rtol=1e-5)
    plain = run(gpt_run, tp, dp, 3, extra)  # the recompute's gather is the backward gather: same volume
    assert volumes(out[0]["comm"]) == volumes(plain[0]["comm"])


def volumes(comm_reports):
    """The per-step elements, bytes and calls of each collective (timings left out)."""
    return [{k: v for k, v in report.items() if not k.startswith("comm/time/")} for report in comm_reports]


def test_tied_embeddings_match_stage0(gpt_run):
    extra = ("model.tie_embeddings=true", "train.global_batch_size=4")  # 4 steps: the shared weight's grads differ from step 1
    assert_close_runs(run(gpt_run, 2, 2, 0, extra, 4), run(gpt_run, 2, 2, 3, extra, 4), rtol=1e-5)
    extra += ("model.recompute=full", "zero.prefetch_units=3")
    assert_close_runs(run(gpt_run, 2, 2, 0, extra, 4), run(gpt_run, 2, 2, 3, extra, 4), rtol=1e-5)


def test_bf16_matches_stage0(gpt_run):
    extra = ("precision.dtype=bf16", "train.global_batch_size=8")
    # Stage 3 accumulates bf16 gradient shards per bucket, like stage 2.
    assert_close_runs(run(gpt_run, 2, 2, 0, extra), run(gpt_run, 2, 2, 3, extra), rtol=2e-2)


def test_persistent_params_match_stage0(gpt_run):
    extra = ("train.global_batch_size=4", "zero.param_persistence_threshold=128")
    assert_close_runs(run(gpt_run, 2, 2, 0, extra), run(gpt_run, 2, 2, 3, extra), rtol=1e-5)


def test_fp16_overflow_on_one_rank_skips_everywhere():
    extra = ["precision.dtype=fp16", "precision.hysteresis=1", "precision.initial_loss_scale=1024",
             "train.global_batch_size=4", "parallel.tensor=1", "zero.stage=3"]
    out = run_ranks(run_gpt_steps, 2, extra, 4, (1, 1), timeout=300)  # step 1, rank 1 only
    for rank_out in out:
        assert rank_out["skipped"] == [False, True, False, False]
        checks = rank_out["param_checksum"]
        assert checks[1] == checks[0] and checks[2] != checks[1]
    assert out[0]["param_checksum"] == out[1]["param_checksum"]


# ---------------------------------------------------------------- layouts, bytes, comm, memory


def _probe(rank, world, overrides, steps):
    """A few stage-3 steps, then an eval forward; what the layouts, memory and comm looked like."""
    import zero3d
    from gpt_harness import BASE, SyntheticTokens, named_numels, raw_bucket_numels
    from pretrain.config import load_config
    from pretrain.model.gpt import build_model, gpt_loss
    from pretrain.runtime.layout import init_layout
    from pretrain.train import Batches, engine_settings
    cfg = load_config(None, BASE + ["zero.stage=3", *overrides])
    topo = init_layout(cfg)
    model = build_model(cfg, topo.device)
    psi, param_numels = sum(p.numel() for p in model.parameters()), named_numels(model)
    engine = zero3d.wrap_model(model, engine_settings(cfg), zero3d.ParallelGroups(topo.dp_group, topo.tp_rank))
    sharded = [p for u in engine.units for g in u.groups for p in g.params]
    released = lambda: all(p.numel() == 0 for p in sharded) and engine._live == 0  # noqa: E731
    batches = Batches(SyntheticTokens(cfg.model.vocab_size, cfg.model.seq_length), cfg.train, cfg.data, topo)
    out = {"comm": [], "released": [released()]}
    for step in range(steps):
        engine.comm_stats.reset()
        for micro in range(topo.grad_accum):
            engine.backward(gpt_loss(engine, batches.get(step, micro)) / topo.grad_accum)
        engine.step(cfg.optimizer.lr)
        out["comm"].append({k: v for k, v in engine.comm_stats.elements.items()})
        out.setdefault("calls", []).append(dict(engine.comm_stats.calls))
        out["released"].append(released())
    engine.comm_stats.reset()
    tokens = batches.get(steps, 0)
    engine.eval()
    with torch.no_grad():
        out["eval_loss"] = gpt_loss(engine, tokens).item()
    engine.train()
    out["eval_comm"] = dict(engine.comm_stats.elements)
    out["released"].append(released())
    out["train_mode_loss"] = gpt_loss(engine, tokens).item()  # grad on, never back-propagated
    out["released"].append(released())
    out["groups"] = {name: (g.layout.padded_numel, g.layout.shard_numel) for name, g in engine.groups.items()}
    out["buckets"] = {name: len(g.layout.buckets) for name, g in engine.groups.items()}
    out["padded_numels"] = {name: g.layout.padded_numel for name, g in engine.groups.items()}
    out["bucket_numels"], out["param_numels"] = raw_bucket_numels(engine), param_numels
    out["entries"] = [u.entry_numel for u in engine.units]
    out["state_bytes"] = engine.state_bytes()
    out["peak"], out["budget"] = engine.peak_gathered_elements, engine.live_budget_elements
    out["psi"] = psi
    return out


@functools.lru_cache(maxsize=None)
def probe(tp, dp, extra=(), steps=2):
    return run_ranks(_probe, tp * dp, [f"parallel.tensor={tp}", f"train.global_batch_size={2 * dp}", *extra],
                     steps, timeout=300)


def split(groups):
    sharded = {n: v for n, v in groups.items() if not n.startswith("persistent/")}
    return sharded, {n: v for n, v in groups.items() if n.startswith("persistent/")}


@pytest.mark.parametrize("threshold", [0, 128])
def test_model_state_bytes_bf16(threshold):
    """16Ψ/N_d: 2 (params) + 2 (grads) + 4 (master) + 8 (Adam) bytes per element of each padded shard;
    persistent parameters keep all 16 bytes per element of their (padded) groups on every rank."""
    dp = 2
    for r in probe(2, dp, ("precision.dtype=bf16", f"zero.param_persistence_threshold={threshold}")):
        # one group per (gather unit, decay class), its buckets by flat.py's rule, each padded to N_d
        psi_padded = assert_bucket_layout(r, 3, dp, threshold=threshold)
        sharded, persistent = split(r["groups"])
        shard = sum(s for _, s in sharded.values())
        whole = sum(n for n, _ in persistent.values())
        assert (whole > 0) == (threshold > 0)
        assert r["state_bytes"] == dict(params=2 * shard, grads=2 * shard, master_params=4 * shard,
                                        optimizer_states=8 * shard, persistent_params=2 * whole,
                                        persistent_grads=2 * whole, persistent_master_params=4 * whole,
                                        persistent_optimizer_states=8 * whole)
        # the paper's 16Ψ/N_d on the sharded groups' padded Ψ (at threshold 0: all of it), exactly, plus 16 bytes
        # an element of the persistent groups' (padded) buffers
        kept = sum(padded for name, padded in r["padded_numels"].items() if name.startswith("persistent/"))
        assert sum(r["state_bytes"].values()) == 16 * (psi_padded - kept) // dp + 16 * kept


@pytest.mark.parametrize("tp,dp,threshold", [(1, 4, 0), (2, 2, 0), (2, 2, 128)])
def test_communication_volume(tp, dp, threshold):
    """Per rank per step: 3Ψ(N_d−1)/N_d — forward gather, backward gather, gradient reduce — over the
    padded unit buffers; persistent parameters are all-reduced (2·(N_d−1)/N_d) and never gathered."""
    for r in probe(tp, dp, (f"zero.param_persistence_threshold={threshold}",)):
        sharded, persistent = split(r["groups"])
        psi = Fraction(sum(n for n, _ in sharded.values()) * (dp - 1), dp)
        kept = Fraction(sum(n for n, _ in persistent.values()) * (dp - 1), dp)
        for comm in r["comm"]:
            assert {k: v for k, v in comm.items() if k[1] != "grad_norm"} == {
                ("all_gather", "params"): psi, ("all_gather", "params_bwd"): psi, ("reduce_scatter", "grads"): psi,
                **({("all_reduce", "grads"): 2 * kept} if kept else {})}
        assert {tag for _, tag in r["eval_comm"]} == {"params_eval"}  # not counted as training traffic
        assert r["eval_comm"][("all_gather", "params_eval")] == psi


def test_one_collective_per_bucket():
    """Per step: one all-gather per bucket forward, one backward, one reduce-scatter per bucket;
    persistent groups one all-reduce per bucket."""
    for r in probe(2, 2, ("zero.param_persistence_threshold=128",)):
        sharded, persistent = split(r["buckets"])
        assert sum(sharded.values()) > len(sharded)  # several buckets in some unit
        for calls in r["calls"]:
            buckets = sum(sharded.values())
            assert {k: v for k, v in calls.items() if k[1] != "grad_norm"} == {
                ("all_gather", "params"): buckets, ("all_gather", "params_bwd"): buckets,
                ("reduce_scatter", "grads"): buckets, ("all_reduce", "grads"): sum(persistent.values())}


@pytest.mark.parametrize("prefetch", [0, 1, 2])
def test_gathered_elements_within_budget(prefetch):
    """The unit running plus `prefetch` ahead: the peak is the largest window of 1 + prefetch
    consecutive units (GPT runs its units in definition order), within (1 + prefetch) × largest."""
    for r in probe(2, 2, (f"zero.prefetch_units={prefetch}",)):
        entries = r["entries"]
        assert r["budget"] == (1 + prefetch) * max(entries)
        assert r["peak"] == max(sum(entries[i:i + 1 + prefetch]) for i in range(len(entries)))
        assert r["peak"] <= r["budget"] and r["peak"] < sum(entries)


def test_eval_under_no_grad_gathers_and_releases():
    for r in probe(2, 2, ("model.tie_embeddings=true",)):
        assert all(r["released"])  # after construction, every step, eval and an un-back-propagated forward
        assert r["eval_loss"] == r["train_mode_loss"]  # dropout is 0: the same function either way


# ---------------------------------------------------------------- any nn.Module


def _generic(rank, world, stage):
    import torch.distributed as dist
    import torch.nn as nn

    import zero3d
    dist.init_process_group("gloo", rank=rank, world_size=world)

    class Net(nn.Module):  # defined in an order different from the order it runs in
        def __init__(self):
            super().__init__()
            self.head = nn.Linear(8, 8)
            self.body = nn.Sequential(nn.Linear(8, 8), nn.Tanh())
            self.body[0].weight = self.head.weight  # tied: body borrows head's weight, and runs first
            self.tail = nn.Linear(8, 4)
            self.scale = nn.Parameter(torch.ones(8))

        def forward(self, x):
            return self.tail(self.head(self.body(x * self.scale)))

    torch.manual_seed(0)
    model = Net()
    settings = zero3d.EngineSettings(zero=zero3d.ZeroConfig(stage=stage, bucket_elements=64),
                                     optimizer=zero3d.OptimizerConfig(clip_grad=0.5))
    engine = zero3d.wrap_model(model, settings,
                               zero3d.ParallelGroups(dp_group=None))
    g = torch.Generator().manual_seed(1 + rank)
    losses = []
    for _ in range(4):
        x, y = torch.randn(4, 8, generator=g), torch.randn(4, 4, generator=g)
        loss = (engine(x) - y).pow(2).mean()
        engine.backward(loss)
        losses.append(engine.step(1e-2).grad_norm)
    engine.finish_param_sync()  # stage 0 has nothing in flight; kept for the same reading rule
    params = engine.gathered_parameters() if stage == 3 else dict(model.named_parameters())
    order = ([(engine.units[i].name, [b.name for b in engine.units[i].borrows]) for i in engine._order]
             if stage == 3 else None)
    return losses, {n: p.detach().clone() for n, p in params.items()}, order


def test_generic_module_units_follow_recorded_order():
    ref, out = run_ranks(_generic, 2, 0), run_ranks(_generic, 2, 3)
    for (norms0, params0, _), (norms3, params3, order) in zip(ref, out):
        torch.testing.assert_close(torch.tensor(norms3), torch.tensor(norms0), rtol=1e-5, atol=0)
        assert params3.keys() == params0.keys()
        for name in params0:
            torch.testing.assert_close(params3[name], params0[name], rtol=1e-5, atol=1e-6)
        # execution order, not definition order; the tied weight belongs to the module defined first
        assert order == [("<root>", []), ("body", ["head"]), ("head", []), ("tail", [])]
