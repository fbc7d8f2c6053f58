"""ZeRO-R activation checkpoints (Pa, Pa+cpu, MD) against no recompute and megatron's own recompute."""
import math
from fractions import Fraction

import pytest
import torch
import torch.distributed as dist

import zero3d
from ranks import run_ranks
from gpt_harness import BASE, SyntheticTokens
from pretrain.config import load_config
from pretrain.model.gpt import activation_checkpointing, build_model, gpt_loss
from pretrain.runtime.layout import init_layout
from pretrain.step import mean_loss
from pretrain.train import Batches, engine_settings
from zero3d.activations import ActivationCheckpointing, checkpoint

SEED = 1234
DROPOUT = ["model.hidden_dropout=0.1", "model.attention_dropout=0.1"]
# name → (model.recompute, partition, cpu, contiguous); None flags = megatron's own path
MODES = {"none": ("none", None), "megatron": ("full", None), "pa": ("full", (True, False, False)),
         "pa_cpu": ("full", (True, True, False)), "pa_cpu_md": ("full", (True, True, True)),
         "md": ("full", (False, False, True))}
ZERO3D_MODES = [m for m, (_, flags) in MODES.items() if flags]


def mode_overrides(mode):
    recompute, flags = MODES[mode]
    out = [f"model.recompute={recompute}"]
    if flags:
        out += [f"zero.partition_activations={str(flags[0]).lower()}",
                f"zero.cpu_checkpointing={str(flags[1]).lower()}",
                f"zero.contiguous_checkpointing={str(flags[2]).lower()}"]
    return out


def build(overrides, topo):
    """Same weights and the same RNG stream for every mode; (cfg, model, ZeRO-R checkpoints or None)."""
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
    cfg = load_config(None, BASE + list(overrides))
    torch.manual_seed(SEED)
    model_parallel_cuda_manual_seed(SEED)
    acts = activation_checkpointing(cfg.zero, topo.tp_group)
    return cfg, build_model(cfg, topo.device, acts), acts


def grads_rank(rank, world_size, tp, extra, micro_batches):
    """Per mode: losses, parameter grads and checkpoint accounting of one step of `micro_batches`."""
    overrides = [f"parallel.tensor={tp}", *extra]
    topo = init_layout(load_config(None, BASE + overrides))
    out = {}
    for mode in MODES:
        cfg, model, acts = build(overrides + mode_overrides(mode), topo)
        batches = Batches(SyntheticTokens(cfg.model.vocab_size, cfg.model.seq_length), cfg.train, cfg.data, topo)
        if acts is not None:
            acts.reset_step()
        losses, after_forward = [], []
        for micro in range(micro_batches):
            loss = gpt_loss(model, batches.get(0, micro))
            if acts is not None:
                after_forward.append((acts.device_bytes, acts.host_bytes, acts.checkpoints))
            loss.backward()
            losses.append(loss.detach())
        out[mode] = {"loss": torch.stack(losses), "after_forward": after_forward,
                     "grads": {n: p.grad.clone() for n, p in model.named_parameters()},
                     "report": acts.report() if acts else None,
                     "comm": acts.comm_stats.report() if acts else None,
                     "live": (acts.device_bytes, acts.host_bytes, acts.checkpoints) if acts else None}
    b, s, h = cfg.train.micro_batch_size, cfg.model.seq_length, cfg.model.hidden_size
    out["shape"] = (cfg.model.num_layers, b * s * h)
    dist.barrier()
    return out


def assert_same(ref, out, what):
    torch.testing.assert_close(out["loss"], ref["loss"], rtol=1e-6, atol=0, msg=what)
    for name, g in ref["grads"].items():
        torch.testing.assert_close(out["grads"][name], g, rtol=1e-6, atol=1e-9, msg=f"{what}: {name}")


def check_accounting(out, tp, micro_batches):
    layers, bsh = out["shape"]
    stored = layers * math.ceil(bsh / tp) * 4  # fp32
    full = layers * bsh * 4
    gathered = Fraction(micro_batches * layers * math.ceil(bsh / tp) * tp * (tp - 1), tp)
    expect = {"pa": (stored, 0, gathered), "pa_cpu": (0, stored, gathered), "pa_cpu_md": (0, stored, gathered),
              "md": (full, 0, 0)}
    for mode, (dev, host, elements) in expect.items():
        r = out[mode]
        assert (r["report"]["act/ckpt_device_bytes"], r["report"]["act/ckpt_host_bytes"]) == (dev, host), mode
        assert r["after_forward"] == [(dev, host, layers)] * micro_batches, mode
        assert r["live"] == (0, 0, 0), mode  # all released after backward
        assert r["report"]["act/allgather_elements"] == elements, mode
        assert r["comm"].get("comm/all_gather/activations/elements", 0) == elements, mode
    assert out["pa_cpu_md"]["report"]["act/md_buffer_bytes"] == stored
    assert out["pa_cpu_md"]["report"]["act/md_allocations"] == 1
    assert out["md"]["report"]["act/md_buffer_bytes"] == full


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_grads_match_no_recompute_and_megatron_with_dropout(tp):
    results = run_ranks(grads_rank, tp, tp, DROPOUT + ["train.global_batch_size=4"], 2, timeout=120)
    for out in results:
        assert out["none"]["loss"][0] != out["none"]["loss"][1]
        assert_same(out["none"], out["megatron"], "megatron vs none")
        for mode in ZERO3D_MODES:
            assert_same(out["none"], out[mode], f"{mode} vs none")
            assert_same(out["megatron"], out[mode], f"{mode} vs megatron")
        check_accounting(out, tp, micro_batches=2)


