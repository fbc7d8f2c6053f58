"""The probe's two commands: one config's rank (tables, verdict, --real timing) and the --max-model search."""
import dataclasses
import json
import time
from pathlib import Path

from pretrain import metrics
from pretrain.config import Config, load_config
from pretrain.memory_check import config_job
from pretrain.model.gpt import compiles_layers
from pretrain.probe.kernels import profile_table
from pretrain.probe.rank import probe_rank, rss_bytes
from analysis.cluster import links_for_gpu
from analysis.comm_model import comm_breakdown
from analysis.estimate import DEFAULT_MARGIN_FRACTION, GB, gpt_param_count
from analysis.memory_report import device_memory
from analysis.planner import MP_STUDY, PAPER_CONFIGS, max_model_size
from pretrain.probe.report import (PAPER_FIG2_TFLOPS, device_bytes, estimate_rows, extrapolate_phases,
                                          format_comparison, judge)
from analysis.paper_configs import PAPER_TARGETS_B


def timing_report(cfg: Config, world: int, run) -> dict:
    """--real: per-rank compute time (the timed steps': all but the warm-up's first of two or more), TFLOP/s, MFU and
    the α-β prediction of the whole job's step."""
    m = cfg.model
    compute = sum(run.phase_seconds.values()) / run.timed_steps
    flops = m.flops_per_step(cfg.parallel.tensor, cfg.train.global_batch_size)
    on_gpu = run.cuda_max_allocated is not None
    per_step_comm = predicted = None
    if not (on_gpu and world > 1):  # a GPU rank runs without the dispatch tracker, which logs the collectives
        # the config's GPU's node (cluster.gpu: DGX-2 for V100, DGX A100/H100/H200) at its GPUs per node
        per_step_comm = comm_breakdown(run.collectives, links_for_gpu(cfg.cluster.gpu, cfg.cluster.gpus_per_node))
        per_step_comm = {k: v / run.steps for k, v in per_step_comm.items()}
        predicted = compute + sum(per_step_comm.values())
    peak = metrics.device_peak_tflops("cuda" if on_gpu else "cpu",
                                      metrics.peak_dtype(cfg.precision.dtype, cfg.precision.fp8))
    tflops, model_tflops = flops.hardware / world / compute / 1e12, flops.model / world / compute / 1e12
    return {"compute_s_per_step": compute, "timed_steps": run.timed_steps, "warmup_timed": run.timed_steps == run.steps,
            "phase_s_per_step": {k: v / run.timed_steps for k, v in run.phase_seconds.items()},
            "tflops_per_rank_measured": tflops, "mfu": model_tflops / peak if peak else None,
            "hfu": tflops / peak if peak else None, "comm_s_per_step": per_step_comm, "predicted_job_step_s": predicted,
            "predicted_job_tflops_per_gpu": flops.hardware / world / predicted / 1e12 if predicted else None}


def probe_command(cfg: Config, world: int, args) -> int:
    import torch
    t0 = time.perf_counter()
    memory = device_bytes(args.memory_gb)
    try:
        trace = str(Path(args.profile) / f"probe_rank{args.rank}.json.gz") if args.profile else None
        run = probe_rank(cfg, world, args.rank, args.steps, real=args.real, cap_bytes=memory, profile_to=trace)
    except torch.OutOfMemoryError as err:  # --real on a GPU capped at --memory-gb: the verdict itself
        verdict = {"fits": False, "text": f"verdict: does NOT fit — out of memory on the GPU capped at "
                   f"{memory / GB:.2f} GB ({args.memory_gb:g} GiB): {str(err).splitlines()[0]}"}
        out = {"config": config_job(cfg, world, memory).describe(), "rank": args.rank, "mode": "real",
               "verdict": verdict, "probe_wall_s": time.perf_counter() - t0, "probe_rss_bytes": rss_bytes()}
        print(json.dumps(out, indent=2) if args.json else f"{out['config']}\n{verdict['text']}")
        return 1
    wall = time.perf_counter() - t0
    on_gpu = run.cuda_max_allocated is not None  # model states (the engine's count) and the allocator's peak only
    # with offload: what stays on the device; the step as the probed rank ran it, its layers compiled or not (on
    # fake and CPU ranks model.compile "auto" leaves them eager: the loss's logits beside their fp32 copy)
    job = config_job(cfg, world, memory, compiled=compiles_layers(cfg, on_gpu))
    estimate, _ = device_memory(job)
    peak = run.cuda_max_allocated if run.cuda_max_allocated is not None else run.peak_bytes
    verdict = judge(peak, args.memory_gb)
    rows = estimate_rows(estimate, run.model_states, None if on_gpu else run.peak_by_category, peak,
                         run.host_peak_by_category.get("activations", 0))
    out = {"config": job.describe(), "rank": args.rank, "mode": "real" if args.real else "fake",
           "run": dataclasses.asdict(run), "estimate": estimate.to_dict(),
           "comparison": [{"category": n, "estimate_bytes": e, "executed_bytes": x} for n, e, x in rows],
           "verdict": dataclasses.asdict(verdict) | {"text": verdict.describe()},
           "probe_wall_s": wall, "probe_rss_bytes": rss_bytes()}
    if args.real:
        out["timing"] = timing_report(cfg, world, run)
    out["run"].pop("collectives")
    if args.json:
        print(json.dumps(out, indent=2, default=str))
    else:
        print(format_probe(out, run, rows))
    return 0 if verdict.fits else 1


