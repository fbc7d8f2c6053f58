"""`make gpu-check`: what a CPU cannot show, on one GPU machine, in under 9 minutes → runs/gpu-check/report.md.

Rows: NCCL world 1 (and world N when N > 1 GPUs) training of configs/tiny.toml for ZeRO stages 0-3
in fp16 and bf16; Pa+cpu (pinned host memory, side-stream copies) with MD; the Transformer Engine
layer spec when importable; `python -m pretrain.probe --real` of the Llama-3 8B recipe's rank slice
(configs/llama3_8b.toml, 80 GB) and of the 8B, 60B and 100B paper rank slices under a 32 GB cap (a slice
that does not fit is a verdict, not a crash); then
bench/bench_gpu.py's throughput table (zero3d beside a plain-PyTorch GPT; the slices in bf16 and fp16).

The machine may lack megatron-core and a package index: wheels in `.whl/` (git-ignored) are
installed with `pip install --no-index --no-deps --target /tmp/site` and put on PYTHONPATH.
`--cpu-dry-run` walks the same rows on CPU/gloo (probes in fake mode, 2 layers) to catch mistakes
before the one GPU attempt; `--quick` keeps one row of each kind.
"""
import argparse
import glob
import importlib.util
import json
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
SITE = "/tmp/site"
BUDGET_S = 8.5 * 60  # the whole check must end inside the lead's 10-minute call
STEPS = 12

STAGE_ROWS = [("stage 0, bf16", ["zero.stage=0", "precision.dtype=\"bf16\""]),
              ("stage 1, fp16", ["zero.stage=1", "precision.dtype=\"fp16\""]),
              ("stage 1, bf16", ["zero.stage=1", "precision.dtype=\"bf16\""]),
              ("stage 2, fp16", ["zero.stage=2", "precision.dtype=\"fp16\""]),
              ("stage 2, bf16", ["zero.stage=2", "precision.dtype=\"bf16\""]),
              ("stage 3, fp16", ["zero.stage=3", "precision.dtype=\"fp16\""]),
              ("stage 3, bf16", ["zero.stage=3", "precision.dtype=\"bf16\""])]
PA_CPU_ROW = ("stage 2, bf16, recompute + Pa + Pa+cpu (pinned, side stream) + MD",
              ["zero.stage=2", "precision.dtype=\"bf16\"", "model.recompute=\"full\"",
               "zero.partition_activations=true", "zero.cpu_checkpointing=true",
               "zero.contiguous_checkpointing=true"])
TE_ROW = ("stage 2, bf16, Transformer Engine layer spec", ["zero.stage=2", "precision.dtype=\"bf16\""])
PROBES = [("8B", "configs/paper/fig2_8B_zero.toml"), ("60B", "configs/paper/fig2_60B_zero.toml"),
          ("100B", "configs/paper/fig2_100B_zero.toml")]
# a Llama-shaped rank slice (RoPE, SwiGLU, RMSNorm, GQA; SDPA) on the 80 GB card its recipe names
LLAMA_PROBE = ("Llama-3 8B", "configs/llama3_8b.toml", 80)


