"""Training-loop metrics: throughput, MFU and HFU (FLOPs: model_shape.flops), memory, and the console/JSONL/W&B sinks."""
import json
import os
import re
import sys
import time
from pathlib import Path
from typing import Optional

import psutil

from pretrain.atomic import write_atomically
from analysis.gpus import GPU_KINDS
from model_shape.flops import StepFlops


# Dense (no sparsity) peak TFLOP/s per GPU, bf16/fp16 tensor-core and plain fp32 (what fp32 matmuls get with
# TF32 off, torch's default), and float8 ("fp8") where the GPU has it: one table, analysis.gpus's GPU kinds
# (the planner reads the same).
# V100 has no bf16; PCIe cards run lower clocks, so they have their own rows.
PEAK_TFLOPS: dict[str, dict[str, float]] = {key: gpu.peak_tflops() for key, gpu in GPU_KINDS.items()}

# First match wins. Variants whose peaks differ and are not in the table (H100/H200 NVL, V100S,
# GH200) must map to nothing: no MFU beats a wrong MFU.
_GPU_PATTERNS = [
    (re.compile(r"\bNVL\b|V100S|GH200"), None),
    (re.compile(r"\bV100\b.*PCIE"), "V100-PCIe"),
    (re.compile(r"\bV100\b"), "V100"),
    (re.compile(r"\bA100\b"), "A100"),
    (re.compile(r"\bH100\b.*PCIE"), "H100-PCIe"),
    (re.compile(r"\bH100\b"), "H100"),
    (re.compile(r"\bH200\b"), "H200"),
]


def detect_gpu(name: str) -> Optional[str]:
    """PEAK_TFLOPS key for a torch.cuda.get_device_name() string, e.g. "NVIDIA H100 80GB HBM3" → "H100"."""
    upper = name.upper()
    for pattern, key in _GPU_PATTERNS:
        if pattern.search(upper):
            return key
    return None


def peak_tflops(gpu_key: Optional[str], dtype: str) -> Optional[float]:
    """Dense peak TFLOP/s for a PEAK_TFLOPS key and "bf16" | "fp16" | "fp32" | "fp8"; None when unknown (CPU)."""
    if gpu_key is None:
        return None
    return PEAK_TFLOPS.get(gpu_key, {}).get(dtype)


def peak_dtype(dtype: str, fp8: str = "none") -> str:
    """The peak MFU and HFU divide by: the training dtype's, or with precision.fp8 on the float8 peak (the
    layers' GEMMs run there; the attention core and the logits still run in bf16, so such an MFU is conservative)."""
    return "fp8" if fp8 != "none" else dtype


def device_peak_tflops(device_type: str, dtype: str) -> Optional[float]:
    """Peak of the GPU this process runs on; None on CPU or on a GPU missing from the table."""
    if device_type != "cuda":
        return None
    import torch
    return peak_tflops(detect_gpu(torch.cuda.get_device_name()), dtype)


def throughput_metrics(step_time_s: float, tokens_per_step: int, world_size: int,
                       flops: StepFlops, peak: Optional[float]) -> dict:
    """tokens/s; TFLOP/s per GPU (hardware FLOPs, recomputation included: the paper's convention) and the model
    FLOPs' (each matmul of forward and backward once); MFU and HFU (each / the dense peak, if known)."""
    hardware = flops.hardware / step_time_s / world_size / 1e12
    model = flops.model / step_time_s / world_size / 1e12
    record = {
        "perf/step_time_s": step_time_s,
        "perf/tokens_per_s": tokens_per_step / step_time_s,
        "perf/tokens_per_s_per_gpu": tokens_per_step / step_time_s / world_size,
        "perf/tflops_per_gpu": hardware,
        "perf/model_tflops_per_gpu": model,
    }
    if peak is not None:
        record["perf/mfu"] = model / peak
        record["perf/hfu"] = hardware / peak
    return record


