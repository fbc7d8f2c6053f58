"""Sustained compute efficiency per GPU and kernel path, from measured rows: docs/gpu-check.md's and Megatron-LM's V100."""
import statistics
from dataclasses import dataclass, field
from typing import Optional

from analysis.gpus import GPU_KINDS
from model_shape.flops import StepFlops
from model_shape.gpt import GPTShape


@dataclass(frozen=True)
class KernelPath:
    """How a step's arithmetic runs, which sets the share of peak it sustains: the attention kernel (estimate's
    ATTENTION_KINDS: "local" materialises the scores, "fused" is SDPA / flash / Transformer Engine), torch.compile'd
    layers (model.compile) and float8 GEMMs (precision.fp8)."""

    attention: str = "local"
    compiled: bool = False
    float8: str = "none"

    @classmethod
    def of(cls, step) -> "KernelPath":
        """The path a Step (analysis.job) runs along."""
        return cls(step.attention, step.compiled, step.float8)

    def __str__(self) -> str:
        words = [f"{self.attention} attention", "compiled" if self.compiled else "eager"]
        return ", ".join(words + ([f"float8 {self.float8}"] if self.float8 != "none" else []))


def ideal_seconds(flops: StepFlops, recompute: str, float8: str, peak_flops: float,
                  fp8_peak_flops: Optional[float]) -> float:
    """A step's hardware FLOPs at 100% of the GPU's peaks: with `float8` (precision.fp8) the layers' linear GEMMs
    (`flops.linears`, their recomputed forward included) at the float8 peak, the rest (attention, logits) at the
    training precision's."""
    if float8 == "none":
        return flops.hardware / peak_flops
    if fp8_peak_flops is None:
        raise ValueError(f"float8 = {float8!r} needs float8 tensor cores; this GPU has none (e.g. --cluster "
                         "dgx-h100 or dgx-h200)")
    linears = flops.linears * (4 if recompute == "full" else 3) // 3
    return (flops.hardware - linears) / peak_flops + linears / fp8_peak_flops