def engine_rank(rank, world_size, tp, steps):
    """TP × DP=2 training with ZeRO stages 0-2: megatron recompute vs zero3d checkpoints per stage."""
    overrides = [f"parallel.tensor={tp}", "train.global_batch_size=8", *DROPOUT]  # micro 2 × DP 2 × accum 2
    topo = init_layout(load_config(None, BASE + overrides))
    runs = {}
    for stage, mode in [(0, "pa"), (1, "pa_cpu"), (2, "pa_cpu_md"), (2, "megatron"), (1, "megatron"),
                        (0, "megatron")]:
        cfg, model, acts = build(overrides + mode_overrides(mode) + [f"zero.stage={stage}"], topo)
        engine = zero3d.wrap_model(model, engine_settings(cfg),
                                   zero3d.ParallelGroups(dp_group=topo.dp_group, tp_rank=topo.tp_rank))
        if acts is not None:
            acts.record_into(engine.comm_stats)
        batches = Batches(SyntheticTokens(cfg.model.vocab_size, cfg.model.seq_length), cfg.train, cfg.data, topo)
        run = {"loss": [], "grad_norm": [], "act_comm": [], "dp_comm": [], "reports": [], "md_ptr": []}
        for step in range(steps):
            engine.comm_stats.reset()
            if acts is not None:
                acts.reset_step()
            losses = []
            for micro in range(topo.grad_accum):
                loss = gpt_loss(engine, batches.get(step, micro))
                engine.backward(loss / topo.grad_accum)
                losses.append(loss.detach())
            result = engine.step(cfg.optimizer.lr)
            run["loss"].append(mean_loss(losses, topo))
            run["grad_norm"].append(result.grad_norm)
            run["act_comm"].append(engine.comm_stats.report().get("comm/all_gather/activations/elements", 0))
            run["dp_comm"].append(engine.comm_stats.total(("grads", "params")))
            if acts is not None:
                run["reports"].append(acts.report())
                run["md_ptr"].append(acts.buffer.buffer.data_ptr() if acts.buffer else None)
        engine.finish_param_sync()  # stages 1/2 leave the last step's parameter all-gathers in flight
        run["params"] = {n: p.detach().clone() for n, p in model.named_parameters()}
        runs[(stage, mode)] = run
    layers, b, s, h = cfg.model.num_layers, cfg.train.micro_batch_size, cfg.model.seq_length, cfg.model.hidden_size
    dist.barrier()
    return {"runs": runs, "layers": layers, "bsh": b * s * h, "accum": topo.grad_accum}