def ensure_megatron(wheel_dir: Path = REPO / ".whl") -> dict:
    """The environment for subprocesses: megatron-core from `.whl/` when it is not importable here."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
               WANDB_MODE="disabled")
    if importlib.util.find_spec("megatron") is not None and importlib.util.find_spec("megatron.core") is not None:
        return env
    wheels = [w for w in sorted(glob.glob(str(wheel_dir / "*.whl"))) if installable_here(Path(w).name)]
    if not wheels:
        raise SystemExit(f"megatron-core is not importable and {wheel_dir} holds no wheels: put the "
                         "megatron_core-0.16.1 wheel for this Python (and any missing pure dependencies) there")
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--target", SITE,
                    *wheels], check=True)
    env["PYTHONPATH"] = os.pathsep.join([SITE, env["PYTHONPATH"]])
    sys.path.insert(0, SITE)
    return env


def installable_here(wheel: str) -> bool:
    """A wheel file name this interpreter can install: pure (py3-none-any) or built for its CPython version, so `.whl/`
    may carry the same package for several Pythons (the lent machine's Python is not known ahead)."""
    python = f"cp{sys.version_info.major}{sys.version_info.minor}"
    tags = wheel[:-len(".whl")].split("-")[-3:]  # python tag, ABI tag, platform tag
    return tags[0] in ("py3", "py2.py3") or python in tags[0].split(".")


def versions(env: dict) -> dict:
    """GPU, torch, CUDA, NCCL, megatron-core and Transformer Engine, read in a subprocess with `env`."""
    code = ("import json, torch, importlib.util\n"
            "from importlib.metadata import version\n"
            "cuda = torch.cuda.is_available()\n"
            "print(json.dumps({'gpu': torch.cuda.get_device_name() if cuda else 'none (CPU)',\n"
            " 'gpus': torch.cuda.device_count(), 'torch': torch.__version__, 'cuda': torch.version.cuda,\n"
            " 'nccl': '.'.join(map(str, torch.cuda.nccl.version())) if cuda else None,\n"
            " 'megatron_core': version('megatron-core'),\n"
            " 'transformer_engine': importlib.util.find_spec('transformer_engine') is not None}))")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def error_line(proc) -> list:
    """The line that names the failure: the last one mentioning an error (torchrun ends on a '====' banner)."""
    lines = (proc.stderr or proc.stdout or "").strip().splitlines()
    named = [line for line in lines if "Error" in line or "error:" in line]
    return (named or lines)[-1:] or ["(no output)"]


def last_record(run_dir: Path) -> dict:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return json.loads(lines[-1]) if lines else {}


def train_row(label: str, overrides: list, nproc: int, env: dict, index: int, steps: int, timeout: float) -> dict:
    """torchrun of `python -m pretrain` on configs/tiny.toml with `nproc` ranks (TP 1 × DP nproc)."""
    run_dir = REPO / "runs/gpu-check" / f"row{index}"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           "-m", "pretrain", "--config", "configs/tiny.toml", "parallel.tensor=1", "logging.wandb=false",
           "logging.tensorboard=false",
           f"train.steps={steps}", "train.eval_interval=0", f"logging.log_interval={steps}",
           "train.save_final=false", "train.resume=false", f"logging.run_dir=\"{run_dir}\"",
           f"train.global_batch_size={4 * nproc}", *overrides]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
    row = {"row": label, "world": nproc, "wall_s": time.perf_counter() - t0, "rc": proc.returncode}
    if proc.returncode != 0:
        row["error"] = error_line(proc)
        return row
    rec = last_record(run_dir)
    row.update(loss=rec.get("train/loss"), step_s=rec.get("perf/step_time_s"),
               tflops=rec.get("perf/tflops_per_gpu"), mfu=rec.get("perf/mfu"), hfu=rec.get("perf/hfu"),
               max_allocated=rec.get("mem/max_allocated_bytes"), loss_scale=rec.get("train/loss_scale"))
    return row


