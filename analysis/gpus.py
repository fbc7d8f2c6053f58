"""GPU kinds: each card's dense tensor-core peak per training dtype and its memory, by the short keys configs use."""
from dataclasses import dataclass
from typing import Optional

from analysis.estimate import PRECISIONS


@dataclass(frozen=True)
class GPUKind:
    """One GPU model: dense (no sparsity) tensor-core peak per training dtype, and its memory."""

    name: str  # as the vendor sells it
    memory_gb: float  # labelled memory, read in GiB (docs/estimator.md, Budget convention)
    fp16_tflops: float  # dense fp16 tensor-core peak, TFLOP/s
    bf16_tflops: Optional[float]  # dense bf16 peak; None where the GPU has no bf16 tensor cores
    fp32_tflops: float  # plain fp32 (no TF32: torch leaves TF32 matmuls off by default)
    fp8_tflops: Optional[float] = None  # dense float8 tensor-core peak (Ada, Hopper and newer); None: no float8

    def __post_init__(self):
        for name in ("memory_gb", "fp16_tflops", "fp32_tflops"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} = {getattr(self, name)} is invalid; must be > 0")
        for name in ("bf16_tflops", "fp8_tflops"):
            if getattr(self, name) is not None and not getattr(self, name) > 0:
                raise ValueError(f"{name} = {getattr(self, name)} is invalid; must be > 0 (or None: none)")

    def peak_tflops(self) -> dict:
        """{dtype: dense TFLOP/s} for the dtypes this GPU has tensor cores (or plain fp32) for; "fp8": the float8
        GEMMs' (pretrain's precision.fp8)."""
        peaks = {"bf16": self.bf16_tflops, "fp16": self.fp16_tflops, "fp32": self.fp32_tflops, "fp8": self.fp8_tflops}
        return {dtype: float(value) for dtype, value in peaks.items() if value is not None}

    def peak_flops(self, precision: str) -> float:
        """Dense peak in FLOP/s at `precision` (estimate.PRECISIONS)."""
        peaks = {"fp16": self.fp16_tflops, "bf16": self.bf16_tflops, "fp32": self.fp32_tflops}
        if precision not in peaks:
            raise ValueError(f"precision {precision!r} is invalid; valid: {', '.join(PRECISIONS)}")
        if peaks[precision] is None:
            valid = ", ".join(p for p, v in peaks.items() if v is not None)
            bf16 = ", ".join(k for k, g in GPU_KINDS.items() if g.bf16_tflops) if precision == "bf16" else ""
            raise ValueError(f"precision {precision} is invalid on {self.name} (no {precision} tensor cores); "
                             f"valid: {valid}" + (f" (bf16 GPUs: {bf16}; e.g. --cluster dgx-h100)" if bf16 else ""))
        return peaks[precision] * 1e12


# Vendor data sheets: V100-SXM3-32GB (DGX-2: 2 PFLOP/s fp16 tensor over 16 GPUs = 125 each, 15.7 fp32);
# A100-SXM4-80GB (312 bf16/fp16 dense, 19.5 fp32); H100-SXM5-80GB (989 bf16/fp16 dense, 67 fp32);
# H200-SXM-141GB (same compute as the H100 SXM: 989 dense, 67 fp32; 141 GB HBM3e). FP8 dense: NVIDIA's H100 data
# sheet gives 3,958 TFLOP/s FP8 "with sparsity" for the SXM (the H200's sheet the same), 3,026 for the PCIe card:
# dense is half, 1,979 and 1,513; V100 and A100 have no float8 tensor cores.
V100 = GPUKind("V100-SXM3-32GB", 32, 125, None, 15.7)
A100 = GPUKind("A100-SXM4-80GB", 80, 312, 312, 19.5)
H100 = GPUKind("H100-SXM5-80GB", 80, 989, 989, 67, fp8_tflops=1979)
H200 = GPUKind("H200-SXM-141GB", 141, 989, 989, 67, fp8_tflops=1979)
# PCIe cards run lower clocks: their own peaks (V100 PCIe 112 / 14; H100 PCIe 756 dense / 51, FP8 1,513 dense)
V100_PCIE = GPUKind("V100-PCIe-32GB", 32, 112, None, 14.0)
H100_PCIE = GPUKind("H100-PCIe-80GB", 80, 756, 756, 51, fp8_tflops=1513)
# The short keys cluster.gpu and pretrain.metrics (MFU) name the cards by (V100 SXM2 and SXM3 share their peaks)
GPU_KINDS = {"V100": V100, "V100-PCIe": V100_PCIE, "A100": A100, "H100": H100, "H100-PCIe": H100_PCIE, "H200": H200}
