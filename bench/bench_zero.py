"""ZeRO-DP stages 0-3 against their peers on one GPT model: step time, model-state bytes, communication.

    python bench/bench_zero.py [--ranks 4] [--gpus-per-node 2] [--layers 4] [--hidden 256] [--seq 128] [--steps 8]
    python bench/bench_zero.py --before a516b06 --systems zero3d-0 zero3d-1 zero3d-2 zero3d-3

`--before COMMIT` adds a row per zero3d stage run by the engine of that commit ("@before"): its
tree is exported with `git archive` into a temporary directory and the same rank function runs
there in a subprocess (ZERO3D_TREE puts that tree first on sys.path), so "before" and "after" are
measured in one run on the same machine; a before/after table (step time and collective calls per
step, with ratios) follows the main one. Any commit from a516b06 (where pretrain/model/ begins) runs; config keys
that tree does not have yet are left out, and named.

Every system trains the same megatron-core GPTModel (TP 1: the peers do not speak Megatron TP) from
the same initial weights on the same batches, on gloo CPU ranks, in one run. Columns:
- step s: median wall time of the steps after the first two;
- state B: bytes per rank kept between steps (zero3d: its own accounting; peers: a census of the
  distinct tensor storages held by the model, its grads and the optimizer);
- comm el: elements per rank per step moved by torch.distributed collectives, counted by one shim
  around torch.distributed for every system (for zero3d, equal to its own count: tests/dist/test_bench_counter.py),
  at bandwidth-optimal volume (all-reduce 2n(N-1)/N,
  reduce / reduce-scatter / all-gather / broadcast n(N-1)/N);
- calls: collectives per rank per step seen by the same shim (the gradient-norm all-reduce included);
- ratios against zero3d stage 0 measured in the same run.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

os.environ.setdefault("DS_ACCELERATOR", "cpu")
REPO = Path(__file__).resolve().parent.parent
TREE = Path(os.environ.get("ZERO3D_TREE", REPO))  # whose zero3d/pretrain the ranks import
sys.path.insert(0, str(REPO / "tests"))  # local_ranks: the forked-rank runner
sys.path.insert(0, str(TREE))

import megatron.core.models.gpt  # noqa: E402,F401 - imported before forking the ranks
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from local_ranks import run_ranks  # noqa: E402

# ------------------------------------------------------------------ counting shim


@contextmanager
def count_collectives(counter: dict):
    """Wrap torch.distributed's collectives so every call adds its per-rank volume to counter.

    Both `torch.distributed.X` and `torch.distributed.distributed_c10d.X` are wrapped (libraries
    call either). Collectives issued below the Python API (c10d ops, ProcessGroup methods) are not
    seen: such a system's column reads n/a rather than a wrong number.
    """
    import torch.distributed.distributed_c10d as c10d
    rules = {  # name -> (position, keyword) of the full-size tensor(s), volume factor
        "all_reduce": (0, "tensor", 2), "reduce": (0, "tensor", 1), "broadcast": (0, "tensor", 1),
        "reduce_scatter_tensor": (1, "input", 1), "all_gather_into_tensor": (0, "output_tensor", 1),
        "reduce_scatter_single": (1, "input", 1), "all_gather_single": (0, "output_tensor", 1),
        "all_gather": (0, "tensor_list", 1), "reduce_scatter": (1, "input_list", 1),
        "_reduce_scatter_base": (1, "input", 1), "_all_gather_base": (0, "output_tensor", 1),
        "all_to_all_single": (1, "input", 1),  # qgZ's exchange: all but this rank's 1/n of the input leaves it
    }
    saved = []
    depth = [0]  # a deprecated alias calls its successor: count the outermost call only
    for name, (index, keyword, factor) in rules.items():
        original = getattr(c10d, name)

        def wrapped(*args, _original=original, _index=index, _keyword=keyword, _factor=factor, **kwargs):
            if depth[0] == 0:
                full = args[_index] if len(args) > _index else kwargs[_keyword]
                n = dist.get_world_size(kwargs.get("group"))
                count = sum(t.numel() for t in full) if isinstance(full, (list, tuple)) else full.numel()
                counter["elements"] = counter.get("elements", 0) + _factor * count * (n - 1) / n
                counter["calls"] = counter.get("calls", 0) + 1
            depth[0] += 1
            try:
                return _original(*args, **kwargs)
            finally:
                depth[0] -= 1
        for namespace in (dist, c10d):
            saved.append((namespace, name, getattr(namespace, name)))
            setattr(namespace, name, wrapped)
    try:
        yield counter
    finally:
        for namespace, name, original in saved:
            setattr(namespace, name, original)


def storage_census(*objects) -> int:
    """Bytes of the distinct tensor storages reachable from objects (3 levels of attributes/containers)."""
    seen, total = set(), 0

    def visit(obj, depth):
        nonlocal total
        if isinstance(obj, torch.Tensor):
            local = getattr(obj, "_local_tensor", obj)  # DTensor shards (FSDP2)
            for t in (local, local.grad if local.grad is not None else None, obj.grad):
                try:
                    storage = t.untyped_storage() if t is not None else None
                    key = storage.data_ptr() if storage is not None and storage.nbytes() else None
                except RuntimeError:  # a storage FSDP has freed (resized to 0)
                    key = None
                if key is not None and key not in seen:
                    seen.add(key)
                    total += storage.nbytes()
            return
        if depth == 0 or isinstance(obj, (str, bytes, int, float, bool, type(None))):
            return
        if isinstance(obj, dict):
            items = obj.values()
        elif isinstance(obj, (list, tuple, set)):
            items = obj
        elif hasattr(obj, "__dict__") and not isinstance(obj, torch.nn.Module):
            items = vars(obj).values()
        else:
            return
        for item in list(items):
            visit(item, depth - 1)

    for obj in objects:
        if isinstance(obj, torch.nn.Module):
            for p in obj.parameters():
                visit(p, 1)
        else:
            visit(obj, 4)
    return total


# ------------------------------------------------------------------ one system on N ranks


def batches(args, rank, world):
    """Rank's micro-batch of the step's global batch: the same tokens for every system."""
    def get(step):
        g = torch.Generator().manual_seed(step)
        tokens = torch.randint(0, args.vocab, (args.micro * world, args.seq + 1), generator=g)
        return tokens[rank * args.micro:(rank + 1) * args.micro]
    return get


# The ZeRO++ rows (stage 3 + mode): zero.* settings, node topology from --gpus-per-node.
ZEROPP_OVERRIDES = {
    "hpZ": ["zero.secondary_partition=node"],
    "hybrid": ["zero.hybrid=node"],
    "qwZ": ["zero.quantize_weights=int8"],
    "qgZ": ["zero.quantize_gradients=int4"],
    "qwZ+hpZ+qgZ": ["zero.quantize_weights=int8", "zero.secondary_partition=node", "zero.quantize_gradients=int4"],
}
ZEROPP_SYSTEMS = [f"zero3d-3+{mode}" for mode in ZEROPP_OVERRIDES]


def DEEPSPEED_ZEROPP(gpus_per_node: int) -> dict:  # noqa: N802 - a table, by the node size
    """DeepSpeed's ZeRO++ options (zero_optimization keys) for the same rows."""
    return {"hpZ": {"zero_hpz_partition_size": gpus_per_node}, "qwZ": {"zero_quantized_weights": True},
            "qgZ": {"zero_quantized_gradients": True},
            "qwZ+hpZ+qgZ": {"zero_hpz_partition_size": gpus_per_node, "zero_quantized_weights": True,
                            "zero_quantized_gradients": True}}