def probe_row(name: str, config: str, env: dict, dry: bool, timeout: float, overrides=(), memory_gb: int = 32,
              profile: str = "") -> dict:
    """`probe --real` of a rank slice under a `memory_gb` cap (the paper's V100s: 32), 2 steps (the second's peak
    holds the optimizer states the first made; the second timed, the first the warm-up); the dry run: fake tensors,
    2 layers, 1 step (it shows the row runs: the Llama-3 8B slice in FP8 took 24 s for 2 steps on CPU, 17 s for 1).
    `profile` (a folder; not in the dry run, whose fake tensors run no kernels): then one more step under
    torch.profiler (probe --profile), its kernels in the row and its trace in that folder."""
    cmd = [sys.executable, "-W", "ignore", "-m", "pretrain.probe", "--config", config, "--json",
           "--memory-gb", str(memory_gb), "--steps", "1" if dry else "2", *overrides]
    cmd += ["model.num_layers=2"] if dry else ["--real"] + (["--profile", profile] if profile else [])
    name = " ".join([name, *overrides])
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
    row = {"row": f"probe {name}" + (" (dry run: fake, 2 layers, 1 step)" if dry else f" --real, {memory_gb} GB cap"),
           "wall_s": time.perf_counter() - t0, "rc": proc.returncode}
    try:
        out = json.loads(proc.stdout)
    except json.JSONDecodeError:
        row["error"] = error_line(proc)
        return row
    row["verdict"] = out["verdict"]["text"]
    run = out.get("run", {})
    row["peak_bytes"] = run.get("cuda_max_allocated") or run.get("peak_bytes")
    row["peak_phase"] = run.get("peak_phase")
    row["step_s"] = (out.get("timing") or {}).get("compute_s_per_step")
    row["tflops"] = (out.get("timing") or {}).get("tflops_per_rank_measured")
    row["mfu"] = (out.get("timing") or {}).get("mfu")
    row["hfu"] = (out.get("timing") or {}).get("hfu")
    row["predicted_job_tflops"] = (out.get("timing") or {}).get("predicted_job_tflops_per_gpu")
    row["phase_s"] = (out.get("timing") or {}).get("phase_s_per_step")
    row["profile"] = run.get("profile")
    row["step_walls"] = run.get("step_seconds")  # every step's, the warm-up's included: what timing leaves out
    return row


def fmt(value, spec: str) -> str:
    return "—" if value is None else format(value, spec)


MEASURED = "measured row: "  # bench/bench_gpu.py's line for each row as it is measured (on stderr)


class BenchCut(Exception):
    """bench_gpu.py stopped at the time budget: the table of the rows it had measured (`text`)."""

    def __init__(self, rows: list, what: str):
        super().__init__(what)
        lines = [f"{what}: stopped at the time budget after {len(rows)} row(s); those measured:", "",
                 "| row | tokens/s | ÷ compiled plain | TFLOP/s | MFU | peak GiB | estimate GiB | step s | loss |",
                 "|---|---|---|---|---|---|---|---|---|"]
        plain = {r["shape"]: r["tokens_per_s"] for r in rows if r["row"].startswith("plain PyTorch")
                 and r["row"].endswith("compiled") and "tokens_per_s" in r}
        for r in rows:
            if "tokens_per_s" not in r:
                lines.append(f"| {r.get('row')} (rc {r.get('rc')}: {r.get('error')}) | — | — | — | — | — | — | — | — |")
                continue
            peak = r["peak_bytes"] / 2**30 if r.get("peak_bytes") else None
            speed = r["tokens_per_s"] / plain[r["shape"]] if r.get("shape") in plain else None
            estimate = r["estimate_bytes"] / 2**30 if r.get("estimate_bytes") else None
            lines.append(f"| {r['row']} | {r['tokens_per_s']:.0f} | {fmt(speed, '.3f')} | {fmt(r.get('tflops'), '.3g')} | "
                         f"{fmt(r.get('mfu'), '.1%')} | {fmt(peak, '.2f')} | {fmt(estimate, '.2f')} | {r['step_s']:.4f} | "
                         f"{r['loss']:.4f} |")
        self.text = "\n".join(lines) + "\n"


def measured_rows(stderr) -> list:
    """The rows bench_gpu.py printed as it measured them, from its captured stderr (bytes after a timeout)."""
    text = stderr.decode(errors="replace") if isinstance(stderr, bytes) else (stderr or "")
    return [json.loads(line[len(MEASURED):]) for line in text.splitlines() if line.startswith(MEASURED)]