HOST_PARTS = {"activations": "Pa+cpu checkpoints", "optimizer": "offloaded master + Adam moments",
              "grads": "offloaded gradient shards",
              "params": "offloaded parameter shards", "temporaries": "offload staging buffers",
              "untracked": "NVMe stream buffers"}


def format_probe(out: dict, run, rows: list) -> str:
    lines = [f"probe ({out['mode']} tensors) of rank {out['rank']}: {out['config']}",
             f"{run.steps} step(s) × {run.micro_batches} micro-batch(es); probe wall {out['probe_wall_s']:.1f} s, "
             f"RSS {out['probe_rss_bytes'] / 2**20:.0f} MiB", "",
             f"peak {run.peak_bytes / GB:.3f} GB in phase '{run.peak_phase}'; at that moment: "
             + (", ".join(f"{k} {v / GB:.3f}" for k, v in run.peak_by_category.items())
                or "(categories are tracked on CPU and fake ranks; CUDA's allocator gives the bytes)"),
             "peak per phase (GB): " + ", ".join(f"{k} {v / GB:.3f}" for k, v in run.phase_peaks.items()),
             f"host memory peak {run.host_peak_bytes / GB:.3f} GB"
             + (" (" + ", ".join(f"{HOST_PARTS.get(k, k)} {v / GB:.3f}" for k, v in run.host_peak_by_category.items() if v)
                + ")" if run.host_peak_bytes else ""),
             *([f"offload PCIe traffic per step: device→host {run.host_traffic_per_step['to_host'] / GB:.3f} GB, "
                f"host→device {run.host_traffic_per_step['to_device'] / GB:.3f} GB"]
               if any(run.host_traffic_per_step.values()) else []), "",
             format_comparison(rows), ""]
    if run.cuda_max_allocated is not None:
        lines.append(f"torch.cuda.max_memory_allocated {run.cuda_max_allocated / GB:.3f} GB")
    lines.append(out["verdict"]["text"])
    if "timing" in out:
        t = out["timing"]
        timed = ("the one step, its warm-up included (compilation, allocator growth): time the steps after it with "
                 "--steps 2 or more" if t["warmup_timed"] else
                 ("step 2" if run.steps == 2 else f"steps 2-{run.steps}")
                 + ", the first (the warm-up: compilation, allocator growth) not timed")
        lines += ["", f"timing per step (s), {timed}: "
                  + ", ".join(f"{k} {v:.3f}" for k, v in t["phase_s_per_step"].items()),
                  f"measured compute {t['compute_s_per_step']:.3f} s/step = {t['tflops_per_rank_measured']:.3g} "
                  f"TFLOP/s on this rank" + (f", MFU {t['mfu']:.1%}, HFU {t['hfu']:.1%}" if t["mfu"] else " (no peak known: CPU)"),
                  *(["α-β collectives per step: not logged on a GPU (the tracker that logs them would slow every "
                     "kernel), so no job step is predicted: the probe without --real gives them"]
                    if t["comm_s_per_step"] is None else
                    ["α-β collectives per step: " + (", ".join(f"{k} {v * 1e3:.1f} ms" for k, v in
                                                               t["comm_s_per_step"].items()) or "none"),
                     f"predicted job step {t['predicted_job_step_s']:.3f} s = "
                     f"{t['predicted_job_tflops_per_gpu']:.3g} TFLOP/s per GPU (no overlap: an upper bound on time)"])]
        if out["config"].startswith(("125 layers × hidden 8192",)):
            lines.append(f"paper Figure 2, 100B: {PAPER_FIG2_TFLOPS['100B']}")
    if run.profile:
        lines += ["", "--profile: one step after the measured ones, under torch.profiler", "",
                  profile_table([{"row": f"rank {out['rank']}", "profile": run.profile}])]
    return "\n".join(lines)