def memory_report(device_type: str, state_bytes: dict[str, int]) -> dict:
    """`mem/<category>_bytes` for the engine's state, plus the CUDA peaks (on GPU) or process RSS (on CPU)."""
    record = {f"mem/{name}_bytes": int(size) for name, size in state_bytes.items()}
    if device_type == "cuda":
        import torch
        # Peaks since process start: the step's high-water mark, which is what decides an OOM.
        record["mem/max_allocated_bytes"] = torch.cuda.max_memory_allocated()
        record["mem/max_reserved_bytes"] = torch.cuda.max_memory_reserved()
        # the caching allocator's counters since process start: a retry frees its cached blocks and allocates again
        # (fragmentation near the limit), an OOM is an allocation that failed even then
        stats = torch.cuda.memory_stats()
        record["mem/alloc_retries"] = int(stats.get("num_alloc_retries", 0))
        record["mem/ooms"] = int(stats.get("num_ooms", 0))
    else:
        record["mem/rss_bytes"] = psutil.Process().memory_info().rss
    return record


def bandwidth_report(comm: dict) -> dict:
    """Achieved bandwidth of zero3d's collectives this step, from CommStats' report (`comm`): bytes sent ÷ their
    summed launch→completion seconds, in GB/s — over all of them and, where the bytes are split per link, each
    link's bytes over the same seconds. Nothing before any collective was timed."""
    seconds = comm.get("comm/time/seconds")
    if not seconds:
        return {}
    out = {"comm/time/gbps": comm["comm/total/bytes"] / seconds / 1e9}
    for link in ("intra", "inter"):
        if f"comm/{link}_node_bytes" in comm:
            out[f"comm/time/{link}_node_gbps"] = comm[f"comm/{link}_node_bytes"] / seconds / 1e9
    return out


# ---------------------------------------------------------------- sinks


def clock_text(seconds: float) -> str:
    """H:MM:SS of a duration (rounded to the second)."""
    hours, rest = divmod(int(round(seconds)), 3600)
    return f"{hours}:{rest // 60:02d}:{rest % 60:02d}"


def format_record(record: dict, eta_s: Optional[float] = None) -> str:
    """The console fields of a record, in a fixed order, skipping those it lacks; `eta_s`: the time left."""
    fields = [("train/loss", "loss", "{:.4f}"), ("val/loss", "val_loss", "{:.4f}"),
              ("train/lr", "lr", "{:.1e}"), ("train/grad_norm", "grad_norm", "{:.3g}"),
              ("train/loss_scale", "scale", "{:.0f}"), ("perf/tokens_per_s", "tok/s", "{:.0f}"),
              ("perf/tokens_per_s_per_gpu", "tok/s/GPU", "{:.0f}"), ("perf/tflops_per_gpu", "TFLOP/s/GPU", "{:.3g}")]
    parts = [f"{label} {fmt.format(record[key])}" for key, label, fmt in fields if key in record]
    parts += [f"{label} {100 * record[key]:.1f}%" for key, label in (("perf/mfu", "MFU"), ("perf/hfu", "HFU"))
              if key in record]
    memory = record.get("mem/max_allocated_bytes", record.get("mem/rss_bytes"))
    if memory is not None:
        parts.append(f"mem {memory / 2**30:.2f} GiB")
    if "perf/step_time_s" in record:
        parts.append(f"step {record['perf/step_time_s']:.3g} s")
    if eta_s is not None:
        parts.append(f"ETA {clock_text(eta_s)}")
    return " | ".join(parts)


