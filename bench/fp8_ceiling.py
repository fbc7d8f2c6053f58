"""How fast precision.fp8 can make a step, measured on the device: the layers' linear GEMMs timed in bf16 and in float8.

FP8 runs only the transformer layers' QKV, projection, fc1 and fc2 GEMMs in float8 (docs/fp8.md); the attention core,
the output layer, the loss, the norms and the optimizer take what they took in bf16. So a bf16 step of T seconds, of
which the linears' GEMMs take L_bf16, becomes at best T − L_bf16 + L_fp8 in FP8 — the casts to float8 (amax passes,
scaled copies, transposes) come on top. `ceiling = T / (T − L_bf16 + L_fp8)` is the most any FP8 row can gain over
its bf16 row; the row's measured ratio ÷ the ceiling is the share of it the casts leave.

Each GEMM is timed as pretrain/model/fp8.py runs it — forward y = x·Wᵀ (fast accumulation), input gradient dx = dy·W
and weight gradient dW = dyᵀ·x with the codes transposed where the contraction needs them — on codes cast beforehand
(the casts are not in L_fp8), and in bf16 as megatron's linear runs it (torch.matmul on the transposed views).
"""
import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def linear_shapes(shape: dict) -> list:
    """[(in, out)] of one layer's four linear weights on one TP rank (bench_gpu's shape dict, GPT or Llama, or
    `config_shape`'s): QKV and fc1 split by output, the projection and fc2 by input."""
    h, heads, tp = shape["hidden"], shape["heads"], shape.get("tp", 1)
    d = h // heads
    query, kv = heads * d, shape.get("query_groups", heads) * d
    ffn = shape.get("ffn") or 4 * h
    gated = shape.get("gated", shape["kind"] == "llama")
    return [(h, (query + 2 * kv) // tp), (query // tp, h), (h, (2 * ffn if gated else ffn) // tp), (ffn // tp, h)]


def float8_operands(x: torch.Tensor, w: torch.Tensor, dy: torch.Tensor, recipe: str) -> list:
    """[((a, a_scale), (b, b_scale), fast_accum)] of one linear's three float8 GEMMs (forward, input gradient, weight
    gradient), each `scaled_matmul(a, a_scale, b, b_scale)`, cast as pretrain/model/fp8.py casts them (its
    forward_gemm and backward_gemms: the same products, tests/unit/test_fp8_ceiling.py)."""
    from zero3d.float8 import E4M3, RECIPES, quantize

    spec = RECIPES[recipe]
    if spec.rowwise:  # each operand along the contraction dimension of the GEMM it enters
        pow2 = spec.power_of_two_scales
        x_rows, w_rows = quantize(x, E4M3, pow2, dim=1), quantize(w, E4M3, pow2, dim=1)
        dy_rows, w_cols = quantize(dy, spec.grad_dtype, pow2, dim=1), quantize(w, E4M3, pow2, dim=0)
        dy_cols, x_cols = quantize(dy, spec.grad_dtype, pow2, dim=0), quantize(x, E4M3, pow2, dim=0)
        return [(x_rows, w_rows, True),
                (dy_rows, (w_cols[0].t().contiguous(), w_cols[1].t()), False),
                ((dy_cols[0].t().contiguous(), dy_cols[1].t()), (x_cols[0].t().contiguous(), x_cols[1].t()), False)]
    (x8, xs), (w8, ws), (g8, gs) = quantize(x, E4M3), quantize(w, E4M3), quantize(dy, spec.grad_dtype)
    return [((x8, xs), (w8, ws), True), ((g8, gs), (w8.t().contiguous(), ws), False),
            ((g8.t().contiguous(), gs), (x8.t().contiguous(), xs), False)]


def layer_gemm_seconds(tokens: int, d_in: int, d_out: int, recipe: str, device, repeats: int = 10) -> tuple:
    """(bf16 s, float8 s) of one linear's three GEMMs for `tokens` tokens: forward, input and weight gradient."""
    from bench.timing import mean_seconds
    from pretrain.model.fp8 import scaled_matmul

    g = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(tokens, d_in, generator=g, device=device, dtype=torch.bfloat16)
    w = torch.randn(d_out, d_in, generator=g, device=device, dtype=torch.bfloat16)
    dy = torch.randn(tokens, d_out, generator=g, device=device, dtype=torch.bfloat16)
    bf16 = mean_seconds(lambda: (torch.matmul(x, w.t()), torch.matmul(dy, w), torch.matmul(dy.t(), x)), repeats, 2,
                        device)
    operands = float8_operands(x, w, dy, recipe)
    fp8 = mean_seconds(lambda: [scaled_matmul(a, a_scale, b, b_scale, torch.bfloat16, fast_accum=fast)
                                for (a, a_scale), (b, b_scale), fast in operands], repeats, 2, device)
    return bf16, fp8


def fp8_ceiling(shape: dict, recipe: str, bf16_step_s: float, device, repeats: int = 10) -> dict:
    """The linears' GEMM seconds a step (bf16 and float8: every layer, each of the step's `micro_batches` (default 1)
    of micro × seq / context tokens) and the ceiling they set on an FP8 step's speed-up over a bf16 step of
    `bf16_step_s` (module docstring)."""
    tokens = shape["micro"] * shape["seq"] // shape.get("context", 1)
    times = [layer_gemm_seconds(tokens, d_in, d_out, recipe, device, repeats) for d_in, d_out in linear_shapes(shape)]
    passes = shape["layers"] * shape.get("micro_batches", 1)
    linears_bf16 = passes * sum(b for b, _ in times)
    linears_fp8 = passes * sum(f for _, f in times)
    best = bf16_step_s - linears_bf16 + linears_fp8
    return {"recipe": recipe, "bf16_step_s": bf16_step_s, "linears_bf16_s": linears_bf16, "linears_fp8_s": linears_fp8,
            "ceiling": bf16_step_s / best if best > 0 else None}


def ceiling_table(ceilings: list, fp8_steps: dict, bf16_label: str) -> str:
    """The ceilings beside each FP8 run's measured speed-up over the bf16 one `bf16_label` ({recipe: its step s})."""
    lines = [f"FP8 ceiling: the layers' linear GEMMs a step in bf16 and float8 (casts excluded), and the speed-up over "
             f"'{bf16_label}' ({ceilings[0]['bf16_step_s']:.4f} s a step) they allow", "",
             "| recipe | linears bf16 ms | linears float8 ms | GEMM speed-up | ceiling | FP8 ÷ bf16 measured | "
             "share of the ceiling's gain |", "|---|---|---|---|---|---|---|"]
    for c in ceilings:
        fp8_step = fp8_steps.get(c["recipe"])
        measured = c["bf16_step_s"] / fp8_step if fp8_step else None
        gained = ((measured - 1) / (c["ceiling"] - 1) if measured is not None and c["ceiling"] and c["ceiling"] > 1
                  else None)
        lines.append(f"| {c['recipe']} | {c['linears_bf16_s'] * 1e3:.1f} | {c['linears_fp8_s'] * 1e3:.1f} | "
                     f"{c['linears_bf16_s'] / c['linears_fp8_s']:.2f}× | "
                     + ("— (the bf16 GEMMs alone outlast the step)" if c["ceiling"] is None
                        else f"{c['ceiling']:.3f}×") + " | "
                     + ("—" if measured is None else f"{measured:.3f}×") + " | "
                     + ("—" if gained is None else f"{gained:.0%}") + " |")
    return "\n".join(lines) + "\n"


def config_shape(cfg) -> dict:
    """The shape one rank of `cfg` runs its linears at: its model, TP and context split, micro-batches a step (the
    cluster's GPUs as the world, as the probe takes it)."""
    from pretrain.memory_check import accumulation
    m, p = cfg.model, cfg.parallel
    return dict(kind="config", layers=m.num_layers // p.pipeline, hidden=m.hidden_size, heads=m.num_attention_heads,
                query_groups=m.num_query_groups or m.num_attention_heads, ffn=m.ffn_hidden_size,
                gated=m.mlp == "swiglu", seq=m.seq_length, micro=cfg.train.micro_batch_size, tp=p.tensor,
                context=p.context, micro_batches=accumulation(cfg, cfg.cluster.nodes * cfg.cluster.gpus_per_node))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python bench/fp8_ceiling.py", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", required=True, help="the run's TOML (one rank of it: its layers' linear GEMMs)")
    ap.add_argument("--bf16-step-s", type=float, required=True, help="the bf16 step's seconds (e.g. the probe's)")
    ap.add_argument("--fp8-step-s", action="append", default=[], metavar="RECIPE=S", help="an FP8 run's measured step seconds, beside its ceiling (repeatable)")
    ap.add_argument("--recipe", action="append", choices=("tensorwise", "rowwise"), help="default: both")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("overrides", nargs="*", help="config overrides, key=value")
    args = ap.parse_args(argv)
    if args.bf16_step_s <= 0:
        ap.error(f"--bf16-step-s {args.bf16_step_s} is invalid; must be > 0 seconds")
    fp8_steps = {}
    for item in args.fp8_step_s:
        recipe, _, seconds = item.partition("=")
        try:
            fp8_steps[recipe] = float(seconds)
        except ValueError:
            fp8_steps[recipe] = -1.0
        if recipe not in ("tensorwise", "rowwise") or fp8_steps[recipe] <= 0:
            ap.error(f"--fp8-step-s {item!r} is invalid; give RECIPE=SECONDS, RECIPE tensorwise or rowwise, SECONDS > 0")
    from pretrain.config import load_config
    from pretrain.errors import ProjectError
    try:
        shape = config_shape(load_config(args.config, args.overrides))
    except ProjectError as err:  # a missing file, a bad key or value: one line, no traceback
        ap.error(str(err))
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        ap.error(f"--device {args.device}: no CUDA device visible; use --device cpu")
    ceilings = [fp8_ceiling(shape, recipe, args.bf16_step_s, device) for recipe in args.recipe or ("tensorwise",
                                                                                                   "rowwise")]
    print(ceiling_table(ceilings, fp8_steps, f"bf16, {args.config}"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