def build(args, system):
    from pretrain.config import load_config
    from pretrain.model.gpt import build_model
    from pretrain.runtime.layout import init_layout
    overrides = [f"model.num_layers={args.layers}", f"model.hidden_size={args.hidden}",
                 f"model.num_attention_heads={args.heads}", f"model.seq_length={args.seq}",
                 f"model.vocab_size={args.vocab}", f"train.micro_batch_size={args.micro}",
                 f"train.global_batch_size={args.micro * args.ranks}", f"precision.dtype={args.dtype}",
                 f"zero.bucket_elements={args.bucket}", "logging.wandb=false"]
    if system.startswith("zero3d-"):
        stage, _, mode = system.removeprefix("zero3d-").partition("+")
        overrides += [f"zero.stage={stage}", f"cluster.gpus_per_node={args.gpus_per_node}",
                      *ZEROPP_OVERRIDES.get(mode, [])]
    if TREE != REPO:  # --before: an older tree runs without the keys it does not have yet
        overrides = keys_the_tree_has(overrides)
    cfg = load_config(None, overrides)
    topo = init_layout(cfg)
    return cfg, topo, build_model(cfg, topo.device)


def keys_the_tree_has(overrides: list[str]) -> list[str]:
    """The overrides whose section.key the imported tree's config defines (the others named on stderr, once)."""
    from pretrain.config import load_config
    default = load_config(None)
    kept = [o for o in overrides if hasattr(getattr(default, o.split(".", 1)[0], None), o.split("=")[0].split(".")[1])]
    dropped = [o for o in overrides if o not in kept]
    if dropped and os.environ.get("RANK", "0") == "0":
        print(f"the tree at {TREE} has no {', '.join(o.split('=')[0] for o in dropped)}: run without", file=sys.stderr)
    return kept