class ConsoleSink:
    """A tqdm bar on an interactive terminal; one plain line per logged step in logs and under Slurm."""

    def __init__(self, total_steps: int, mode: str = "auto", start_step: int = 0, stream=None):
        if mode not in ("auto", "bar", "plain"):
            raise ValueError(f"console mode {mode!r} is invalid; valid modes: 'auto', 'bar', 'plain'")
        self.stream = stream or sys.stdout
        if mode == "auto":
            # Slurm output files are not terminals, but some launchers fake a TTY; a bar's carriage
            # returns would turn such a log into one unreadable line.
            interactive = self.stream.isatty() and "SLURM_JOB_ID" not in os.environ
            mode = "bar" if interactive else "plain"
        self.mode = mode
        self.total_steps = total_steps
        self.first: Optional[tuple[int, float]] = None  # (step, monotonic time) of the first step logged
        self.bar = None
        if mode == "bar":
            from tqdm import tqdm
            self.bar = tqdm(total=total_steps, initial=start_step, file=self.stream,
                            dynamic_ncols=True, unit="step")

    def eta(self, step: int, record: dict) -> Optional[float]:
        """Seconds to train.steps: the steps left × the wall time per step since the first logged step (evaluation
        and saves included); at the first, its own step time."""
        now, left = time.monotonic(), self.total_steps - step
        if self.first is None:
            self.first = (step, now)
        if step > self.first[0]:
            return left * (now - self.first[1]) / (step - self.first[0])
        return left * record["perf/step_time_s"] if "perf/step_time_s" in record else None

    def log(self, step: int, record: dict) -> None:
        text = format_record(record, self.eta(step, record))
        if self.bar is None:
            print(f"step {step}/{self.total_steps} | {text}", file=self.stream, flush=True)
            return
        if step > self.bar.n:
            self.bar.update(step - self.bar.n)
        if any(key.startswith("val/") for key in record):
            self.bar.write(f"step {step}/{self.total_steps} | {text}", file=self.stream)
        else:
            self.bar.set_postfix_str(text)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


class TensorBoardSink:
    """TensorBoard event files in <run_dir>/tensorboard (torch.utils.tensorboard's SummaryWriter): every numeric key
    of a record (booleans as 0/1) as a scalar at its step, the same keys as metrics.jsonl's; TensorBoard stores
    float32. Flushed at every log, as the JSONL line is written at once."""

    DIR = "tensorboard"

    def __init__(self, run_dir: str | Path):
        from torch.utils.tensorboard import SummaryWriter
        self.writer = SummaryWriter(log_dir=str(Path(run_dir) / self.DIR))

    def log(self, step: int, record: dict) -> None:
        for key, value in record.items():
            value = value.item() if hasattr(value, "item") else value
            if isinstance(value, (bool, int, float)):
                self.writer.add_scalar(key, float(value), step)
        self.writer.flush()

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
            self.writer = None


def _json_value(value):
    # Tensors and numpy scalars slip into records; .item() makes them plain numbers.
    if hasattr(value, "item"):
        return value.item()
    raise TypeError(f"metric value {value!r} of type {type(value).__name__} is not JSON-serializable")


class JsonlSink:
    """Appends one JSON object per log call ({"step", "time", **record}) to a metrics.jsonl file.

    The file is opened O_APPEND and each line goes out in a single write, so a crash never leaves a
    half line and a resumed run continues the same file; steps logged after the last checkpoint
    appear twice after a resume (the later record of a step is the one that counts).
    """

    def __init__(self, path: str | Path, fsync: bool = False):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.fsync = fsync
        self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)

    def log(self, step: int, record: dict) -> None:
        line = json.dumps({"step": step, "time": time.time(), **record}, default=_json_value) + "\n"
        data = line.encode()
        while data:  # os.write may return short; finish the same line before anything else
            data = data[os.write(self._fd, data):]
        if self.fsync:
            os.fsync(self._fd)

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


WANDB_MODES = ("online", "offline", "disabled", "dryrun", "shared", "run")  # what wandb's settings accept