def bench_table(env: dict, dry: bool, quick: bool, timeout: float, extra: tuple = ()) -> str:
    """bench/bench_gpu.py's table (zero3d beside the plain-PyTorch models; the rank slices in bf16 and fp16), with
    bench_gpu's `extra` arguments."""
    cmd = ([sys.executable, "-W", "ignore", "bench/bench_gpu.py"] + (["--cpu-dry-run", "--steps", "1"] if dry else [])
           + (["--quick"] if quick else []) + list(extra))
    try:
        proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as err:  # the rows measured before the budget ran out are kept
        raise BenchCut(measured_rows(err.stderr), f"bench/bench_gpu.py {' '.join(extra)}") from None
    if proc.returncode != 0:
        return f"bench/bench_gpu.py {' '.join(extra)} failed (rc {proc.returncode}): " + error_line(proc)[0] + "\n"
    return proc.stdout


def write_report(path: Path, info: dict, rows: list, skipped: list, started: float, bench: str = "") -> None:
    lines = ["# GPU check", "",
             f"GPU: **{info['gpu']}** × {info['gpus']}; torch {info['torch']}, CUDA {info['cuda']}, "
             f"NCCL {info['nccl']}, megatron-core {info['megatron_core']}, Transformer Engine "
             f"{'importable' if info['transformer_engine'] else 'not importable'}; "
             f"total wall {time.perf_counter() - started:.0f} s.", "",
             "| row | world | rc | loss | loss scale | step s | TFLOP/s/GPU | MFU | HFU | max allocated GiB | wall s |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if r["row"].startswith("probe"):
            continue
        lines.append(f"| {r['row']} | {r['world']} | {r['rc']} | {fmt(r.get('loss'), '.4f')} | "
                     f"{fmt(r.get('loss_scale'), 'g')} | {fmt(r.get('step_s'), '.4f')} | {fmt(r.get('tflops'), '.3g')} | "
                     f"{fmt(r.get('mfu'), '.1%')} | {fmt(r.get('hfu'), '.1%')} | "
                     f"{fmt(r['max_allocated'] / 2**30 if r.get('max_allocated') else None, '.2f')} | "
                     f"{r['wall_s']:.0f} |" + (f" error: {r['error'][0]}" if "error" in r else ""))
    lines += ["", "| probe | rc | peak GB | peak phase | compute s/step | TFLOP/s rank | MFU | HFU | predicted job TFLOP/s/GPU | "
              "phase s | steps' wall s (the first: the warm-up) | wall s |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if not r["row"].startswith("probe"):
            continue
        phases = ", ".join(f"{k} {v:.2f}" for k, v in (r.get("phase_s") or {}).items()) or "—"
        lines.append(f"| {r['row']} | {r['rc']} | {fmt(r['peak_bytes'] / 1e9 if r.get('peak_bytes') else None, '.2f')} | "
                     f"{r.get('peak_phase') or '—'} | {fmt(r.get('step_s'), '.3f')} | {fmt(r.get('tflops'), '.1f')} | "
                     f"{fmt(r.get('mfu'), '.1%')} | {fmt(r.get('hfu'), '.1%')} | {fmt(r.get('predicted_job_tflops'), '.1f')} | "
                     f"{phases} | {', '.join(f'{s:.2f}' for s in r.get('step_walls') or ()) or '—'} | "
                     f"{r['wall_s']:.0f} |")
        lines.append(f"|  | {r.get('verdict') or ('error: ' + r.get('error', ['?'])[0])} |||||||||||")
    profiled = [r for r in rows if r.get("profile")]
    if profiled:
        sys.path.insert(0, str(REPO))  # the project's own summary of a profile (bench_gpu's too)
        from pretrain.probe.kernels import profile_table
        lines += ["", "## Where the probed slices' step time goes (probe --profile: one step after the timed ones)", "",
                  profile_table(profiled).rstrip()]
    if skipped:
        lines += ["", "Skipped: " + "; ".join(skipped)]
    if bench:
        lines += ["", "## Throughput per rank: zero3d beside plain PyTorch (bench/bench_gpu.py)", "", bench.rstrip()]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines) + "\n")