def run_system(rank, world, system, args):
    from pretrain.model.gpt import gpt_loss
    cfg, topo, model = build(args, system)
    lr, steps = 1e-3, args.steps
    stats = None
    if system.startswith("zero3d-"):
        import zero3d
        from pretrain.model.gpt import parallel_groups
        from pretrain.train import engine_settings
        engine = zero3d.wrap_model(model, engine_settings(cfg), parallel_groups(model, topo))
        forward, backward, step = engine, engine.backward, lambda: engine.step(lr)
        state = lambda: sum(engine.state_bytes().values())  # noqa: E731
        stats = engine.comm_stats  # zero3d's own count of the collectives it issued
    elif system == "torch-ZeroRedundancyOptimizer":
        from torch.distributed.optim import ZeroRedundancyOptimizer
        from torch.nn.parallel import DistributedDataParallel
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
        ddp = DistributedDataParallel(model, bucket_cap_mb=args.bucket * 4 / 2**20)
        # DDP's reducer is C++; its stock Python all-reduce hook makes the same calls visible to the shim.
        ddp.register_comm_hook(None, default_hooks.allreduce_hook)
        opt = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.AdamW, lr=lr)
        forward, backward = ddp, lambda loss: loss.backward()
        step = lambda: (opt.step(), opt.zero_grad(set_to_none=False))  # noqa: E731
        state = lambda: storage_census(model, opt.optim.state)  # noqa: E731
    elif system == "torch-FSDP2":
        from torch.distributed.fsdp import fully_shard
        for layer in model.decoder.layers:
            fully_shard(layer, reshard_after_forward=True)
        fully_shard(model, reshard_after_forward=True)
        opt = torch.optim.AdamW(model.parameters(), lr=lr)
        forward, backward = model, lambda loss: loss.backward()
        step = lambda: (opt.step(), opt.zero_grad(set_to_none=False))  # noqa: E731
        state = lambda: storage_census(model, opt.state)  # noqa: E731
    else:  # deepspeed-N, deepspeed-3+<ZeRO++ option>
        import deepspeed
        stage, _, mode = system.removeprefix("deepspeed-").partition("+")
        ds_config = {"train_micro_batch_size_per_gpu": args.micro, "gradient_accumulation_steps": 1,
                     "optimizer": {"type": "AdamW", "params": {"lr": lr, "torch_adam": True}},
                     "zero_optimization": {"stage": int(stage), "reduce_bucket_size": args.bucket,
                                           "allgather_bucket_size": args.bucket,
                                           **DEEPSPEED_ZEROPP(args.gpus_per_node).get(mode, {})},
                     "bf16": {"enabled": args.dtype == "bf16"}, "steps_per_print": 10**9}
        ds, opt, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds_config)
        forward, backward, step = ds, ds.backward, ds.step
        state = lambda: storage_census(model, opt)  # noqa: E731
    get = batches(args, topo.dp_rank, world)
    times, losses, counter, calls, own_calls, own_elements, links = [], [], {}, [], [], [], []
    for i in range(steps):
        counter.clear()
        if stats is not None:
            stats.reset()
        dist.barrier()
        t0 = time.perf_counter()
        with count_collectives(counter):
            loss = gpt_loss(forward, get(i))
            backward(loss)
            step()
        times.append(time.perf_counter() - t0)
        losses.append(loss.item())
        calls.append(counter.get("calls", 0))
        if stats is not None:
            own_calls.append(sum(stats.calls.values()))
            own_elements.append(float(stats.total()))
            report = stats.report()
            links.append((report.get("comm/intra_node_bytes"), report.get("comm/inter_node_bytes")))
    return {"step_s": statistics.median(times[2:]), "step_min_s": min(times[2:]), "state_bytes": state(),
            "comm_elements": counter.get("elements", 0.0), "calls": statistics.median(calls[1:]),
            "zero3d_calls": statistics.median(own_calls[1:]) if own_calls else None,
            "zero3d_elements": own_elements[-1] if own_elements else None,  # its own count, beside the shim's
            "first_loss": losses[0], "last_loss": losses[-1],
            "intra_bytes": links[-1][0] if links else None, "inter_bytes": links[-1][1] if links else None}