def wandb_mode(environ) -> Optional[str]:
    """None (wandb reads WANDB_MODE itself) if it is set; else online with an API key, offline without.
    A WANDB_MODE wandb would refuse is an InputError (the launch environment)."""
    if "WANDB_MODE" in environ:
        if environ["WANDB_MODE"] not in WANDB_MODES:
            from pretrain.errors import InputError
            raise InputError(f"WANDB_MODE = {environ['WANDB_MODE']!r} is invalid", "environment",
                             f"set it to one of {', '.join(WANDB_MODES)}, or unset it, or set logging.wandb=false")
        return None
    return "online" if environ.get("WANDB_API_KEY") else "offline"


class WandbSink:
    """A Weights & Biases run: offline unless WANDB_MODE says otherwise or an API key is present."""

    ID_FILE = "wandb_run_id"  # in run_dir: lets a resumed run continue the same W&B run

    def __init__(self, project: str, name: str, group: Optional[str], config: dict,
                 run_dir: str | Path, resume_id: Optional[str] = None):
        try:
            import wandb
        except ImportError as err:
            raise RuntimeError("logging.wandb = true but wandb is not importable; install it "
                               "(pip install wandb==0.31.0) or set logging.wandb=false") from err
        self._wandb = wandb
        run_dir = Path(run_dir)
        run_dir.mkdir(parents=True, exist_ok=True)
        kwargs = {}
        mode = wandb_mode(os.environ)
        if mode is not None:
            kwargs["mode"] = mode
        if resume_id is not None:
            kwargs.update(id=resume_id, resume="allow")
        self.run = wandb.init(project=project, name=name, group=group, config=config,
                              dir=str(run_dir), **kwargs)
        write_atomically(run_dir / self.ID_FILE, self.run.id + "\n")  # a resume finds the whole id or none

    def log(self, step: int, record: dict) -> None:
        self.run.log(record, step=step)

    def set_summary(self, values: dict) -> None:
        for key, value in values.items():
            self.run.summary[key] = value

    def close(self) -> None:
        if self.run is not None:
            self.run.finish()
            # finish() can return before wandb-core has written the offline store (seen in ~1 of 20
            # runs); teardown waits for the service to exit, so the run files are complete here.
            self._wandb.teardown()
            self.run = None


class MetricsLogger:
    """Fans each record out to its sinks; with no sinks (ranks ≠ 0) every call does nothing."""

    def __init__(self, sinks: list):
        self.sinks = list(sinks)

    def log(self, step: int, record: dict) -> None:
        for sink in self.sinks:
            sink.log(step, record)

    def set_summary(self, values: dict) -> None:
        for sink in self.sinks:
            if hasattr(sink, "set_summary"):
                sink.set_summary(values)

    def close(self) -> None:
        for sink in self.sinks:
            sink.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def make_logger(rank: int, run_dir: str | Path, config_dict: dict, total_steps: int,
                console_mode: str, use_wandb: bool, wandb_project: str, wandb_name: str,
                wandb_group: Optional[str], start_step: int = 0, use_tensorboard: bool = False) -> MetricsLogger:
    """Rank 0: console + <run_dir>/metrics.jsonl (+ W&B, + TensorBoard); other ranks: a logger that does nothing.

    start_step > 0 means the run resumed from a checkpoint: the bar starts there and W&B continues
    the run recorded in <run_dir>/wandb_run_id, if there is one.
    """
    if rank != 0:
        return MetricsLogger([])
    run_dir = Path(run_dir)
    sinks = []
    if use_wandb:  # first: wandb.init prints, and a bar already on screen would be torn by it
        id_file = run_dir / WandbSink.ID_FILE
        resume_id = id_file.read_text().strip() if start_step > 0 and id_file.is_file() else None
        sinks.append(WandbSink(wandb_project, wandb_name, wandb_group, config_dict, run_dir, resume_id))
    sinks.append(JsonlSink(run_dir / "metrics.jsonl"))
    if use_tensorboard:
        sinks.append(TensorBoardSink(run_dir))
    sinks.append(ConsoleSink(total_steps, console_mode, start_step=start_step))
    return MetricsLogger(sinks)
