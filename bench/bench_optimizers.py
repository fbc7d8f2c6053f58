"""The optimizers' step on one GPU: the kernels checked against torch's, then timed (optim/, docs/optimizers.md).

    python bench/bench_optimizers.py [--elements 100000000] [--matrix 4096x14336] [--repeats 10]
    python bench/bench_optimizers.py --cpu-step [--elements N]   # the step from a bf16 gradient only, on the CPU

Checks (CUDA; each prints its largest difference): the engine's AdamW (FlatOptimizer, fused) = torch.optim.AdamW(
fused=True) bit for bit and torch's single-tensor loop within rounding (and apex's FusedAdam where importable); bf16
states = the fp32 update from the rounded states, rounded back, bit for bit; Lion, SGD and a one-GPU engine with Muon
(an MLP, zero3d's whole-matrix step) = the same on the CPU within rounding. Timings (CUDA events, median of
--repeats): one step of AdamW, Lion and SGD over --elements fp32 master elements with fp32 and with bf16 states (the
bytes each step reads and writes over its time), and Muon's Newton–Schulz
on one --matrix in fp32 and in bf16 (the planner models the fp32 one at the GPU's plain fp32 rate); AdamW's step from
a bf16 gradient, the whole shard cast first against the engine's chunked casts (time, memory beside, bit for bit).
Needs only torch (no megatron): zero3d's engine runs on a one-rank process group.
"""
import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from optim.config import OptimizerConfig  # noqa: E402
from optim import spec_named  # noqa: E402
from optim.flat_optimizer import FlatOptimizer, FlatTensor  # noqa: E402
from optim.muon import newton_schulz  # noqa: E402

SIZES = (1_000_003, 37, 65_536)
DECAYS = (0.1, 0.0, 0.1)


def grads(step, device):
    g = torch.Generator().manual_seed(100 + step)
    return [torch.randn(n, generator=g).to(device) for n in SIZES]


def masters(device):
    g = torch.Generator().manual_seed(0)
    return [torch.randn(n, generator=g).to(device) for n in SIZES]


def flat_steps(name, device, state_dtype="fp32", steps=4, fused=True, **keys):
    ms = masters(device)
    opt = FlatOptimizer([FlatTensor(m, wd) for m, wd in zip(ms, DECAYS)], spec_named(name),
                        OptimizerConfig(name=name, lr=1e-2, state_dtype=state_dtype, **keys), fused=fused)
    for step in range(steps):
        for m, g in zip(ms, grads(step, device)):
            m.grad = g
        opt.step()
    return ms, opt


def torch_adamw(device, steps=4, **mode):
    ms = masters(device)
    opt = torch.optim.AdamW([{"params": [m], "weight_decay": wd} for m, wd in zip(ms, DECAYS)], lr=1e-2,
                            betas=(0.9, 0.999), eps=1e-8, **mode)
    for step in range(steps):
        for m, g in zip(ms, grads(step, device)):
            m.grad = g
        opt.step()
    return ms


def max_rel(a, b):
    return max(((x.double().cpu() - y.double().cpu()).abs().max() / y.double().abs().max()).item() for x, y in zip(a, b))


