"""A run's scaling-table figures from its metrics records: the W&B summary and the collector's row."""
import json
import statistics
from pathlib import Path


def worst_offenders(records: list, top: int = 3) -> str:
    """The summary's line: the ranks most often named a straggler, with how often and their worst ratio."""
    named: dict = {}
    for r in records:
        if "perf/straggler_rank" in r:
            key = f"rank {r['perf/straggler_rank']} ({r.get('perf/straggler_host', '?')})"
            count, worst = named.get(key, (0, 0.0))
            named[key] = (count + 1, max(worst, r["perf/slowest_ratio"]))
    checked = sum(1 for r in records if "perf/slowest_ratio" in r)
    ranked = sorted(named.items(), key=lambda kv: (-kv[1][0], -kv[1][1]))[:top]
    return "; ".join(f"{key}: {n} of {checked} intervals, worst {w:.2f}×" for key, (n, w) in ranked)


def read_records(path: Path) -> list:
    """metrics.jsonl rows by step; after a resume a step appears twice and the later record counts."""
    by_step = {}
    if path.is_file():
        for line in path.read_text().splitlines():
            if line.strip():
                record = json.loads(line)
                by_step[record["step"]] = record
    return [by_step[s] for s in sorted(by_step)]


def _median(records: list, key: str):
    values = [r[key] for r in records if r.get(key) is not None]
    return statistics.median(values) if values else None


def summary_from_records(records: list, warmup: int, world_size: int) -> dict:
    """The table's figures for one run: medians over the steps after `warmup`, peaks over all steps.

    Used by the collector and, at the end of training, by the loop for the W&B run summary
    (MetricsLogger.set_summary). If no step is past the warm-up, every logged step is used and
    "summary/warmup_only" says so: such medians include the slow first steps.
    """
    records = sorted(records, key=lambda r: r.get("step", 0))
    past = [r for r in records if r.get("step", 0) > warmup]
    measured = past or records
    tflops = _median(measured, "perf/tflops_per_gpu")
    peaks = [r.get("mem/max_allocated_bytes", r.get("mem/rss_bytes")) for r in records]
    reserved = [r["mem/max_reserved_bytes"] for r in records if "mem/max_reserved_bytes" in r]
    summary = {
        "summary/world_size": world_size,
        "summary/steps": records[-1].get("step", len(records)) if records else 0,
        "summary/measured_steps": len(measured),
        "summary/warmup_only": bool(records) and not past,
        "summary/tflops_per_gpu": tflops,
        "summary/pflops": tflops * world_size / 1000 if tflops is not None else None,
        "summary/tokens_per_s": _median(measured, "perf/tokens_per_s"),
        "summary/step_time_s": _median(measured, "perf/step_time_s"),
        "summary/mfu": _median(measured, "perf/mfu"),
        "summary/hfu": _median(measured, "perf/hfu"),
        "summary/model_tflops_per_gpu": _median(measured, "perf/model_tflops_per_gpu"),
        "summary/peak_mem_bytes": max((p for p in peaks if p is not None), default=None),
        "summary/peak_reserved_bytes": max(reserved, default=None),
        "summary/comm_elements_per_step": _median(measured, "comm/total/elements"),
        "summary/final_loss": records[-1].get("train/loss") if records else None,
    }
    summary["summary/stragglers"] = worst_offenders(records) or None  # the ranks most often named slow
    return {k: v for k, v in summary.items() if v is not None}