# ---------------------------------------------------------------- --max-model

STUDY_LAYERS = (4, 16)  # probed depths for the linear fit (far apart: CB bucket boundaries shift the peak by one bucket)


def study_config(layers: int, name: str) -> Config:
    """The paper's C1-C5 study shape (MP 16, 400 GPUs, batch 16 per GPU, h 8192, 64 heads, s 1024,
    GPT-2 vocabulary, fp16, full recomputation, the paper's Megatron attention: "local", whose scores the
    estimator counts) with configuration `name`'s ZeRO settings, CB and MD."""
    z = PAPER_CONFIGS[name]
    return load_config(None, [
        f"model.num_layers={layers}", f"model.hidden_size={MP_STUDY['hidden']}",
        f"model.num_attention_heads={MP_STUDY['heads']}", "model.seq_length=1024", "model.vocab_size=50257",
        "model.recompute=\"full\"", "model.attention=\"local\"", f"parallel.tensor={MP_STUDY['tp']}", f"zero.stage={z.stage}",
        f"zero.partition_activations={str(z.pa).lower()}", f"zero.cpu_checkpointing={str(z.pa_cpu).lower()}",
        "zero.contiguous_checkpointing=true", "zero.bucket_elements=50000000", "precision.dtype=\"fp16\"",
        f"train.micro_batch_size={MP_STUDY['micro_batch']}",
        f"train.global_batch_size={MP_STUDY['micro_batch'] * MP_STUDY['gpus'] // MP_STUDY['tp']}"])


def max_model_command(args) -> int:
    gpus, memory = MP_STUDY["gpus"], device_bytes(args.memory_gb)
    usable = judge(0, args.memory_gb).usable_bytes
    results = {}
    for name, z in PAPER_CONFIGS.items():
        runs = [probe_rank(study_config(n, name), gpus, 0, 2) for n in STUDY_LAYERS]
        phase, fit = extrapolate_phases(STUDY_LAYERS[0], runs[0].phase_peaks, STUDY_LAYERS[1],
                                        runs[1].phase_peaks, usable)
        est = max_model_size(stage=z.stage, pa=z.pa, pa_cpu=z.pa_cpu, gpu_memory_bytes=memory, **MP_STUDY)
        results[name] = {"paper_B": PAPER_TARGETS_B[name], "probe_layers": fit.max_layers,
                         "probe_B": gpt_param_count(fit.max_layers, MP_STUDY["hidden"], 50257, 1024) / 1e9,
                         "probe_limiting_phase": phase, "probe_per_layer_bytes": fit.per_layer, "probe_fixed_bytes": fit.fixed,
                         "estimator_layers": est.layers, "estimator_B": est.params / 1e9}
        if args.verify and fit.max_layers:
            results[name]["verified_peak_bytes"] = probe_rank(study_config(fit.max_layers, name), gpus, 0, 2).peak_bytes
    if args.json:
        print(json.dumps(results, indent=2))
        return 0
    print(f"largest model that fits {args.memory_gb:g} GB ({usable / GB:.2f} GB usable after the {DEFAULT_MARGIN_FRACTION:.0%} margin), "
          f"MP 16, 400 GPUs, batch 16 per GPU, h 8192, 64 heads; probe peaks measured at "
          f"{STUDY_LAYERS[0]} and {STUDY_LAYERS[1]} layers and extrapolated linearly in layers, phase by phase")
    print(f"{'config':<7}{'paper':>8}{'probe':>10}{'layers':>8}{'estimator':>11}{'layers':>8}"
          f"{'probe GB/layer':>16}{'fixed GB':>10}  limiting phase")
    for name, r in results.items():
        print(f"{name:<7}{r['paper_B']:>7}B{r['probe_B']:>9.1f}B{r['probe_layers']:>8}{r['estimator_B']:>10.1f}B"
              f"{r['estimator_layers']:>8}{r['probe_per_layer_bytes'] / GB:>16.4f}{r['probe_fixed_bytes'] / GB:>10.3f}  {r['probe_limiting_phase']}"
              + (f"  verified peak at {r['probe_layers']} layers: {r['verified_peak_bytes'] / GB:.2f} GB"
                 if "verified_peak_bytes" in r else ""))
    return 0