def check(report):
    cuda = torch.device("cuda")
    ours, _ = flat_steps("adamw", cuda)
    fused = torch_adamw(cuda, fused=True)
    report("adamw fused = torch AdamW(fused=True), bit for bit", all(torch.equal(a, b) for a, b in zip(ours, fused)))
    report(f"adamw fused vs torch's single-tensor loop: max rel diff {max_rel(ours, torch_adamw(cuda, foreach=False)):.2e}",
           max_rel(ours, torch_adamw(cuda, foreach=False)) < 1e-5)
    try:
        from apex.optimizers import FusedAdam
        ms = masters(cuda)
        opt = FusedAdam([{"params": [m], "weight_decay": wd} for m, wd in zip(ms, DECAYS)], lr=1e-2, adam_w_mode=True)
        for step in range(4):
            for m, g in zip(ms, grads(step, cuda)):
                m.grad = g
            opt.step()
        report(f"adamw fused vs apex FusedAdam: max rel diff {max_rel(ours, ms):.2e}", max_rel(ours, ms) < 1e-5)
    except ImportError:
        print("apex: not importable here (skipped)")
    for name, keys in (("adamw", {}), ("lion", {}), ("sgd", {"momentum": 0.9})):
        out, opt = flat_steps(name, cuda, "bf16", steps=1, **keys)
        ref, ref_opt = flat_steps(name, cuda, "fp32", steps=1, **keys)
        for step in range(1, 4):
            for p, r in zip(out, ref):
                for key in spec_named(name).states:
                    ref_opt.state[r][key].copy_(ref_opt.state[r][key].bfloat16())
            for p, r, g in zip(out, ref, grads(step, cuda)):
                p.grad, r.grad = g, g.clone()
            opt.step()
            ref_opt.step()
        same = all(torch.equal(p, r) for p, r in zip(out, ref)) and all(
            opt.state[p][k].dtype == torch.bfloat16 and torch.equal(opt.state[p][k], ref_opt.state[r][k].bfloat16())
            for p, r in zip(out, ref) for k in spec_named(name).states)
        report(f"{name} bf16 states on CUDA = the fp32 update from the rounded states, bit for bit", same)
    for name, keys in (("lion", {}), ("sgd", {"momentum": 0.9})):
        gpu, _ = flat_steps(name, cuda, **keys)
        cpu, _ = flat_steps(name, torch.device("cpu"), fused=False, **keys)
        # Lion's sign update: an element whose c rounds to the other sign moves by 2·lr; count them
        flipped = sum(int(((a.cpu() - b).abs() > 1e-3).sum()) for a, b in zip(gpu, cpu))
        report(f"{name} CUDA vs CPU: max rel diff {max_rel(gpu, cpu):.2e}, elements apart by > 1e-3: {flipped}",
               flipped <= 5 and (name == "lion" or max_rel(gpu, cpu) < 1e-5))
    engine_losses = {device: muon_engine(device) for device in ("cpu", "cuda")}
    gap = max(abs(a - b) / a for a, b in zip(engine_losses["cuda"], engine_losses["cpu"]))
    report(f"muon engine (stage 1, whole matrices, bf16 states) CUDA vs CPU losses: {engine_losses['cuda'][-1]:.6f} vs "
           f"{engine_losses['cpu'][-1]:.6f}, max rel gap {gap:.2e}", gap < 1e-4 and engine_losses["cuda"][-1] < engine_losses["cuda"][0])


def muon_engine(device: str) -> list:
    """A 3-layer MLP under zero3d at stage 1 (one rank) with Muon and bf16 states: its losses."""
    import zero3d
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 128), torch.nn.GELU(),
                                torch.nn.Linear(128, 1)).to(device)
    settings = zero3d.EngineSettings(zero=zero3d.ZeroConfig(stage=1), optimizer=OptimizerConfig(
        name="muon", lr=0.02, weight_decay=0.1, state_dtype="bf16"))
    engine = zero3d.wrap_model(model, settings, zero3d.ParallelGroups(dp_group=None))
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(512, 64, generator=g).to(device), torch.randn(512, 1, generator=g).to(device)
    losses = []
    for _ in range(20):
        loss = (engine(x) - y).pow(2).mean()
        engine.backward(loss)
        engine.step(0.02)
        losses.append(loss.item())
    assert all(s.dtype == torch.bfloat16 for st in engine.optimizer.state.values() for k, s in st.items() if k != "step")
    engine.close()
    return losses


def timed(fn, repeats):
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


def timings(elements: int, matrix: tuple, repeats: int) -> None:
    cuda = torch.device("cuda")
    for name in ("adamw", "lion", "sgd"):
        spec = spec_named(name)
        for state_dtype in ("fp32", "bf16"):
            master = torch.randn(elements, device=cuda)
            master.grad = torch.randn(elements, device=cuda)
            opt = FlatOptimizer([FlatTensor(master, 0.1)], spec, OptimizerConfig(name=name, state_dtype=state_dtype),
                                fused=True)
            seconds = timed(opt.step, repeats)
            moved = elements * (4 + 4 + 4 + 2 * spec.bytes_per_element(False, state_dtype))  # master r+w, grad, states r+w
            print(f"{name:6} {state_dtype} states: {seconds * 1e3:8.2f} ms a step over {elements:,} elements "
                  f"({moved / seconds / 1e9:7.1f} GB/s of master, gradient and states)")
            del opt, master
            torch.cuda.empty_cache()
    step_from_compute_dtype(elements, repeats)
    rows, cols = matrix
    u = torch.randn(rows, cols, device=cuda)
    r, c = min(rows, cols), max(rows, cols)
    flops = 5 * (4 * r * r * c + 2 * r ** 3)
    for dtype in (torch.float32, torch.bfloat16):
        seconds = timed(lambda: newton_schulz(u.to(dtype), 5) if dtype == torch.float32 else ns_bf16(u, 5), repeats)
        print(f"Newton–Schulz ×5 on {rows}×{cols} in {str(dtype).split('.')[1]}: {seconds * 1e3:8.2f} ms "
              f"({flops / seconds / 1e12:6.1f} TFLOP/s)")


