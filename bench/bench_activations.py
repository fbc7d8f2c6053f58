"""ZeRO-R activation checkpoints on a small GPT: step time, stored checkpoint bytes, extra all-gathers.

Rows follow the paper's Table III (C1-C5; CB and MD on in all of them), plus megatron-core's own
full recompute as the baseline, all measured in one run on the same ranks:

    base  stage 1, megatron recompute      C1  stage 1, MD          C2  stage 1, MD + Pa
    C3    stage 2, MD                       C4  stage 2, MD + Pa     C5  stage 2, MD + Pa+cpu

    python bench/bench_activations.py [--steps 5] [--tp 2] [--layers 4] [--hidden 256] [--seq 256] [--mbs 4]

Runs on `tp` forked CPU ranks over gloo (DP = 1), or on CUDA ranks when launched with torchrun on GPUs
(then world = torchrun's). Bytes are per rank; the baseline's stored bytes are megatron's (it keeps
every layer's full input: L·b·s·h elements), computed, not counted.
"""
import argparse
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # local_ranks

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

ROWS = [("base", 1, "megatron recompute", None), ("C1", 1, "MD", (False, False, True)),
        ("C2", 1, "MD + Pa", (True, False, True)), ("C3", 2, "MD", (False, False, True)),
        ("C4", 2, "MD + Pa", (True, False, True)), ("C5", 2, "MD + Pa+cpu", (True, True, True))]


class RandomTokens:
    def __init__(self, vocab, seq_length):
        self.vocab, self.seq_length = vocab, seq_length

    def sample(self, i):
        return torch.randint(0, self.vocab, (self.seq_length + 1,), generator=torch.Generator().manual_seed(i))


def bench_rank(rank, world_size, args):
    import zero3d
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
    from pretrain.config import load_config
    from pretrain.model.gpt import activation_checkpointing, build_model, gpt_loss, parallel_groups
    from pretrain.runtime.layout import init_layout
    from pretrain.train import Batches, engine_settings

    base = [f"model.num_layers={args.layers}", f"model.hidden_size={args.hidden}", "model.num_attention_heads=8",
            f"model.seq_length={args.seq}", "model.vocab_size=1024", "model.recompute=full",
            f"train.micro_batch_size={args.mbs}", f"train.global_batch_size={args.mbs * world_size // args.tp}",
            f"parallel.tensor={args.tp}", "optimizer.warmup_steps=0", "logging.wandb=false"]
    topo = init_layout(load_config(None, base))
    rows = []
    for name, stage, label, flags in ROWS:
        extra = [f"zero.stage={stage}"]
        if flags:
            extra += [f"zero.partition_activations={str(flags[0]).lower()}",
                      f"zero.cpu_checkpointing={str(flags[1]).lower()}",
                      f"zero.contiguous_checkpointing={str(flags[2]).lower()}"]
        cfg = load_config(None, base + extra)
        torch.manual_seed(1)
        model_parallel_cuda_manual_seed(1)
        acts = activation_checkpointing(cfg.zero, topo.tp_group)
        model = build_model(cfg, topo.device, acts)
        engine = zero3d.wrap_model(model, engine_settings(cfg), parallel_groups(model, topo))
        if acts:
            acts.record_into(engine.comm_stats)
        batches = Batches(RandomTokens(cfg.model.vocab_size, cfg.model.seq_length), cfg.train, cfg.data, topo)
        times, report = [], {}
        for step in range(args.steps + 1):  # step 0 warms up (and sizes the MD buffer)
            engine.comm_stats.reset()
            if acts:
                acts.reset_step()
            dist.barrier()
            t0 = time.perf_counter()
            for micro in range(topo.grad_accum):
                engine.backward(gpt_loss(engine, batches.get(step, micro)) / topo.grad_accum)
            engine.step(cfg.optimizer.lr)
            if topo.device.type == "cuda":
                torch.cuda.synchronize()
            if step:
                times.append(time.perf_counter() - t0)
            report = acts.report() if acts else {}
        bsh = args.mbs * args.seq * args.hidden
        esize = torch.tensor([], dtype=next(model.parameters()).dtype).element_size()
        rows.append(dict(name=name, stage=stage, label=label, time=statistics.median(times),
                         device=report.get("act/ckpt_device_bytes", args.layers * bsh * esize),
                         host=report.get("act/ckpt_host_bytes", 0),
                         gather=report.get("act/allgather_elements", 0.0),
                         md=report.get("act/md_buffer_bytes", 0), allocs=report.get("act/md_allocations", 0)))
        del engine, model
    dist.barrier()
    return rows


def print_table(rows, args):
    b = rows[0]
    print(f"GPT L={args.layers} h={args.hidden} s={args.seq} mbs={args.mbs}, TP={args.tp}, fp32; "
          f"median of {args.steps} steps; bytes per rank")
    print(f"{'row':4} {'stage':>5} {'ZeRO-R':<19} {'step s':>7} {'x base':>6} {'ckpt dev B':>11} {'x base':>6} "
          f"{'ckpt host B':>11} {'act all-gather el':>17} {'MD buf B':>9} {'allocs':>6}")
    for r in rows:
        print(f"{r['name']:4} {r['stage']:>5} {r['label']:<19} {r['time']:7.3f} {r['time'] / b['time']:6.2f} "
              f"{r['device']:11,d} {r['device'] / b['device']:6.3f} {r['host']:11,d} {int(r['gather']):17,d} "
              f"{r['md']:9,d} {r['allocs']:6d}")
    print("base row: megatron keeps each layer's full input (L·b·s·h elements); its ckpt bytes are that "
          "formula, not a measurement. Other rows: zero3d's own accounting.")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    for flag, default in [("steps", 5), ("tp", 2), ("layers", 4), ("hidden", 256), ("seq", 256), ("mbs", 4)]:
        ap.add_argument(f"--{flag}", type=int, default=default)
    args = ap.parse_args()
    if "RANK" in os.environ:  # torchrun
        rows = bench_rank(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), args)
        if int(os.environ["RANK"]) == 0:
            print_table(rows, args)
        return
    import megatron.core.models.gpt  # noqa: F401 - imported once, inherited by the forked ranks
    from local_ranks import run_ranks
    print_table(run_ranks(bench_rank, args.tp, args, timeout=600)[0], args)


if __name__ == "__main__":
    main()