def test_zero_stages_dp2_tp2_pa_cpu_md():
    tp, steps = 2, 3
    for out in run_ranks(engine_rank, 4, tp, steps, timeout=150):
        layers, bsh, accum, runs = out["layers"], out["bsh"], out["accum"], out["runs"]
        assert accum == 2
        per_step = Fraction(accum * layers * bsh * (tp - 1), tp)
        for stage, mode in [(0, "pa"), (1, "pa_cpu"), (2, "pa_cpu_md")]:
            ref, run = runs[(stage, "megatron")], runs[(stage, mode)]
            torch.testing.assert_close(torch.tensor(run["loss"]), torch.tensor(ref["loss"]), rtol=1e-6, atol=0)
            torch.testing.assert_close(torch.tensor(run["grad_norm"]), torch.tensor(ref["grad_norm"]),
                                       rtol=1e-6, atol=0)
            for name, p in ref["params"].items():
                torch.testing.assert_close(run["params"][name], p, rtol=1e-6, atol=1e-7, msg=name)
            assert run["act_comm"] == [per_step] * steps and ref["act_comm"] == [0] * steps
            assert run["dp_comm"] == ref["dp_comm"]  # Pa adds TP traffic only
            dev, host = (layers * bsh // tp * 4, 0) if mode == "pa" else (0, layers * bsh // tp * 4)
            for r in run["reports"]:
                assert (r["act/ckpt_device_bytes"], r["act/ckpt_host_bytes"]) == (dev, host)
        md = runs[(2, "pa_cpu_md")]
        assert len(set(md["md_ptr"])) == 1 and md["md_ptr"][0] is not None  # one buffer, every step
        assert [r["act/md_allocations"] for r in md["reports"]] == [1] * steps


def toy_rank(rank, world_size):
    """The checkpoint function on its own: odd-sized input (padding), TP group = world."""
    dist.init_process_group("gloo")
    group = dist.group.WORLD
    torch.manual_seed(0)
    w = torch.randn(5, 5, requires_grad=True)

    def layer(x, scale):
        return torch.nn.functional.dropout(torch.tanh(x @ w) * scale, p=0.3), None

    x0 = torch.randn(3, 1, 5)
    results = {}
    for name, flags in [("plain", None), ("pa", (True, False, False)), ("pa_cpu", (True, True, False)),
                        ("pa_md", (True, False, True)), ("pa_cpu_md", (True, True, True)),
                        ("md", (False, False, True))]:
        w.grad = None
        x = x0.clone().requires_grad_(True)
        torch.manual_seed(7)
        acts = ActivationCheckpointing(*flags, tp_group=group) if flags else None
        y, _ = checkpoint(layer, acts, x, torch.tensor(2.0)) if acts else layer(x, torch.tensor(2.0))
        stored = (acts.device_bytes, acts.host_bytes) if acts else None
        (y * torch.arange(15.0).view(3, 1, 5)).sum().backward()
        results[name] = dict(x_grad=x.grad.clone(), w_grad=w.grad.clone(), stored=stored,
                             report=acts.report() if acts else None)
        if acts:  # a graph dropped without backward releases its checkpoint
            with torch.no_grad():
                assert checkpoint(layer, acts, x, torch.tensor(1.0))[0].shape == x.shape
            assert acts.checkpoints == 0
            y, _ = checkpoint(layer, acts, x, torch.tensor(1.0))
            assert acts.checkpoints == 1
            del y
            assert (acts.checkpoints, acts.device_bytes, acts.host_bytes) == (0, 0, 0)
    return results


def test_checkpoint_function_padding_and_release():
    for out in run_ranks(toy_rank, 2, timeout=60):
        for name in ("pa", "pa_cpu", "pa_md", "pa_cpu_md", "md"):
            torch.testing.assert_close(out[name]["x_grad"], out["plain"]["x_grad"], rtol=1e-6, atol=0)
            torch.testing.assert_close(out[name]["w_grad"], out["plain"]["w_grad"], rtol=1e-6, atol=0)
        slice_bytes = 8 * 4  # ⌈15 / 2⌉ = 8 fp32 elements (one of padding on rank 1)
        assert out["pa"]["stored"] == out["pa_md"]["stored"] == (slice_bytes, 0)
        assert out["pa_cpu"]["stored"] == out["pa_cpu_md"]["stored"] == (0, slice_bytes)
        assert out["md"]["stored"] == (15 * 4, 0)
        for name in ("pa", "pa_cpu", "pa_md", "pa_cpu_md"):
            assert out[name]["report"]["act/allgather_elements"] == 8  # 16 gathered × (2−1)/2
        assert out["md"]["report"]["act/allgather_elements"] == 0


def test_zero_r_is_a_layer_class_in_the_spec_and_megatron_recompute_is_off():
    """ZeRO-R reaches megatron through its layer spec (no patch): every decoder layer is a
    ZeroRecomputeLayer holding the run's checkpoints, and megatron's own recomputation is off."""
    from pretrain.model.gpt import transformer_config
    cfg = load_config(None, BASE + mode_overrides("pa_cpu_md"))
    assert transformer_config(cfg, on_cuda=False).recompute_granularity == "full"
    assert transformer_config(cfg, on_cuda=False, zero_recompute=True).recompute_granularity is None
    for mode in ("md", "megatron"):
        out = run_ranks(spec_rank, 1, mode_overrides(mode), timeout=60)[0]
        if mode == "md":
            assert out == (["ZeroRecomputeLayer"] * 2, None, True)
        else:
            assert out == (["TransformerLayer"] * 2, "full", False)
    with pytest.raises(ValueError, match="partition"):
        ActivationCheckpointing(partition=False, cpu=True)


def spec_rank(rank, world_size, overrides):
    cfg = load_config(None, BASE + list(overrides))
    topo = init_layout(cfg)
    acts = activation_checkpointing(cfg.zero, topo.tp_group)
    model = build_model(cfg, topo.device, acts)
    classes = [type(layer).__name__ for layer in model.decoder.layers]
    held = acts is not None and all(layer.activations is acts for layer in model.decoder.layers)
    return classes, model.config.recompute_granularity, held
