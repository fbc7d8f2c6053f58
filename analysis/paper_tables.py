"""The ZeRO paper's Table I, Table II, Figure 1 and residual-memory arithmetic, computed from formulas."""
from decimal import ROUND_DOWN, ROUND_HALF_UP, Decimal
from fractions import Fraction

from analysis.estimate import GB, model_state_bytes

PAPER_GPU_MEMORY = 32 * GB  # the paper's tables treat the V100 as 32 GB = 32e9 bytes
TABLE_ONE_DP = (1, 4, 16, 64, 256, 1024)
TABLE_ONE_MODELS = ((7_500_000_000, "7.5B"), (128_000_000_000, "128B"), (10**12, "1T"))  # Table I: 1T = 1e12
TABLE_ONE_STAGES = ((1, "P_os"), (2, "P_os+g"), (3, "P_os+g+p"))
TABLE_TWO_MP = (1, 2, 4, 8, 16)
TABLE_TWO_DP = 64  # every Table II row has N_d = GPUs / MP = 64
TABLE_TWO_TERA = 1024  # Table II writes 512B as 0.5T: T = 1024B there


def model_state_gb(params: int, stage: int, dp: int) -> Fraction:
    """Exact per-GPU model-state GB (fp16 mixed-precision Adam, K = 12) for ZeRO `stage`."""
    return sum(model_state_bytes(params, stage, dp, "fp16")) / GB


def _decimal(value: Fraction) -> Decimal:
    return Decimal(value.numerator) / Decimal(value.denominator)


def _plain(value: Decimal) -> str:
    """Drop trailing zeros without switching to exponent notation (120, not 1.2E+2)."""
    text = format(value, "f")
    return text.rstrip("0").rstrip(".") if "." in text else text


def table_one_cell(params: int, stage: int, dp: int) -> str:
    """One Table I cell, printed with the paper's rounding (facts §1.4)."""
    exact = _decimal(model_state_gb(params, stage, dp))
    if params < 10**11:
        # 7.5B columns: half-up to 1 decimal, 2 decimals below 2 GB (1.875 → 1.88)
        places = Decimal("0.01") if exact < 2 else Decimal("0.1")
        return _plain(exact.quantize(places, rounding=ROUND_HALF_UP))
    # 128B and 1T columns: truncated to whole GB at 100 and above, to one decimal below
    places = Decimal("1") if exact >= 100 else Decimal("0.1")
    return _plain(exact.quantize(places, rounding=ROUND_DOWN))


def table_one_cells() -> list:
    """Rows of (N_d, [(text, bold), ...]); bold = first N_d whose exact value fits in 32 GB."""
    columns = [(p, s) for p, _ in TABLE_ONE_MODELS for s, _ in TABLE_ONE_STAGES]
    bold_dp = {}
    for params, stage in columns:
        fitting = [dp for dp in TABLE_ONE_DP if model_state_gb(params, stage, dp) * GB <= PAPER_GPU_MEMORY]
        bold_dp[(params, stage)] = fitting[0] if fitting else None
    return [(dp, [(table_one_cell(p, s, dp), bold_dp[(p, s)] == dp) for p, s in columns])
            for dp in TABLE_ONE_DP]


def table_one() -> str:
    """Table I as markdown: per-device model-state GB vs DP degree; bold = first that fits 32 GB."""
    head = ["N_d"] + [f"{label} {name}" for _, label in TABLE_ONE_MODELS for _, name in TABLE_ONE_STAGES]
    lines = ["Table I: per-device model-state memory (GB), fp16 mixed-precision Adam (K = 12)",
             "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for dp, cells in table_one_cells():
        texts = [f"**{text}**" if bold else text for text, bold in cells]
        lines.append(f"| {dp} | " + " | ".join(texts) + " |")
    return "\n".join(lines)


def max_params_for_memory(stage: int, dp: int, memory_bytes: int = PAPER_GPU_MEMORY) -> Fraction:
    """Largest Ψ whose model states alone fill `memory_bytes` (Table II's theory, exact)."""
    bytes_per_param = sum(model_state_bytes(1, stage, dp, "fp16"))
    return Fraction(memory_bytes) / bytes_per_param


def _billions_text(value: Decimal) -> str:
    # the paper switches to T from 512B upwards (0.5T, 1T, 2T); 256B stays in B
    if value >= TABLE_TWO_TERA / 2:
        return _plain(value / TABLE_TWO_TERA) + "T"
    return _plain(value) + "B"


def table_two_cells() -> list:
    """Rows of (MP, GPUs, [baseline, P_os, P_os+g, P_os+g+p] texts): Table II's theoretical side.

    Reproduces the paper's quirk: rows with MP > 1 are MP × the MP = 1 value rounded to 0.1B.
    """
    mp1 = [_decimal(max_params_for_memory(stage, TABLE_TWO_DP) / 10**9).quantize(
        Decimal("0.1"), rounding=ROUND_HALF_UP) for stage in range(4)]
    return [(mp, mp * TABLE_TWO_DP, [_billions_text(mp * v) for v in mp1]) for mp in TABLE_TWO_MP]


def table_two() -> str:
    """Table II's theoretical columns: max model size at 32 GB with N_d = 64 in every row."""
    lines = ["Table II (theory): max model size, model states only, 32 GB GPUs, N_d = 64",
             "| MP | GPUs | Baseline | P_os | P_os+g | P_os+g+p |", "|---|---|---|---|---|---|"]
    for mp, gpus, cells in table_two_cells():
        lines.append(f"| {mp} | {gpus} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def figure_one() -> dict:
    """Figure 1 (7.5B, N_d = 64): stage → (exact GB, printed one-decimal text)."""
    out = {}
    for stage, name in ((0, "baseline"), (1, "P_os"), (2, "P_os+g"), (3, "P_os+g+p")):
        exact = model_state_gb(7_500_000_000, stage, 64)
        out[name] = (exact, _plain(_decimal(exact).quantize(Decimal("0.1"), rounding=ROUND_HALF_UP)))
    return out


def paper_activation_bytes(layers: int, hidden: int, batch: int, seq: int, act_bytes: int = 2) -> int:
    """The paper's footnote estimate: 12 × hidden × batch × seq × layers elements (no recompute)."""
    return 12 * hidden * batch * seq * layers * act_bytes


def checkpoint_bytes(layers: int, hidden: int, batch: int, seq: int, mp: int = 1,
                     act_bytes: int = 2) -> Fraction:
    """One block-input checkpoint per layer; P_a divides it by the MP degree."""
    return Fraction(layers * batch * seq * hidden * act_bytes, mp)


def fused_buffer_bytes(params: int) -> int:
    """A flat fp32 buffer over all gradients: 4Ψ bytes (6 GB at 1.5B, 12 GB at 3B)."""
    return 4 * params
