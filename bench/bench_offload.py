"""ZeRO-Offload: step time and peak host memory with the optimizer states on the device, the host, NVMe.

    python bench/bench_offload.py [--ranks 2] [--layers 8] [--hidden 512] [--steps 6] [--stage 2]
                                  [--nvme-path /tmp] [--nvme-buffer-mb 16]

Every row trains the same megatron-core GPTModel (TP 1) on the same batches, on gloo CPU ranks, in one
run: zero3d with `zero.offload_optimizer` none / cpu / nvme, and DeepSpeed's ZeRO-Offload (same stage,
`offload_optimizer.device = cpu`, DeepSpeedCPUAdam) when deepspeed is installed (`.[bench]`). On a CPU
machine "device" and host are one memory, so what the table shows is the NVMe row's bound: its peak
RSS stays below the cpu row's by at least the optimizer-state bytes less the NVMe buffer budget.
Columns (rank 0): step s = median wall time of the steps after the first two; peak RSS = the rank
process's high-water mark (ru_maxrss; the forked parent's pages are a constant in every row);
+RSS = peak minus the RSS just before the model was built; state = the engine's mem/ categories.
A second table times torch's CPU AdamW modes (single-tensor, foreach, fused) on one rank's shard:
the offloaded step uses the fastest.
"""
import argparse
import os
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("DS_ACCELERATOR", "cpu")
REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests"))  # local_ranks: the forked-rank runner

import megatron.core.models.gpt  # noqa: E402,F401 - imported before forking the ranks
import psutil  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from local_ranks import run_ranks  # noqa: E402

MB = 2**20


def build(args, system):
    from pretrain.config import load_config
    from pretrain.model.gpt import build_model
    from pretrain.runtime.layout import init_layout
    overrides = [f"model.num_layers={args.layers}", f"model.hidden_size={args.hidden}",
                 f"model.num_attention_heads={args.heads}", f"model.seq_length={args.seq}",
                 f"model.vocab_size={args.vocab}", f"train.micro_batch_size={args.micro}",
                 f"train.global_batch_size={args.micro * args.ranks}", f"zero.stage={args.stage}",
                 f"zero.bucket_elements={args.bucket}", "logging.wandb=false"]
    if system.startswith("zero3d-"):
        placement = system.split("-", 1)[1]
        overrides.append(f"zero.offload_optimizer={placement}")
        if placement == "nvme":
            overrides += [f"zero.nvme_path={args.nvme_path}", f"zero.nvme_buffer_bytes={args.nvme_buffer_mb * MB}"]
    cfg = load_config(None, overrides)
    topo = init_layout(cfg)
    return cfg, topo, build_model(cfg, topo.device)


def run_system(rank, world, system, args):
    from pretrain.model.gpt import gpt_loss
    start_rss = psutil.Process().memory_info().rss
    cfg, topo, model = build(args, system)
    lr, state = 1e-3, {}
    if system.startswith("zero3d-"):
        import zero3d
        from pretrain.model.gpt import parallel_groups
        from pretrain.train import engine_settings
        engine = zero3d.wrap_model(model, engine_settings(cfg), parallel_groups(model, topo))
        forward, backward, step = engine, engine.backward, lambda: engine.step(lr)
        state_bytes = engine.state_bytes
    else:  # deepspeed-offload
        import deepspeed
        ds_config = {"train_micro_batch_size_per_gpu": args.micro, "gradient_accumulation_steps": 1,
                     "optimizer": {"type": "AdamW", "params": {"lr": lr}},
                     "zero_optimization": {"stage": args.stage, "reduce_bucket_size": args.bucket,
                                           "allgather_bucket_size": args.bucket,
                                           "offload_optimizer": {"device": "cpu", "pin_memory": False}},
                     "steps_per_print": 10**9}
        ds, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds_config)
        forward, backward, step = ds, ds.backward, ds.step
        state_bytes = dict
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, args.vocab, (args.steps, args.micro * world, args.seq + 1), generator=g)
    times, losses = [], []
    for i in range(args.steps):
        dist.barrier()
        t0 = time.perf_counter()
        loss = gpt_loss(forward, tokens[i, rank * args.micro:(rank + 1) * args.micro])
        backward(loss)
        step()
        times.append(time.perf_counter() - t0)
        losses.append(loss.item())
    state = state_bytes()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return {"step_s": statistics.median(times[2:]), "peak_rss": peak, "added_rss": peak - start_rss,
            "state": state, "first_loss": losses[0], "last_loss": losses[-1]}