def step_from_compute_dtype(elements: int, repeats: int, device: str = "cuda") -> None:
    """AdamW's step from a bf16 gradient shard unscaled and clipped (the device placement's): the whole shard cast to
    fp32 and scaled first (the step before 2026-12-01) against `FlatOptimizer.step(grads=...)`, which casts and scales
    a STEP_CHUNK at a time; bit for bit the same masters, each one's time and (CUDA) the memory it allocates beyond
    the master, gradient and states. On the CPU: the foreach kernels, wall-clock time."""
    dev = torch.device(device)
    low = torch.randn(elements, generator=torch.Generator().manual_seed(0)).bfloat16().to(dev)
    scales = (1 / 1024, 0.37)
    results = {}
    for kind in ("whole", "chunked"):
        master = torch.randn(elements, generator=torch.Generator().manual_seed(1)).to(dev)
        opt = FlatOptimizer([FlatTensor(master, 0.1)], spec_named("adamw"), OptimizerConfig(), fused=dev.type == "cuda")

        def step():
            if kind == "chunked":
                opt.step(grads={master: (low, scales)})
                return
            grad = low.float()
            for scale in scales:
                grad.mul_(scale)
            master.grad = grad
            opt.step()
            master.grad = None
        step()  # the states exist from here on
        extra = None
        if dev.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            before = torch.cuda.memory_allocated()
            step()
            extra = (torch.cuda.max_memory_allocated() - before) / 2**20
        results[kind] = (timed(step, repeats) if dev.type == "cuda" else wall(step, repeats), extra, master.clone())
        del opt, master
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    (whole_s, whole_mem, whole_m), (chunk_s, chunk_mem, chunk_m) = results["whole"], results["chunked"]
    beside = (lambda mib: "" if mib is None else f", {mib:.0f} MiB beside")
    print(f"adamw from a bf16 gradient of {elements:,} elements ({device}): whole fp32 copy {whole_s * 1e3:.2f} ms"
          f"{beside(whole_mem)}; chunked {chunk_s * 1e3:.2f} ms ({whole_s / chunk_s:.2f}x){beside(chunk_mem)}; "
          f"same masters bit for bit: {torch.equal(whole_m, chunk_m)}")


def wall(fn, repeats):
    """The median wall-clock seconds of `fn` (CPU kernels run synchronously), after one warm-up."""
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def ns_bf16(matrix, steps):
    a, b, c = (3.4445, -4.7750, 2.0315)
    x = matrix.bfloat16()
    x = x.mT if x.size(0) > x.size(1) else x
    x = x / (x.norm() + 1e-7)
    for _ in range(steps):
        gram = x @ x.mT
        x = a * x + (b * gram + c * gram @ gram) @ x
    return x


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--elements", type=int, default=100_000_000)
    ap.add_argument("--matrix", default="4096x14336")
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--cpu-step", action="store_true", help="only AdamW's step from a bf16 gradient, on the CPU")
    args = ap.parse_args()
    if args.cpu_step:
        step_from_compute_dtype(args.elements, args.repeats, "cpu")
        return 0
    if not torch.cuda.is_available():
        print("bench_optimizers: no CUDA device; this bench times the GPU kernels", file=sys.stderr)
        return 2
    store = Path(tempfile.mkdtemp()) / "store"
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    failed = []

    def report(what, ok):
        print(("ok   " if ok else "FAIL ") + what, flush=True)
        if not ok:
            failed.append(what)
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name()}")
    check(report)
    timings(args.elements, tuple(int(x) for x in args.matrix.split("x")), args.repeats)
    dist.destroy_process_group()
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
