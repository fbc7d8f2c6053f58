"""Block-wise symmetric int8 / int4 quantization: the arithmetic under qwZ and qgZ (their collectives: core.py, hierarchical.py)."""
from dataclasses import dataclass
import torch

LEVELS = {8: 127, 4: 7}  # largest magnitude of a code: q ∈ [−LEVELS, LEVELS]
SCALE_DTYPES = {torch.float32: 4, torch.float16: 2}


@dataclass(frozen=True)
class QuantSpec:
    """How a tensor is quantized: `bits` (8 or 4), `block` elements per scale, the scale's dtype.

    Every block of `block` consecutive elements (the last padded with zeros) gets
    scale = max|block| / 127 (int8) or / 7 (int4), and each element x the code q = round(x / scale);
    dequantized, x' = q · scale, so |x − x'| ≤ scale / 2 (plus one rounding of fp32 arithmetic). An fp16
    scale is rounded up to the next fp16 value, so |x| / scale still fits the codes and the bound holds
    with the stored scale. int4 codes are stored as q + 8 in a nibble, two per byte (block must be even).
    """

    bits: int = 8
    block: int = 256
    scale_dtype: torch.dtype = torch.float32

    def __post_init__(self):
        if self.bits not in LEVELS:
            raise ValueError(f"bits = {self.bits!r} is invalid; valid: 8, 4")
        if type(self.block) is not int or self.block < 1 or (self.bits == 4 and self.block % 2):
            raise ValueError(f"block = {self.block!r} is invalid; must be an integer >= 1 (even for int4)")
        if self.scale_dtype not in SCALE_DTYPES:
            raise ValueError(f"scale_dtype = {self.scale_dtype} is invalid; valid: torch.float32, torch.float16")

    def blocks(self, numel: int) -> int:
        return -(-numel // self.block)

    def code_bytes(self, numel: int) -> int:
        """Bytes of the codes of `numel` elements (padded to whole blocks)."""
        padded = self.blocks(numel) * self.block
        return padded if self.bits == 8 else padded // 2

    def wire_bytes(self, numel: int) -> int:
        """Bytes a quantized tensor of `numel` elements occupies: codes + one scale per block."""
        return self.code_bytes(numel) + self.blocks(numel) * SCALE_DTYPES[self.scale_dtype]


def quantize(x: torch.Tensor, spec: QuantSpec = QuantSpec(),
             check_finite: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes, scales) of a flat view of `x`: int8 codes (int4: uint8, two per byte), one scale per block.
    Refuses non-finite input (a scale of inf or nan would silently poison every element of its block);
    that check reads the host: `check_finite=False` skips it, for callers whose input is finite already
    (the engine's qgZ zeroes non-finite gradients on the device first, having agreed on them; its qwZ
    gathers parameters, which a step never leaves non-finite)."""
    flat = x.detach().reshape(-1).float()
    if check_finite and not bool(torch.isfinite(flat).all()):
        bad = flat[~torch.isfinite(flat)][0].item()
        raise ValueError(f"cannot quantize a tensor holding {bad}: only finite values have a scale")
    nblocks = spec.blocks(flat.numel())
    padded = torch.zeros(nblocks * spec.block, dtype=torch.float32, device=flat.device)
    padded[:flat.numel()] = flat
    blocks = padded.view(nblocks, spec.block)
    scales = blocks.abs().amax(dim=1) / LEVELS[spec.bits]
    if spec.scale_dtype == torch.float16:
        if bool((scales > torch.finfo(torch.float16).max).any()):
            raise ValueError(f"block maximum {scales.max().item() * LEVELS[spec.bits]:g} overflows an fp16 scale; "
                             "use scale_dtype torch.float32")
        half = scales.half()
        low = half.float() < scales  # rounded down: step up one fp16 value so every code fits
        up = half[low].float()
        half[low] = torch.nextafter(up, torch.full_like(up, float("inf"))).half()
        scales = half
    divisor = scales.float().clone()
    divisor[divisor == 0] = 1.0  # an all-zero block: codes 0, scale 0
    codes = torch.round(blocks / divisor[:, None]).clamp_(-LEVELS[spec.bits], LEVELS[spec.bits]).to(torch.int8)
    if spec.bits == 4:
        nibbles = (codes + 8).to(torch.uint8).view(-1, 2)
        codes = nibbles[:, 0] | (nibbles[:, 1] << 4)
    return codes.reshape(-1), scales


def dequantize(codes: torch.Tensor, scales: torch.Tensor, numel: int, spec: QuantSpec = QuantSpec()) -> torch.Tensor:
    """The fp32 values of `numel` elements from `quantize`'s (codes, scales)."""
    if spec.bits == 4:
        low = (codes & 0x0F).to(torch.int16) - 8
        high = (codes >> 4).to(torch.int16) - 8
        values = torch.stack((low, high), dim=1).reshape(-1)
    else:
        values = codes
    blocks = values.float().view(-1, spec.block) * scales.float()[:, None]
    return blocks.reshape(-1)[:numel]


def pack(x: torch.Tensor, spec: QuantSpec, check_finite: bool = True) -> torch.Tensor:
    """One uint8 buffer: codes then scales' bytes (so one collective carries both)."""
    codes, scales = quantize(x, spec, check_finite)
    return torch.cat((codes.view(torch.uint8), scales.contiguous().view(torch.uint8)))


def unpack(buf: torch.Tensor, numel: int, spec: QuantSpec) -> torch.Tensor:
    n_codes = spec.code_bytes(numel)
    codes = buf[:n_codes].view(torch.int8 if spec.bits == 8 else torch.uint8)
    scales = buf[n_codes:spec.wire_bytes(numel)].clone().view(spec.scale_dtype)
    return dequantize(codes, scales, numel, spec)


def unpack_into(full: torch.Tensor, gathered: torch.Tensor, size: int, spec: QuantSpec) -> None:
    """Rank r's packed chunk of `gathered` dequantized into full[r·n:(r+1)·n], n = len(full) / size."""
    n = full.numel() // size
    out = full.view(size, n)
    for r, chunk in enumerate(gathered.view(size, -1)):
        out[r].copy_(unpack(chunk, n, spec))