def plan_rows(info: dict, quick: bool, dry: bool) -> tuple[list, list]:
    """(training rows as (label, overrides, world), skipped reasons)."""
    stage_rows = [STAGE_ROWS[0], STAGE_ROWS[4], STAGE_ROWS[5]] if quick else STAGE_ROWS
    rows = [(label, ov, 1) for label, ov in stage_rows] + [(PA_CPU_ROW[0], PA_CPU_ROW[1], 1)]
    skipped = []
    gpus = info["gpus"] if not dry else 2
    if gpus > 1:
        rows += [(f"{label} (NCCL world {gpus})" if not dry else f"{label} (gloo world 2)", ov, gpus)
                 for label, ov in ([STAGE_ROWS[4]] if quick else [STAGE_ROWS[0], STAGE_ROWS[4], STAGE_ROWS[5]])]
    else:
        skipped.append("world 2+: one GPU on this machine")
    if info["transformer_engine"] and not dry:
        rows.append((TE_ROW[0], TE_ROW[1], 1))
    else:
        skipped.append("Transformer Engine row: transformer_engine is not importable" if not info["transformer_engine"]
                       else "Transformer Engine row: CUDA only")
    return rows, skipped


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python tools/gpu_check.py", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="one row of each kind (about half the time)")
    ap.add_argument("--cpu-dry-run", action="store_true", help="the same rows on CPU/gloo, probes in fake mode")
    ap.add_argument("--no-bench", action="store_true", help="leave out bench/bench_gpu.py's table (run it apart)")
    ap.add_argument("--parity", action="store_true",
                    help="the parity and FP8 rows first (issues #55, #58): the Llama shape through zero3d eager and "
                         "compiled at stages 2 and 3 and in FP8 beside the plain model, the Llama-3 8B rank slice as "
                         "its recipe runs and with selective recomputation compiled (bf16, FP8), then the GPT shape")
    ap.add_argument("--out", default=str(REPO / "runs/gpu-check/report.md"))
    ap.add_argument("--budget-s", type=float, default=BUDGET_S,
                    help=f"stop starting rows after this many seconds (default {BUDGET_S:.0f})")
    args = ap.parse_args(argv)
    if args.budget_s <= 0:
        ap.error(f"--budget-s {args.budget_s} is invalid; must be > 0")
    started = time.perf_counter()
    if args.parity:
        return parity(args, started)
    env = ensure_megatron()
    if args.cpu_dry_run:
        env["CUDA_VISIBLE_DEVICES"] = ""  # torch sees no GPU: pretrain picks gloo and the CPU
    info = versions(env)
    if not args.cpu_dry_run and info["gpus"] == 0:
        raise SystemExit("no CUDA device visible: run on a GPU machine, or use --cpu-dry-run")
    steps = 2 if args.cpu_dry_run else STEPS
    rows, skipped = plan_rows(info, args.quick, args.cpu_dry_run)
    probes = PROBES[:1] if args.quick else PROBES
    # Order: two training rows (the stack works on CUDA), then the probes (the heaviest, most wanted
    # rows), then the rest; rows that would start past the budget are listed as skipped.
    jobs = ([("train", i, row) for i, row in enumerate(rows[:2])] + [("probe", None, p) for p in [LLAMA_PROBE, *probes]]
            + [("train", i + 2, row) for i, row in enumerate(rows[2:])])
    results = []
    for kind, index, job in jobs:
        label = job[0] if kind == "train" else f"probe {job[0]}"
        left = args.budget_s - (time.perf_counter() - started)
        if left < 30:
            skipped.append(f"{label}: time budget")
            continue
        try:
            if kind == "train":
                results.append(train_row(job[0], job[1], job[2], env, index, steps, timeout=left))
            else:
                results.append(probe_row(job[0], job[1], env, args.cpu_dry_run, timeout=left, memory_gb=(job + (32,))[2]))
        except subprocess.TimeoutExpired:
            skipped.append(f"{label}: did not finish inside the time budget")
            continue
        print(json.dumps(results[-1], default=str), flush=True)
    bench, left = "", args.budget_s - (time.perf_counter() - started)
    if args.no_bench:
        skipped.append("bench/bench_gpu.py: --no-bench")
    elif left >= 60:
        try:
            bench = bench_table(env, args.cpu_dry_run, args.quick, timeout=left)
        except BenchCut as cut:
            bench = cut.text
            skipped.append("bench/bench_gpu.py: did not finish inside the time budget (the rows it measured: above)")
    else:
        skipped.append("bench/bench_gpu.py: time budget")
    write_report(Path(args.out), info, results, skipped, started, bench)
    print(f"wrote {args.out}")
    return 0 if all(r["rc"] in (0, 1) if r["row"].startswith("probe") else r["rc"] == 0 for r in results) else 1