def available_systems() -> list[str]:
    import zero3d
    systems = ([f"zero3d-{s}" for s in sorted(zero3d.STAGES)] + ZEROPP_SYSTEMS
               + ["torch-ZeroRedundancyOptimizer", "torch-FSDP2"])
    try:
        import deepspeed  # noqa: F401
        systems += (["deepspeed-1", "deepspeed-2", "deepspeed-3"]
                    + [f"deepspeed-3+{mode}" for mode in DEEPSPEED_ZEROPP(1)])
    except ImportError:
        print("(deepspeed not installed: pip install -e .[bench] adds the DeepSpeed rows)")
    return systems


def export_tree(commit: str) -> Path:
    """The repository at `commit`, exported once (git archive) into a temporary directory."""
    target = Path(tempfile.gettempdir()) / f"zero3d-{commit}"
    if not (target / "zero3d").is_dir():
        target.mkdir(parents=True, exist_ok=True)
        archive = subprocess.run(["git", "-C", str(REPO), "archive", commit], check=True, capture_output=True)
        subprocess.run(["tar", "-x", "-C", str(target)], input=archive.stdout, check=True)
    return target


def run_before(commit: str, systems: list[str], argv: list[str]) -> dict:
    """Rows of the engine at `commit`: this script's rank function over that tree, in a subprocess."""
    stages = [s for s in systems if s.startswith("zero3d-")]
    if not stages:
        return {}
    with tempfile.NamedTemporaryFile(suffix=".json") as out:
        cmd = [sys.executable, __file__, *argv, "--systems", *stages, "--json", out.name, "--before", ""]
        subprocess.run(cmd, check=True, env={**os.environ, "ZERO3D_TREE": str(export_tree(commit))},
                       stdout=subprocess.DEVNULL)
        rows = json.loads(Path(out.name).read_text())
    return {f"{system}@before": row for system, row in rows.items()}


def strip_options(argv: list[str], names: tuple) -> list[str]:
    """argv without the given options and their values (nargs='*' values run to the next option)."""
    out, skipping = [], False
    for item in argv:
        if item.startswith("--"):
            skipping = item.split("=")[0] in names
        if not skipping:
            out.append(item)
    return out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ranks", type=int, default=4)
    p.add_argument("--gpus-per-node", type=int, default=2,
                   help="ranks per (simulated) node: the per-link byte split and the ZeRO++ rows' topology")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--vocab", type=int, default=1024)
    p.add_argument("--micro", type=int, default=4)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--bucket", type=int, default=500_000)
    p.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32")
    p.add_argument("--systems", nargs="*", help="subset of rows to run")
    p.add_argument("--before", default="", help="commit whose zero3d engine adds '@before' rows (from a516b06 on)")
    p.add_argument("--json", help="also write the rows to this file")
    argv = sys.argv[1:] if argv is None else argv
    args = p.parse_args(argv)
    systems = args.systems or available_systems()
    rest = strip_options(argv, ("--systems", "--before", "--json"))
    rows = {}
    for system in systems:
        try:
            rows[system] = run_ranks(run_system, args.ranks, system, args, timeout=600)[0]
        except Exception as err:  # noqa: BLE001 - a peer that fails is reported, not fatal
            rows[system] = {"error": str(err).strip().splitlines()[-1][:90]}
        if args.before:  # interleaved, so load changes on the machine hit both sides alike
            rows.update(run_before(args.before, [system], rest))
    if args.json:
        Path(args.json).write_text(json.dumps(rows))
    print_table(rows, args)
    if args.before:
        print_before_after(rows, args.before)