def time_adam_modes(numel: int, repeats: int = 5) -> dict:
    """Seconds per AdamW step over one fp32 tensor of `numel` elements, per torch CPU mode."""
    out = {}
    for mode, flags in (("single-tensor", dict(foreach=False)), ("foreach", dict(foreach=True)),
                        ("fused", dict(fused=True))):
        p = torch.randn(numel)
        p.grad = torch.randn(numel) * 1e-3
        opt = torch.optim.AdamW([p], lr=1e-3, weight_decay=0.1, **flags)
        opt.step()  # allocates the moments
        t0 = time.perf_counter()
        for _ in range(repeats):
            opt.step()
        out[mode] = (time.perf_counter() - t0) / repeats
    return out


def systems() -> list[str]:
    rows = ["zero3d-none", "zero3d-cpu", "zero3d-nvme"]
    try:
        import deepspeed  # noqa: F401
        rows.append("deepspeed-offload")
    except ImportError:
        print("(deepspeed not installed: pip install -e .[bench] adds the DeepSpeed row)")
    return rows


def print_table(args, rows):
    base = rows.get("zero3d-none", {})
    print(f"GPT L={args.layers} h={args.hidden} s={args.seq} micro={args.micro} vocab={args.vocab} fp32, "
          f"ZeRO stage {args.stage}, {args.ranks} gloo ranks (DP={args.ranks}); rank 0; ratios vs zero3d-none")
    print(f"{'system':20} {'step s':>8} {'x':>6} {'peak RSS MB':>12} {'+RSS MB':>9} {'loss 1st':>9} "
          f"{'loss last':>9}  state (MB)")
    for system, r in rows.items():
        if "error" in r:
            print(f"{system:20} failed: {r['error']}")
            continue
        ratio = r["step_s"] / base["step_s"] if base.get("step_s") else float("nan")
        state = " ".join(f"{k}={v / MB:.1f}" for k, v in r["state"].items() if v) or "n/a (not zero3d)"
        print(f"{system:20} {r['step_s']:8.3f} {ratio:6.2f} {r['peak_rss'] / MB:12.1f} "
              f"{r['added_rss'] / MB:9.1f} {r['first_loss']:9.4f} {r['last_loss']:9.4f}  {state}")
    cpu, nvme = rows.get("zero3d-cpu", {}), rows.get("zero3d-nvme", {})
    if "state" in cpu and "state" in nvme:
        moments = cpu["state"]["host_optimizer_states"]
        with_master = moments + cpu["state"]["host_master_params"]
        budget = args.nvme_buffer_mb * MB
        saved = cpu["peak_rss"] - nvme["peak_rss"]
        print(f"peak RSS cpu − nvme = {saved / MB:.1f} MB; Adam moments {moments / MB:.1f} MB "
              f"(+ fp32 master {with_master / MB:.1f} MB) − buffer budget {budget / MB:.1f} MB = "
              f"{(moments - budget) / MB:.1f} MB ({(with_master - budget) / MB:.1f} MB): "
              f"bound {'holds' if saved >= moments - budget else 'DOES NOT hold'}")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--vocab", type=int, default=1024)
    p.add_argument("--micro", type=int, default=2)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--stage", type=int, choices=[1, 2, 3], default=2)
    p.add_argument("--bucket", type=int, default=2_000_000)
    p.add_argument("--nvme-path", default=tempfile.gettempdir())
    p.add_argument("--nvme-buffer-mb", type=int, default=16)
    p.add_argument("--systems", nargs="*", help="subset of rows to run")
    args = p.parse_args(argv)
    rows = {}
    for system in args.systems or systems():
        try:
            rows[system] = run_ranks(run_system, args.ranks, system, args, timeout=900)[0]
        except Exception as err:  # noqa: BLE001 - a peer that fails is reported, not fatal
            rows[system] = {"error": " | ".join(str(err).strip().splitlines()[-3:])[:300]}
    print_table(args, rows)
    shard = rows.get("zero3d-cpu", {}).get("state", {}).get("host_master_params", 4 * 2**20) // 4
    torch.set_num_threads(1)  # as each rank runs
    modes = time_adam_modes(shard)
    fastest = min(modes.values())
    print(f"\ntorch CPU AdamW on one rank's shard ({shard:,} fp32 elements, 1 thread): "
          + ", ".join(f"{m} {t * 1e3:.1f} ms (x{t / fastest:.2f})" for m, t in modes.items()))


if __name__ == "__main__":
    main()