# The 8B rank slice as the parity issue measures it: the planner's recompute policy (selective, which fits its 80 GB)
# with compiled layers, in bf16 and FP8; the recipe as written (full recomputation, model.compile auto: compiled layers
# on CUDA) beside them. The selective pair is profiled (PROFILED_PROBES): FP8 ran that slice at 0.71x bf16's speed.
PARITY_PROBES = [("Llama-3 8B recipe", []),
                 ("Llama-3 8B selective compiled", ['model.recompute="selective"', "model.compile=true"]),
                 ("Llama-3 8B selective compiled FP8", ['model.recompute="selective"', "model.compile=true",
                                                        'precision.fp8="tensorwise"'])]
# --parity's order, each part for what it alone measures: the recipe's probe (the estimate against the GPU's peak),
# the Llama bench (zero3d at stages 2 and 3 and in FP8 beside the compiled plain model), the other probes (the
# slice's MFU, bf16 and FP8), the GPT bench. A bench part may run until LATER_S seconds of the budget are left for
# what follows it; stopped there, it keeps the rows it measured.
PARITY_ORDER = ("probe Llama-3 8B recipe", "bench Llama", "bench loss", "probe Llama-3 8B selective compiled",
                "probe Llama-3 8B selective compiled FP8", "bench GPT")
# bench/bench_loss.py at the Llama shapes' output layer (8192 tokens, hidden 2048, the 128K vocabulary, bf16): the fused
# loss eager and with model.compile's softmax kernels, time and CUDA peak, beside megatron's and the recomputed loss
LOSS_BENCH = ["--device", "cuda", "--dtype", "bf16", "--vocab", "128256", "--tokens", "8192", "--hidden", "2048"]
LOSS_DRY = ["--device", "cpu", "--dtype", "bf16", "--vocab", "512", "--tokens", "64", "--hidden", "16", "--chunk", "32",
            "--steps", "1"]
LOSS_S = 90
# The Llama bench's rows whose kernels --parity profiles (bench_gpu --profile: kernels by kind, and those outside the
# model's GEMMs, attention and compiled code by the op that launched them): FP8 against its bf16 row and the compiled
# plain model, where #58's time goes (the FP8 rows at 1.08x bf16, not 1.3x)
PROFILED_ROWS = ("(compiled, stage 2)", "PyTorch Llama, compiled")
PROFILED_PROBES = ("Llama-3 8B selective compiled", "Llama-3 8B selective compiled FP8")
LATER_S = 180
# The 8B slice's FP8 ceiling (bench/fp8_ceiling.py: its linears' GEMMs in bf16 and float8 against the bf16 probe's
# step), after the pair of selective probes it compares: (bf16 probe, FP8 probe)
FP8_PAIR = ("Llama-3 8B selective compiled", "Llama-3 8B selective compiled FP8")
CEILING_S = 60


