"""A step's device time: kernels by kind, the device's idle share, the top kernels (probe and bench_gpu --profile)."""
import gzip
import json
import os
import shutil
import tempfile

import torch

from pretrain.atomic import replacing

# A kernel's kind, by the first of these fragments its (lower-cased) name holds; the rest is "other"
KINDS = (("gemm", ("gemm", "cutlass", "nvjet", "xmma", "cublas", "scaled_mm", "matmul", "addmm", "mm_")),
         ("attention", ("flash", "fmha", "attention", "sdpa", "efficient_attention")),
         ("collective", ("nccl", "allreduce", "all_gather", "reduce_scatter")),
         ("compiled (triton)", ("triton",)),
         ("memory copy", ("memcpy", "memset", "copy_", "fill")),
         ("optimizer", ("adam", "multi_tensor", "foreach")),
         ("elementwise", ("elementwise", "vectorized", "unrolled", "reduce", "cat", "index", "softmax", "norm")))
DEVICE_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")


def kind_of(name: str) -> str:
    low = name.lower()
    return next((kind for kind, fragments in KINDS if any(f in low for f in fragments)), "other")


def busy_seconds(intervals: list) -> float:
    """The union of (start, end) intervals in µs, in seconds: time the device ran at least one kernel."""
    total, reach = 0.0, float("-inf")
    for start, end in sorted(intervals):
        if end > reach:
            total += end - max(start, reach)
            reach = end
    return total / 1e6


MODEL_KINDS = ("gemm", "attention", "compiled (triton)")  # the model's own math; the rest is what `by_op` explains


def launchers(events: list) -> dict:
    """{External id: "frame > op"}: each CPU op that launched kernels, with the innermost enclosing event that is not an
    aten op (an autograd node, a custom Function, a compiled graph; "" at the top level: the caller's own code)."""
    threads = {}
    for e in events:
        if e.get("cat") in ("cpu_op", "user_annotation", "python_function") and "dur" in e:
            threads.setdefault(e.get("tid"), []).append(e)
    out = {}
    for spans in threads.values():
        spans.sort(key=lambda e: (e["ts"], -e["dur"]))
        open_spans = []
        for e in spans:
            while open_spans and open_spans[-1]["ts"] + open_spans[-1]["dur"] <= e["ts"]:
                open_spans.pop()
            frame = next((f["name"] for f in reversed(open_spans) if not f["name"].startswith("aten::")), "")
            ext = e.get("args", {}).get("External id")
            if e.get("cat") == "cpu_op" and ext is not None and ext not in out:
                out[ext] = f"{frame[:60]} > {e['name']}" if frame else e["name"]
            open_spans.append(e)
    return out


def summarize(events: list, steps: int, wall_s: float, top: int = 12) -> dict:
    """`events`: chrome-trace events of `steps` steps that took `wall_s` seconds. Per step: the device's busy seconds
    and idle share, seconds per kernel kind, and the `top` kernels by time (name, seconds, calls)."""
    kernels = [e for e in events if e.get("cat") in DEVICE_CATEGORIES and "dur" in e]
    by_kind, by_name = {}, {}
    for e in kernels:
        seconds = e["dur"] / 1e6 / steps
        by_kind[kind_of(e["name"])] = by_kind.get(kind_of(e["name"]), 0.0) + seconds
        name = e["name"][:90]
        s, n = by_name.get(name, (0.0, 0))
        by_name[name] = (s + seconds, n + 1)
    launched_by, by_op = launchers(events), {}
    for e in kernels:
        if kind_of(e["name"]) not in MODEL_KINDS:
            op = launched_by.get(e.get("args", {}).get("External id"), "?")
            s, n = by_op.get(op, (0.0, 0))
            by_op[op] = (s + e["dur"] / 1e6 / steps, n + 1)
    busy = busy_seconds([(e["ts"], e["ts"] + e["dur"]) for e in kernels]) / steps
    step_s = wall_s / steps
    return {"step_s": step_s, "device_busy_s": busy, "device_idle": (1 - busy / step_s) if kernels else None,
            "kernels_per_step": len(kernels) / steps,
            "kinds_s": dict(sorted(by_kind.items(), key=lambda kv: -kv[1])),
            "top": [(name, s, n // steps) for name, (s, n) in sorted(by_name.items(), key=lambda kv: -kv[1][0])[:top]],
            "by_op": [(op, s, n // steps) for op, (s, n) in sorted(by_op.items(), key=lambda kv: -kv[1][0])[:top]]}


def kernel_profile(step, device, steps: int = 3, trace_to: str = "", top: int = 12) -> dict:
    """Run `step()` `steps` times under torch.profiler (after the caller's warm-up) and summarize its device kernels;
    `trace_to`: also keep the chrome trace there, gzipped. On CPU (the dry run) there are no kernels: CPU ops stand in."""
    import time
    from torch.profiler import ProfilerActivity, profile
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    sync()
    with profile(activities=activities) as prof:
        t0 = time.perf_counter()
        for _ in range(steps):
            step()
        sync()
        wall = time.perf_counter() - t0
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as f:
            trace = json.load(f)
        if trace_to:  # under its name only once complete (an earlier trace there stays whole until then)
            with replacing(trace_to) as part, open(path, "rb") as src, gzip.open(part, "wb", compresslevel=6) as dst:
                shutil.copyfileobj(src, dst)
    events = trace.get("traceEvents", [])
    if device.type != "cuda":  # the dry run: top-level CPU ops stand in for kernels
        events = events + [dict(e, cat="kernel") for e in events if e.get("cat") == "cpu_op"]
    return summarize(events, steps, wall, top)


def profile_table(rows: list) -> str:
    """bench_gpu's rows that carry a `profile` as a markdown table, then each row's top kernels."""
    kinds = sorted({k for r in rows if r.get("profile") for k in r["profile"]["kinds_s"]})
    lines = ["| row | step s | device busy s | idle | kernels/step | " + " | ".join(f"{k} s" for k in kinds) + " |",
             "|---|---|---|---|---|" + "---|" * len(kinds)]
    for r in rows:
        p = r.get("profile")
        if not p:
            continue
        idle = "—" if p["device_idle"] is None else f"{p['device_idle']:.1%}"
        lines.append(f"| {r['row']} | {p['step_s']:.4f} | {p['device_busy_s']:.4f} | {idle} | "
                     f"{p['kernels_per_step']:.0f} | " + " | ".join(f"{p['kinds_s'].get(k, 0.0):.4f}" for k in kinds)
                     + " |")
    for r in rows:
        if r.get("profile"):
            lines += ["", f"{r['row']}: top kernels (s per step, calls per step)", ""]
            lines += [f"    {s:.4f}  {n:5d}  {name}" for name, s, n in r["profile"]["top"]]
            lines += ["", f"{r['row']}: kernels beyond the model's GEMMs, attention and compiled code, by the op that "
                      "launched them (s per step, kernels per step)", ""]
            lines += [f"    {s:.4f}  {n:5d}  {op}" for op, s, n in r["profile"]["by_op"]]
    return "\n".join(lines) + "\n"