def print_table(rows: dict, args) -> None:
    base = rows.get("zero3d-0", {})
    print(f"GPT L={args.layers} h={args.hidden} s={args.seq} micro={args.micro} vocab={args.vocab} "
          f"{args.dtype}, {args.ranks} gloo ranks (DP={args.ranks}, TP=1); per rank; ratios vs zero3d-0")
    print(f"{'system':32} {'step s':>8} {'x':>6} {'state B':>12} {'x':>6} {'comm el':>12} {'x':>6} "
          f"{'calls':>6} {'loss 1st':>9} {'loss last':>9} {'intra B':>12} {'inter B':>12}")
    for system, r in rows.items():
        if "error" in r:
            print(f"{system:32} failed: {r['error']}")
            continue
        ratio = lambda k: r[k] / base[k] if base.get(k) else float("nan")  # noqa: E731
        # Fewer than 1% of stage 0's elements: the system's traffic runs below the Python API.
        visible = r["comm_elements"] >= 0.01 * base.get("comm_elements", 0)
        comm = f"{r['comm_elements']:12,.0f} {ratio('comm_elements'):6.2f}" if visible else f"{'n/a':>12} {'':6}"
        calls = f"{r['calls']:6.0f}" if visible else f"{'n/a':>6}"
        print(f"{system:32} {r['step_s']:8.3f} {ratio('step_s'):6.2f} {r['state_bytes']:12,d} "
              f"{ratio('state_bytes'):6.2f} {comm} {calls} "
              f"{r['first_loss']:9.4f} {r['last_loss']:9.4f} {_bytes(r.get('intra_bytes'))} "
              f"{_bytes(r.get('inter_bytes'))}")
    print(f"intra B / inter B: bytes per rank in the last step inside / across nodes of {args.gpus_per_node} ranks "
          "(zero3d's per-link count; the ZeRO++ rows' comm el counts logical elements, not quantized bytes)")
    if not any(system.startswith("deepspeed") for system in rows):
        print("DeepSpeed rows (ZeRO 1-3 and ZeRO++ zero_hpz_partition_size / zero_quantized_weights / "
              "zero_quantized_gradients): not run, deepspeed is not installed here (pip install -e .[bench])")


def _bytes(value) -> str:
    return f"{value:12,.0f}" if value is not None else f"{'n/a':>12}"


def print_before_after(rows: dict, commit: str) -> None:
    print(f"\nzero3d stages, this tree vs {commit} (interleaved in the same run). step: median / fastest "
          "step; collectives: as zero3d counts them / torch.distributed calls seen by the shim")
    print(f"{'stage':10} {'median before':>14} {'after':>7} {'x':>5} {'min before':>11} {'after':>7} {'x':>5} "
          f"{'collectives before':>19} {'after':>6} {'torch calls before':>19} {'after':>6}")
    for system, after in rows.items():
        before = rows.get(f"{system}@before")
        if before is None or "error" in after or "error" in before:
            continue
        print(f"{system:10} {before['step_s']:14.3f} {after['step_s']:7.3f} {after['step_s'] / before['step_s']:5.2f} "
              f"{before['step_min_s']:11.3f} {after['step_min_s']:7.3f} "
              f"{after['step_min_s'] / before['step_min_s']:5.2f} {before['zero3d_calls']:19.0f} "
              f"{after['zero3d_calls']:6.0f} {before['calls']:19.0f} {after['calls']:6.0f}")


if __name__ == "__main__":
    main()
