"""Shared body of the checkpoint tests: train a segment of steps, optionally resuming and saving."""
import torch
import torch.distributed as dist

import zero3d
from gpt_harness import BASE, SyntheticTokens, init_by_global_name
from pretrain.checkpoint.checkpointer import Checkpointer, architecture_identity, layout_signature
from pretrain.config import load_config
from pretrain.model.gpt import build_model, parallel_groups
from pretrain.runtime.layout import destroy_layout, destroy_model_parallel_groups, init_layout
from pretrain.step import forward_backward, mean_loss
from pretrain.train import Batches, engine_settings

# 12 samples a step divide into every DP size used (1, 2, 3); vocabulary padded to 128 at TP 1 and 2.
CKPT_BASE = BASE + ["train.global_batch_size=12", "model.make_vocab_size_divisible_by=64"]


def synthetic_identity(cfg, tokenizer_sha256="synthetic") -> dict:
    m = cfg.model
    return {"model": {"num_layers": m.num_layers, "hidden_size": m.hidden_size,
                      "num_attention_heads": m.num_attention_heads, "ffn_hidden_size": m.ffn_size,
                      "seq_length": m.seq_length, "tie_embeddings": m.tie_embeddings,
                      "padded_vocab_size": m.padded_vocab_size(cfg.parallel.tensor), **architecture_identity(m)},
            "vocab_size": m.vocab_size, "data_prefix": "synthetic", "tokenizer_sha256": tokenizer_sha256}


def train_segment(rank, world_size, overrides, save_dir, first, last, save_at=(), resume=False,
                  keep=0, async_save=True, identity_overrides=None, kill_rank_after_save=None, max_failed_saves=3,
                  around_save=None, seed_for_rng=None, layout_free_init=False, keep_world=False):
    """Steps [first, last) with losses; resume from save_dir first, save after the steps in save_at
    (around_save(rank, step, "before" | "after", checkpointer) runs on every rank around each save);
    with `seed_for_rng`, also the generators start-up would make from that seed (out["seeded"]); with
    `layout_free_init`, the weights gpt_harness.init_by_global_name draws (the same at any layout); `keep_world`: the
    process group kept at the end (megatron's groups ended), for another segment in the same ranks."""
    import os
    import signal
    cfg = load_config(None, CKPT_BASE + list(overrides))
    topo = init_layout(cfg)
    try:
        model = build_model(cfg, topo.device)
        if layout_free_init:
            init_by_global_name(model)
        psi = sum(p.numel() for p in model.parameters())  # before stage 3 frees them
        engine = zero3d.wrap_model(model, engine_settings(cfg), parallel_groups(model, topo))
        batches = Batches(SyntheticTokens(cfg.model.vocab_size, cfg.model.seq_length), cfg.train, cfg.data, topo)
        identity = {**synthetic_identity(cfg), **(identity_overrides or {})}
        layout = layout_signature(cfg, topo)
        ckpt = Checkpointer(save_dir, model, engine, keep=keep, async_save=async_save,
                            max_failed_saves=max_failed_saves)
        out = {"loss": [], "notes": [], "reports": [], "loss_scale": [], "saved_params": {}, "psi": psi}
        if resume:
            resumed = ckpt.load_latest(identity, layout, cfg.train.seed)
            out["resumed"] = None if resumed is None else {k: v for k, v in resumed.items() if k != "path"}
            out["notes"] = resumed["notes"] if resumed else []
            out["rng_at_resume"] = rng_snapshot()
            out["params_at_resume"] = {n: p.detach().clone() for n, p in full_params(engine).items()}
        for step in range(first, last):
            losses = forward_backward(engine, batches, step, cfg, topo)
            result = engine.step(cfg.optimizer.lr)
            out["loss"].append(mean_loss(losses, topo))
            out["loss_scale"].append(result.loss_scale)
            if step + 1 in save_at:
                out["saved_params"][step + 1] = {n: p.detach().clone() for n, p in full_params(engine).items()}
                if around_save:
                    around_save(rank, step + 1, "before", ckpt)
                ckpt.save(step + 1, {"layout": layout, "identity": identity, "config": cfg.to_dict(),
                                     "consumed_samples": (step + 1) * cfg.train.global_batch_size})
                if kill_rank_after_save == (step + 1, rank):
                    os.kill(os.getpid(), signal.SIGKILL)
                if around_save:
                    around_save(rank, step + 1, "after", ckpt)
                out["reports"].append(ckpt.report())
        ckpt.close()
        if save_at:
            out["reports"].append(ckpt.report())
        out["params"] = {n: p.detach().clone() for n, p in full_params(engine).items()}
        out["tp_dims"], out["global_names"] = tp_dims_and_global_names(model)
        out["tp_rank"], out["pp_rank"], out["dp_rank"] = topo.tp_rank, topo.pp_rank, topo.dp_rank
        if seed_for_rng is not None:
            out["seeded"] = seeded_rng_snapshot(seed_for_rng)
        dist.barrier()
        return out
    finally:
        destroy_model_parallel_groups() if keep_world else destroy_layout()


def rng_snapshot() -> dict:
    """This rank's CPU generator and megatron's tracker states, as tensors (for comparing)."""
    from megatron.core.tensor_parallel import get_cuda_rng_tracker
    return {"cpu": torch.get_rng_state(), **{k: v.clone() for k, v in get_cuda_rng_tracker().get_states().items()}}


def seeded_rng_snapshot(seed: int) -> dict:
    """The generators as start-up seeds them from `seed` (torch, then megatron's TP-rank offsets)."""
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
    torch.manual_seed(seed)
    model_parallel_cuda_manual_seed(seed)
    return rng_snapshot()


def full_params(engine):
    gather = getattr(engine, "gathered_parameters", None)
    engine.finish_param_sync()  # stages 1/2 leave the last step's parameter all-gathers in flight
    return gather() if gather else dict(engine.model.named_parameters())


def tp_dims_and_global_names(model) -> tuple[dict, dict]:
    """{name: dim it is split over TP ranks, or None}, {name: name in a PP 1 model (global layer)}."""
    import re
    dims = {n: (p.partition_dim if getattr(p, "tensor_model_parallel", False) else None)
            for n, p in model.named_parameters()}
    names = {}
    for n in dims:
        if (m := re.match(r"decoder\.layers\.(\d+)\.(.*)", n)):
            n_global = f"decoder.layers.{model.decoder.layers[int(m[1])].layer_number - 1}.{m[2]}"
        else:
            n_global = n
        names[n] = n_global
    return dims, names
