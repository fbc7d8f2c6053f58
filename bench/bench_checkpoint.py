"""Checkpoint save: how long the training step stalls and how long the write takes, sync vs async.

    python bench/bench_checkpoint.py [--world 1] [--stage 2] [--repeats 2]
                                     [--large-layers 12] [--large-hidden 1024] [--dir /tmp/...]

Two models on `world` forked CPU ranks (gloo): "tiny" (configs/tiny.toml's shape: 4 layers, hidden
128) and "large" (--large-layers × --large-hidden; the issue asks for ~1B parameters, which with
fp32 Adam states and the staging copy needs ~32 GB: pass --large-layers 24 --large-hidden 1856 on a
machine that has it). Each model takes one training step, then saves `repeats` times in each mode:

    sync   the step waits for the whole write (train.async_save = false)
    async  the step waits for the previous save and the host copy; the write runs in a thread

stall = time save() blocked the loop (ckpt/stall_s); write = the writer's time for DCP save, fsync
and SHA-256 (ckpt/write_s); medians over repeats, rank 0. The stall ratio is async / sync.
"""
import argparse
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # local_ranks

import torch  # noqa: E402


def bench_rank(rank, world_size, args, layers, hidden, save_root):
    import torch.distributed as dist

    import zero3d
    from pretrain.checkpoint.checkpointer import Checkpointer, layout_signature
    from pretrain.config import load_config
    from pretrain.model.gpt import build_model, gpt_loss, parallel_groups
    from pretrain.runtime.layout import destroy_layout, init_layout
    from pretrain.train import engine_settings

    cfg = load_config(None, [f"model.num_layers={layers}", f"model.hidden_size={hidden}",
                             "model.num_attention_heads=8", "model.seq_length=64", "model.vocab_size=1024",
                             "train.micro_batch_size=1", f"train.global_batch_size={world_size}",
                             f"zero.stage={args.stage}", "optimizer.warmup_steps=0", "logging.wandb=false"])
    topo = init_layout(cfg)
    try:
        model = build_model(cfg, topo.device)
        psi = sum(p.numel() for p in model.parameters())  # TP 1: the whole model (before stage 3 frees it)
        engine = zero3d.wrap_model(model, engine_settings(cfg), parallel_groups(model, topo))
        tokens = torch.randint(0, 1024, (1, 65), generator=torch.Generator().manual_seed(rank))
        engine.backward(gpt_loss(engine, tokens))
        engine.step(1e-4)  # Adam's moments exist, as in training
        meta = {"layout": layout_signature(cfg, topo), "identity": {}, "config": cfg.to_dict(), "consumed_samples": 0}
        rows = []
        for mode in ("sync", "async"):
            ckpt = Checkpointer(Path(save_root) / mode, model, engine, keep=1, async_save=mode == "async")
            stalls, writes = [], []
            for i in range(args.repeats):
                dist.barrier()
                ckpt.save(i + 1, meta)
                stalls.append(ckpt.report()["ckpt/stall_s"])
                ckpt.wait()  # the next save (or exit) would wait here; measured separately as write_s
                writes.append(ckpt.report()["ckpt/write_s"])
            rows.append({"mode": mode, "stall_s": statistics.median(stalls), "write_s": statistics.median(writes),
                         "bytes": ckpt.report()["ckpt/bytes"]})
        return {"rows": rows, "psi": psi}
    finally:
        destroy_layout()


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world", type=int, default=1, help="CPU ranks (DP size)")
    parser.add_argument("--stage", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--large-layers", type=int, default=12)
    parser.add_argument("--large-hidden", type=int, default=1024)
    parser.add_argument("--dir", type=Path, default=None, help="where to write (default: a temporary directory)")
    args = parser.parse_args(argv)
    from local_ranks import run_ranks
    import megatron.core.models.gpt  # noqa: F401 - forked ranks inherit it
    root = Path(args.dir or tempfile.mkdtemp(prefix="bench_ckpt_"))
    print(f"world {args.world} CPU rank(s), ZeRO stage {args.stage}, {args.repeats} saves per mode, medians\n")
    print("| model | parameters | mode | stall s | write s | bytes | stall async/sync |")
    print("|---|---|---|---|---|---|---|")
    try:
        for name, layers, hidden in (("tiny", 4, 128), ("large", args.large_layers, args.large_hidden)):
            t0 = time.perf_counter()
            out = run_ranks(bench_rank, args.world, args, layers, hidden, root / name, timeout=3600)[0]
            sync = out["rows"][0]["stall_s"]
            for row in out["rows"]:
                print(f"| {name} ({layers}×{hidden}) | {out['psi'] / 1e6:.1f} M | {row['mode']} | {row['stall_s']:.3f} | "
                      f"{row['write_s']:.3f} | {row['bytes']} | {row['stall_s'] / sync:.3f} |", flush=True)
            print(f"<!-- {name}: {time.perf_counter() - t0:.0f} s wall -->", flush=True)
    finally:
        if args.dir is None:
            shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