def fp8_ceiling_part(env: dict, bf16_row: dict, fp8_row: dict, timeout: float) -> str:
    """bench/fp8_ceiling.py for the 8B slice (its config's linears, 8 micro-batches a step), against the bf16 probe's
    steady step and beside the FP8 probe's; a line saying why where the bf16 probe has no step time."""
    bf16, fp8 = bf16_row.get("step_s"), fp8_row.get("step_s")
    if not bf16:
        return f"FP8 ceiling of the 8B slice not measured: the probe '{FP8_PAIR[0]}' has no step time\n"
    cmd = [sys.executable, "-W", "ignore", "bench/fp8_ceiling.py", "--config", LLAMA_PROBE[1], "--bf16-step-s",
           str(bf16), "--recipe", "tensorwise", *(["--fp8-step-s", f"tensorwise={fp8}"] if fp8 else [])]
    try:
        proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return f"bench/fp8_ceiling.py did not finish inside {timeout:.0f} s\n"
    return proc.stdout if proc.returncode == 0 else (f"bench/fp8_ceiling.py failed (rc {proc.returncode}): "
                                                     f"{error_line(proc)[0]}\n")


def parity(args, started: float) -> int:
    """--parity: the 8B slice's probes and bench_gpu's Llama (with FP8) and GPT rows in PARITY_ORDER, while the budget
    lasts -> the report."""
    env = ensure_megatron()
    if args.cpu_dry_run:
        env["CUDA_VISIBLE_DEVICES"] = ""
    info = versions(env)
    if not args.cpu_dry_run and info["gpus"] == 0:
        raise SystemExit("no CUDA device visible: run on a GPU machine, or use --cpu-dry-run")
    steps = ["--steps", "1" if args.cpu_dry_run else "8"]
    parts, results, skipped, probed = [], [], [], {}

    def left() -> float:
        return args.budget_s - (time.perf_counter() - started)
    profiled = [arg for text in PROFILED_ROWS for arg in ("--profile-row", text)]
    parts_by_name = {"bench Llama": ["--shapes", "llama", "--fp8", "--no-probes", *steps,
                                     "--profile", str(Path(args.out).parent / "profiles"), *profiled],
                     **{f"probe {name}": overrides for name, overrides in PARITY_PROBES},
                     "bench GPT": ["--shapes", "gpt", "--no-probes", *steps],
                     "bench loss": LOSS_DRY if args.cpu_dry_run else LOSS_BENCH}
    for name in PARITY_ORDER:
        extra = parts_by_name[name]
        if left() < 60:
            skipped.append(f"{name}: time budget")
            continue
        try:
            if name == "bench loss":
                cmd = [sys.executable, "-W", "ignore", "bench/bench_loss.py", *extra]
                proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True,
                                      timeout=min(LOSS_S, left()))
                parts.append(proc.stdout if proc.returncode == 0 else
                             f"bench/bench_loss.py failed (rc {proc.returncode}): {error_line(proc)[0]}\n")
            elif name.startswith("bench"):
                last = name == PARITY_ORDER[-1]
                timeout = left() if last else max(60.0, left() - LATER_S)
                try:
                    parts.append(bench_table(env, args.cpu_dry_run, False, timeout=timeout, extra=tuple(extra)))
                except BenchCut as cut:
                    parts.append(cut.text)
                    skipped.append(f"{name}: stopped at the time budget (the rows it measured are in the report)")
            else:
                probe = name[len("probe "):]
                profile = "" if args.cpu_dry_run or probe not in PROFILED_PROBES else str(
                    Path(args.out).parent / "profiles" / "".join(c if c.isalnum() else "_" for c in probe))
                results.append(probe_row(probe, LLAMA_PROBE[1], env, args.cpu_dry_run, timeout=left(),
                                         overrides=extra, memory_gb=LLAMA_PROBE[2], profile=profile))
                print(json.dumps(results[-1], default=str), flush=True)
                probed[probe] = results[-1]
                if probe == FP8_PAIR[1] and not args.cpu_dry_run:
                    parts.append(fp8_ceiling_part(env, probed.get(FP8_PAIR[0], {}), probed[probe],
                                                  timeout=min(CEILING_S, left())))
        except subprocess.TimeoutExpired:
            skipped.append(f"{name}: did not finish inside the time budget")
    write_report(Path(args.out), info, results, skipped, started, "\n".join(parts))
    print(f"wrote {args.out}")
    return 0 if all(r["rc"] in (0, 1) for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
