"""The probe's tables: executed bytes per category beside the estimate, the verdict, the layer extrapolation."""
from dataclasses import dataclass
from typing import Optional

from analysis.estimate import DEFAULT_MARGIN_FRACTION, GB, MemoryBreakdown

AGREE_WITHIN = 0.05  # estimate vs executed: differences above 5% are flagged (docs/estimator.md)
GIB = 2**30
# Figure 2 per-GPU TFLOP/s the SC20 text states (facts §4.6); the other bars exist only in the plot.
PAPER_FIG2_TFLOPS = {"100B": "> 38 TFLOP/s per GPU (SC20 text)",
                     "average 8B-100B": "~37.5 TFLOP/s per GPU (15 PFLOP/s on 400 GPUs)"}


def device_bytes(memory_gb: float) -> int:
    """A GPU labelled N GB carries N GiB (V100-32GB: 32 GiB = 34.36·10^9 bytes)."""
    return int(memory_gb * GIB)


def estimate_rows(estimate: MemoryBreakdown, model_states: dict, at_peak: Optional[dict], peak_bytes: int,
                  host_bytes: int) -> list:
    """[(category, estimated bytes, executed bytes)]: model states as held between steps, activations and
    temporaries at the rank's peak (`at_peak`: the moment the estimate's sum stands for), and the whole peak.
    `at_peak` None (a real GPU: CUDA's allocator counts bytes, not categories): model states and the peak only."""
    states = [("params", estimate.param_bytes, model_states["params"]),
              ("grads", estimate.grad_bytes, model_states["grads"]),
              ("optimizer (fp32 master + moments)", estimate.optimizer_bytes, model_states["optimizer"])]
    peak = ("peak (without margin)", estimate.total_bytes - estimate.margin_bytes, peak_bytes)
    if at_peak is None:
        return [*states, peak]
    # at the optimizer step's peak the activations are freed and its fp32 gradient copy is the temporary
    at_step = estimate.peaks_at_step
    return [*states, ("activations at the peak", 0.0 if at_step else estimate.activation_bytes, at_peak["activations"]),
            ("temporaries (buffers) at the peak", estimate.step_bytes if at_step else estimate.buffer_bytes,
             at_peak["temporaries"]),
            peak, ("host (Pa+cpu)", estimate.host_bytes, host_bytes)]


def relative_gap(estimated: float, executed: float) -> float:
    """(estimate − executed) / executed; 0 when both are 0."""
    if executed == 0:
        return 0.0 if estimated == 0 else float("inf")
    return (estimated - executed) / executed


def format_comparison(rows: list) -> str:
    lines = [f"{'category':<36}{'estimate GB':>13}{'executed GB':>13}{'diff':>9}"]
    for name, est, exe in rows:
        gap = relative_gap(est, exe)
        flag = "  >5%" if abs(gap) > AGREE_WITHIN else ""
        lines.append(f"{name:<36}{est / GB:13.3f}{exe / GB:13.3f}{gap:+9.1%}{flag}")
    return "\n".join(lines)


@dataclass(frozen=True)
class Verdict:
    fits: bool
    peak_bytes: int
    device_bytes: int
    margin_fraction: float

    @property
    def usable_bytes(self) -> float:
        return self.device_bytes * (1 - self.margin_fraction)

    def describe(self) -> str:
        word = "FITS" if self.fits else "does NOT fit"
        return (f"verdict: {word} — executed peak {self.peak_bytes / GB:.2f} GB against "
                f"{self.usable_bytes / GB:.2f} GB usable = {self.device_bytes / GB:.2f} GB device "
                f"({self.device_bytes / GIB:g} GiB) minus a {self.margin_fraction:.0%} margin for the CUDA "
                f"context, NCCL/cuBLAS workspaces and allocator fragmentation (the estimator's margin); "
                f"headroom {(self.usable_bytes - self.peak_bytes) / GB:+.2f} GB")


def judge(peak_bytes: int, memory_gb: float, margin_fraction: float = DEFAULT_MARGIN_FRACTION) -> Verdict:
    total = device_bytes(memory_gb)
    return Verdict(peak_bytes <= total * (1 - margin_fraction), peak_bytes, total, margin_fraction)


@dataclass(frozen=True)
class LayerFit:
    """Peak bytes as fixed + per_layer × layers, from probes at two depths, and the deepest that fits."""

    layers: tuple
    peaks: tuple
    per_layer: float
    fixed: float
    max_layers: int


def extrapolate_layers(layers_a: int, peak_a: int, layers_b: int, peak_b: int, usable_bytes: float) -> LayerFit:
    """Per-layer bytes are linear in the layer count (every layer holds the same states and
    checkpoint): two probed depths give the line, the budget gives the deepest model on it."""
    if layers_b <= layers_a:
        raise ValueError(f"layers_b = {layers_b} must exceed layers_a = {layers_a}")
    per_layer = (peak_b - peak_a) / (layers_b - layers_a)
    if per_layer <= 0:
        raise ValueError(f"peak did not grow with layers ({peak_a} → {peak_b} bytes): not linear")
    fixed = peak_a - per_layer * layers_a
    return LayerFit((layers_a, layers_b), (peak_a, peak_b), per_layer, fixed,
                    max(0, int((usable_bytes - fixed) // per_layer)))


def extrapolate_phases(layers_a: int, phases_a: dict, layers_b: int, phases_b: dict, usable_bytes: float):
    """One line per phase (the phase that peaks can change with depth: activations grow in backward,
    optimizer scratch in the optimizer step); the deepest model is the smallest of the phases' limits.
    Returns (limiting phase, its LayerFit)."""
    fits = {}
    for phase, peak_b in phases_b.items():
        peak_a = phases_a[phase]
        if peak_b <= peak_a:  # not growing with depth: limits nothing unless already over
            if peak_b > usable_bytes:
                fits[phase] = LayerFit((layers_a, layers_b), (peak_a, peak_b), 0.0, peak_b, 0)
            continue
        fits[phase] = extrapolate_layers(layers_a, peak_a, layers_b, peak_b, usable_bytes)
    if not fits:
        raise ValueError("no phase's peak grew with the layer count")
    phase = min(fits, key=lambda p: fits[p].max_layers)
    return phase, fits[phase]