@dataclass(frozen=True)
class MeasuredRow:
    """A step timed on a real GPU: `gpus` GPUs together ran `samples` sequences of `shape` in `step_s` seconds of
    compute (no exposed communication: one rank, or a run's step less its exposed communication)."""

    name: str  # the row's first cell in docs/gpu-check.md (or the run directory)
    section: str  # the heading of the docs/gpu-check.md section holding it (or "measured run")
    gpu: str  # analysis.gpus.GPU_KINDS key
    path: KernelPath
    shape: GPTShape
    samples: int
    step_s: float
    recompute: str = "none"  # estimate.RECOMPUTE
    loss_recompute: bool = False  # the loss chunks' output GEMM run again in backward (the loss before the fused one)
    tp: int = 1
    gpus: int = 1

    def flops(self) -> StepFlops:
        """The step's FLOPs (GPTShape.step_flops) on one of the `gpus` GPUs."""
        whole = self.shape.step_flops(self.samples, self.recompute == "full", self.tp,
                                      loss_recompute=self.loss_recompute,
                                      recomputed_attention=self.recompute == "selective"
                                      and self.path.attention == "local")
        return StepFlops(whole.model // self.gpus, whole.hardware // self.gpus, whole.linears // self.gpus)

    @property
    def efficiency(self) -> float:
        """The share of the GPU's peak the step sustained: its ideal_seconds ÷ `step_s`."""
        peaks = GPU_KINDS[self.gpu].peak_tflops()
        return ideal_seconds(self.flops(), self.recompute, self.path.float8, peaks.get("bf16", peaks["fp16"]) * 1e12,
                             peaks.get("fp8", 0) * 1e12 or None) / self.step_s


@dataclass(frozen=True)
class PublishedShare:
    """A published sustained share of peak, where no step of ours was timed."""

    name: str
    gpu: str
    path: KernelPath
    efficiency: float
    section: str = "published"


_GPT_1P3B = GPTShape(24, 2048, 16, 2048, 50257)  # bench/bench_gpu.py's SHAPE
_LLAMA_1B = GPTShape(16, 2048, 32, 4096, 128256, ffn=8192, query_groups=8, mlp="swiglu", norm="rmsnorm",
                     position_embedding="rope", bias=False)  # bench/bench_gpu.py's LLAMA_SHAPE
_LLAMA_8B = GPTShape(32, 4096, 32, 8192, 128256, ffn=14336, query_groups=8, mlp="swiglu", norm="rmsnorm",
                     position_embedding="rope", bias=False)  # configs/llama3_8b.toml's [model]
_EAGER, _COMPILED = KernelPath("fused"), KernelPath("fused", compiled=True)
_BENCH_26, _BENCH_27 = ("Throughput per rank: zero3d beside plain PyTorch", "Llama and GPT beside plain PyTorch")
_SLICE_26, _PARITY_28 = "A Llama-shaped rank slice", "Parity and FP8 on an H200, measured"
_PROFILE_28 = "Parity, FP8 and where the step's time goes"


def _h200_slice_rows(section: str, full_s: float, selective_s: float, fp8_s: float) -> tuple:
    """tools/gpu_check.py --parity's three probes of the Llama-3 8B slice on an H200 (8 samples a step): as the recipe
    runs (full recomputation, eager), selective recomputation with compiled layers, and that in FP8 tensorwise. Each
    step time is the mean of 2 steps whose first was the warm-up (the probe timed it until 2026-11-30): with compiled
    layers their compilation is in it, so those two rows' efficiencies are lower bounds."""
    return (MeasuredRow("as the recipe runs: full recomputation, eager", section, "H200", _EAGER, _LLAMA_8B, 8, full_s,
                        "full"),
            MeasuredRow('`model.recompute = "selective"`, `model.compile = true`', section, "H200", _COMPILED, _LLAMA_8B,
                        8, selective_s, "selective"),
            MeasuredRow('the same in `precision.fp8 = "tensorwise"`', section, "H200",
                        KernelPath("fused", True, "tensorwise"), _LLAMA_8B, 8, fp8_s, "selective"))


# zero3d's own rows of docs/gpu-check.md (tests/unit/test_throughput.py finds each there, with its step time). Before
# the fused loss landed (2026-11-28) the 1,024-token loss chunks ran their output GEMM again in backward. The paper's
# rank slices (materialised attention, their TP peers faked by the probe) are not rows.
MEASURED_ROWS = (
    MeasuredRow("zero3d: megatron GPTModel (local spec, SDPA, chunked loss) under ZeRO stage 2", _BENCH_26, "H100",
                _EAGER, _GPT_1P3B, 4, 0.1970, loss_recompute=True),
    MeasuredRow("zero3d Llama (megatron GPTModel, RoPE/SwiGLU/RMSNorm/GQA, SDPA, chunked loss, ZeRO stage 2)",
                _BENCH_27, "H200", _EAGER, _LLAMA_1B, 2, 0.2090, loss_recompute=True),
    MeasuredRow("zero3d GPT 1.3B (as above)", _BENCH_27, "H200", _EAGER, _GPT_1P3B, 4, 0.1872, loss_recompute=True),
    MeasuredRow("compute per step (forward 5.52 s, backward 7.82 s, reduction + step + gather 0.03 s)", _SLICE_26,
                "H200", _EAGER, _LLAMA_8B, 8, 13.37, "full", loss_recompute=True),
    *_h200_slice_rows(_PARITY_28, 12.42, 8.16, 11.64),
    MeasuredRow("zero3d GPT (eager, stage 2)", _PARITY_28, "H200", _EAGER, _GPT_1P3B, 4, 0.1791),
    MeasuredRow("zero3d GPT (compiled, stage 2)", _PARITY_28, "H200", _COMPILED, _GPT_1P3B, 4, 0.1785),
    MeasuredRow("zero3d GPT (compiled, stage 3)", _PARITY_28, "H200", _COMPILED, _GPT_1P3B, 4, 0.1820),
    *_h200_slice_rows(_PROFILE_28, 14.18, 8.46, 11.92),
    # Megatron-LM's single-V100 baseline (Shoeybi et al. 2019): 39 of 125 TFLOP/s, materialised attention, fp16
    PublishedShare("Megatron-LM, one V100 (Shoeybi et al. 2019)", "V100", KernelPath(), 39e12 / 125e12),
)


@dataclass(frozen=True)
class Efficiency:
    """The share of peak a step is modelled at, and the measured rows it is the mean of."""

    value: float
    rows: tuple = field(default=())
    match: str = ""  # which rows: the GPU and path's own, or the fallback that found some

    def __str__(self) -> str:
        names = "; ".join(f"{r.gpu}: {r.name}" for r in self.rows)
        return f"{self.value:.1%} of peak, the mean of {len(self.rows)} measured row(s) ({self.match}): {names}"


# Where the GPU has no row along a path: rows alike in these of the path's fields, in order (float8 sets the share
# most: 21% against 40% on the H200; then the attention kernel: the paper's materialised scores; then compilation)
FALLBACKS = (("attention", "compiled", "float8"), ("attention", "float8"), ("float8",), ())


def efficiency(gpu: str, path: KernelPath, rows=MEASURED_ROWS) -> Efficiency:
    """The mean efficiency of the `rows` measured on `gpu` (a GPU_KINDS key) along `path`; where there are none, of the
    rows on any GPU alike in the first of FALLBACKS' fields that finds some (Efficiency.match says which). The rows do
    not separate shape classes measurably (eager on the H200: GPT 1.3B 41–42%, Llama-3 8B 36–41% of peak), so a shape
    takes its GPU and path's mean."""
    if not rows:
        raise ValueError("no measured rows to take the efficiency from")
    exact = tuple(r for r in rows if r.gpu == gpu and r.path == path)
    if exact:
        return Efficiency(statistics.fmean(r.efficiency for r in exact), exact, f"{gpu}, {path}")
    for fields in FALLBACKS:
        alike = tuple(r for r in rows if all(getattr(r.path, f) == getattr(path, f) for f in fields))
        if alike:
            return Efficiency(statistics.fmean(r.efficiency for r in alike), alike,
                              f"none on {gpu} along {path}; rows of the same {', '.join(fields)}" if fields else
                              f"none on {gpu} along {path} or alike; every row")
    raise AssertionError("the last fallback keeps every row")


def leave_one_out(row: MeasuredRow, rows=MEASURED_ROWS) -> Optional[float]:
    """The step time `row` is predicted at from the other rows' efficiency (same GPU and path, else the fallback):
    its ideal time ÷ their share; None where no other row shares its path (nothing to predict it from)."""
    others = tuple(r for r in rows if r is not row)
    if not any(r.path == row.path for r in others):
        return None
    return row.step_s * row.efficiency / efficiency(row.gpu, row.path, others).value


def rows_table(rows=MEASURED_ROWS) -> str:
    """The measured rows as markdown: GPU, path, shape, step time, share of peak, and each timed row predicted from
    the others (leave_one_out)."""
    lines = ["| GPU | kernel path | row (docs/gpu-check.md) | samples | step s | share of peak | "
             "predicted from the others | error |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        timed = isinstance(r, MeasuredRow)
        predicted = leave_one_out(r, rows) if timed else None
        guess = (f"{predicted:.4g} s | {predicted / r.step_s - 1:+.1%}" if predicted else
                 ("path measured once | —" if timed else "— | —"))
        lines.append(f"| {r.gpu} | {r.path} | {r.name} | {r.samples if timed else '—'} | "
                     f"{r.step_s if timed else '—'} | {r.efficiency:.1%} | {guess} |")
    return "\n".join(lines)
