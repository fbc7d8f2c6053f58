"""Per-rank GPU throughput: zero3d beside plain-PyTorch GPT and Llama models (SDPA, fused AdamW, eager and
compiled), plus the paper's rank slices.

    python bench/bench_gpu.py [--steps 10] [--shapes both] [--json]   # on one GPU (docs/gpu-check.md)
    python bench/bench_gpu.py --cpu-dry-run                           # tiny versions of every row on CPU (a suite test)

Rows, for each shape `--shapes` picks, in bf16 at TP 1, AdamW with the gradients clipped to norm 1 on both sides,
trained through zero3d (`pretrain` model + ZeRO engine, one
rank: stage 2 eager, and its layers compiled at stages 2 and 3) and through the plain-PyTorch model below, eager and
`torch.compile`d; each row's tokens/s and peak memory also ÷ the compiled plain model's (the parity issue's ratios):
  gpt    the 1.3B GPT-2 shape (24 layers × 2048 hidden × 16 heads, seq 2048, vocab 50257): `PlainGPT`
  llama  a Llama-3.2-1B-like shape (16 layers × 2048 hidden × 32 heads in 8 key/value groups, SwiGLU 8192,
         RoPE base 500000, RMSNorm, no biases, untied output, seq 4096, vocab 128256): `PlainLlama`
then `python -m pretrain.probe --real` of the 8B (TP 4), 60B and 100B (TP 16) rank slices in bf16 and fp16
under a 32 GB cap. With `--fp8` (and always in the dry run): the Llama shape through zero3d in FP8 beside its bf16
row (precision.fp8 "tensorwise" and "rowwise", stage 2, the same process; MFU against the GPU's FP8 peak), and
`probe --real` of the Llama-3 8B rank slice (configs/llama3_8b.toml: TP 1 × DP 16, stage 2) in bf16 and FP8
under an 80 GB cap (the dry run: FP8 only, fake, 2 layers, 1 step). Each row: tokens/s, TFLOP/s (the model
FLOPs of model_shape/flops.py: Megatron's formula, with grouped-query K/V and the gated MLP's third matrix for
Llama), MFU (against the GPU's dense peak), peak CUDA memory (and for zero3d's rows the estimator's peak beside it). The dry run shrinks each shape to 2 layers × 64 hidden in fp32, compiles with the
`aot_eager` backend (inductor's C++ codegen costs ~40 s on a CPU: the GPU run uses inductor), and runs the
probes in fake mode with 2 layers for 1 step.
"""
import argparse
import importlib.util
import json
import os
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from pretrain.metrics import device_peak_tflops, throughput_metrics  # noqa: E402
from model_shape.flops import gpt_step_flops  # noqa: E402
from pretrain.probe.kernels import kernel_profile, profile_table  # noqa: E402
from bench.fp8_ceiling import ceiling_table, fp8_ceiling  # noqa: E402
from bench.timing import mean_seconds  # noqa: E402

SHAPE = dict(kind="gpt", layers=24, hidden=2048, heads=16, seq=2048, vocab=50257, micro=4, dtype="bf16")
DRY_SHAPE = dict(kind="gpt", layers=2, hidden=64, heads=4, seq=32, vocab=512, micro=2, dtype="fp32")
LLAMA_SHAPE = dict(kind="llama", layers=16, hidden=2048, heads=32, query_groups=8, ffn=8192, seq=4096, vocab=128256,
                   micro=2, dtype="bf16", rope_base=500000)
DRY_LLAMA_SHAPE = dict(kind="llama", layers=2, hidden=64, heads=4, query_groups=2, ffn=160, seq=32, vocab=512,
                       micro=2, dtype="fp32", rope_base=500000)
LR = 1e-4  # both sides' constant AdamW learning rate (the loss column compares like with like, up to the init)
CLIP = 1.0  # both sides clip the gradients' global 2-norm to this (pretrain's default): the same work each step
NAMES = {"gpt": "GPT", "llama": "Llama"}  # shape kind → the name its rows carry
# Each row as it is measured, on stderr: tools/gpu_check.py keeps them when a time budget stops the table unprinted
MEASURED = "measured row: "
PROBES = [("8B", "configs/paper/fig2_8B_zero.toml"), ("60B", "configs/paper/fig2_60B_zero.toml"),
          ("100B", "configs/paper/fig2_100B_zero.toml")]
FP8_RECIPES = ("tensorwise", "rowwise")  # precision.fp8's recipes, each a zero3d Llama row beside bf16's (--fp8)
FP8_PROBE = ("Llama-3 8B", "configs/llama3_8b.toml")  # its rank slice probed in bf16 and FP8 (--fp8), 80 GB cap
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


class Block(torch.nn.Module):
    """Pre-LN GPT block: causal SDPA attention and a 4h GELU MLP (megatron's local layer, in plain PyTorch)."""

    def __init__(self, hidden: int, heads: int):
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = torch.nn.LayerNorm(hidden), torch.nn.LayerNorm(hidden)
        self.qkv, self.proj = torch.nn.Linear(hidden, 3 * hidden), torch.nn.Linear(hidden, hidden)
        self.fc1, self.fc2 = torch.nn.Linear(hidden, 4 * hidden), torch.nn.Linear(4 * hidden, hidden)

    def forward(self, x):
        b, s, h = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, s, 3, self.heads, h // self.heads).permute(2, 0, 3, 1, 4)
        att = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(att.transpose(1, 2).reshape(b, s, h))
        return x + self.fc2(torch.nn.functional.gelu(self.fc1(self.ln2(x))))


class PlainGPT(torch.nn.Module):
    """The reference: learned positions, `layers` blocks, final LN, untied output layer, fp32 cross-entropy."""

    def __init__(self, layers: int, hidden: int, heads: int, seq: int, vocab: int):
        super().__init__()
        self.tok, self.pos = torch.nn.Embedding(vocab, hidden), torch.nn.Embedding(seq, hidden)
        self.blocks = torch.nn.ModuleList(Block(hidden, heads) for _ in range(layers))
        self.ln_f, self.head = torch.nn.LayerNorm(hidden), torch.nn.Linear(hidden, vocab, bias=False)

    def forward(self, tokens):
        inputs, labels = tokens[:, :-1], tokens[:, 1:]
        x = self.tok(inputs) + self.pos(torch.arange(inputs.shape[1], device=inputs.device))
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.ln_f(x))
        return torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), labels.flatten())


def rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class LlamaBlock(torch.nn.Module):
    """Pre-norm Llama block: RMSNorm, causal SDPA over RoPE'd q, k with grouped-query K/V, SwiGLU MLP; no biases.
    Q/K/V and gate/up are one GEMM each (as megatron fuses them): the same FLOPs as separate projections."""

    def __init__(self, hidden: int, heads: int, groups: int, ffn: int):
        super().__init__()
        self.heads, self.groups, self.dim = heads, groups, hidden // heads
        self.norm1, self.norm2 = torch.nn.RMSNorm(hidden, eps=1e-5), torch.nn.RMSNorm(hidden, eps=1e-5)
        self.qkv = torch.nn.Linear(hidden, (heads + 2 * groups) * self.dim, bias=False)
        self.proj = torch.nn.Linear(hidden, hidden, bias=False)
        self.gate_up, self.down = torch.nn.Linear(hidden, 2 * ffn, bias=False), torch.nn.Linear(ffn, hidden, bias=False)

    def forward(self, x, cos, sin):
        b, s, h = x.shape
        qkv = self.qkv(self.norm1(x)).view(b, s, self.heads + 2 * self.groups, self.dim).transpose(1, 2)
        q, k, v = qkv.split([self.heads, self.groups, self.groups], dim=1)
        cos, sin = cos.to(q.dtype), sin.to(q.dtype)
        q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
        att = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        x = x + self.proj(att.transpose(1, 2).reshape(b, s, h))
        gate, up = self.gate_up(self.norm2(x)).chunk(2, dim=-1)
        return x + self.down(torch.nn.functional.silu(gate) * up)


class PlainLlama(torch.nn.Module):
    """The Llama reference: token embedding, `layers` blocks (RoPE at positions 0..seq-1, rotate-half form), final
    RMSNorm, untied output layer, fp32 cross-entropy."""

    def __init__(self, layers: int, hidden: int, heads: int, query_groups: int, ffn: int, seq: int, vocab: int,
                 rope_base: float):
        super().__init__()
        self.tok = torch.nn.Embedding(vocab, hidden)
        self.blocks = torch.nn.ModuleList(LlamaBlock(hidden, heads, query_groups, ffn) for _ in range(layers))
        self.norm_f, self.head = torch.nn.RMSNorm(hidden, eps=1e-5), torch.nn.Linear(hidden, vocab, bias=False)
        dim = hidden // heads
        inv_freq = 1.0 / rope_base ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim)
        angles = torch.outer(torch.arange(seq, dtype=torch.float64), inv_freq)
        angles = torch.cat((angles, angles), dim=-1)  # (seq, dim): the rotate-half layout
        self.register_buffer("cos", angles.cos().float(), persistent=False)
        self.register_buffer("sin", angles.sin().float(), persistent=False)

    def forward(self, tokens):
        inputs, labels = tokens[:, :-1], tokens[:, 1:]
        x = self.tok(inputs)
        cos, sin = self.cos[:inputs.shape[1]], self.sin[:inputs.shape[1]]
        for block in self.blocks:
            x = block(x, cos, sin)
        logits = self.head(self.norm_f(x))
        return torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), labels.flatten())


def padded_vocab(vocab: int) -> int:
    """The embedding width pretrain builds at TP 1 (megatron's padding rule, analysis/estimate.py)."""
    from analysis.estimate import padded_vocab as megatron_padded_vocab
    return megatron_padded_vocab(vocab, 1)


def tokens_batch(shape: dict, device) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    return torch.randint(0, shape["vocab"], (shape["micro"], shape["seq"] + 1), generator=g).to(device)


def timed(step, steps: int, warmup: int, device, profile=None) -> float:
    """Mean seconds per `step()` over `steps` after `warmup` (compilation, allocator, optimizer states); `profile`,
    when given, is called with `step` after the timed steps (--profile: where the device time goes)."""
    seconds = mean_seconds(step, steps, warmup, device)
    if profile is not None:
        profile(step)
    return seconds


def row(label: str, step_s: float, shape: dict, device, loss: float, peak_dtype: str = "") -> dict:
    """`peak_dtype`: the peak MFU divides by (default the shape's dtype; "fp8" for the FP8 rows)."""
    tokens = shape["micro"] * shape["seq"]
    flops = gpt_step_flops(shape["layers"], shape["hidden"], shape["seq"], padded_vocab(shape["vocab"]),
                           shape["micro"], recompute=False, ffn_hidden=shape.get("ffn"),
                           num_attention_heads=shape["heads"], num_query_groups=shape.get("query_groups"),
                           gated_mlp=shape["kind"] == "llama")
    perf = throughput_metrics(step_s, tokens, 1, flops, device_peak_tflops(device.type, peak_dtype or shape["dtype"]))
    peak = torch.cuda.max_memory_allocated() if device.type == "cuda" else None
    return {"row": label, "shape": shape["kind"], "step_s": step_s, "tokens_per_s": perf["perf/tokens_per_s"],
            "tflops": perf["perf/tflops_per_gpu"], "mfu": perf.get("perf/mfu"), "peak_bytes": peak, "loss": loss}


def contained(label: str, shape: dict, make) -> dict:
    """The row `make` measures; where it raises, a row saying so in one line (rc 2), and the table goes on."""
    try:
        return make()
    except Exception as err:  # noqa: BLE001 - one row's failure (an inductor or CUDA error) must not lose the table
        first = (str(err).strip().splitlines() or [""])[0][:200]
        return {"row": label, "shape": shape["kind"], "rc": 2, "error": f"{type(err).__name__}: {first}"}


def plain_label(shape: dict, compiled: bool) -> str:
    return f"plain PyTorch {NAMES[shape['kind']]}, {'compiled' if compiled else 'eager'}"


def zero3d_label(shape: dict, fp8: str, stage: int, compiled: bool) -> str:
    kind = NAMES[shape["kind"]] + (f" FP8 {fp8}" if fp8 != "none" else "")
    return f"zero3d {kind} ({'compiled' if compiled else 'eager'}, stage {stage})"


def plain_model(shape: dict) -> torch.nn.Module:
    s, vocab = shape, padded_vocab(shape["vocab"])
    if s["kind"] == "llama":
        return PlainLlama(s["layers"], s["hidden"], s["heads"], s["query_groups"], s["ffn"], s["seq"], vocab,
                          s["rope_base"])
    return PlainGPT(s["layers"], s["hidden"], s["heads"], s["seq"], vocab)


def plain_row(shape: dict, device, compiled: bool, dry: bool, steps: int, profile=None) -> dict:
    torch.manual_seed(0)
    model = plain_model(shape).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, fused=device.type == "cuda")
    forward = torch.compile(model, backend="aot_eager" if dry else "inductor") if compiled else model
    tokens, losses = tokens_batch(shape, device), []
    autocast = torch.autocast(device.type, dtype=DTYPES[shape["dtype"]], enabled=shape["dtype"] != "fp32")

    def step():
        with autocast:
            loss = forward(tokens)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.detach())
    found = {}
    step_s = timed(step, steps, warmup=2, device=device, profile=profile and (lambda s: found.update(profile(s))))
    return dict(row(plain_label(shape, compiled), step_s, shape, device, losses[-1].item()), **found)


def free_port() -> int:
    import socket
    with socket.socket() as sock:  # the kernel picks an unused port: runs beside other jobs do not collide
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def model_overrides(shape: dict) -> list:
    """`pretrain` overrides building the shape (Llama: configs/tiny_llama.toml's architecture keys)."""
    s = shape
    overrides = [f"model.num_layers={s['layers']}", f"model.hidden_size={s['hidden']}",
                 f"model.num_attention_heads={s['heads']}", f"model.seq_length={s['seq']}",
                 f"model.vocab_size={s['vocab']}"]
    if s["kind"] == "llama":
        overrides += [f"model.num_query_groups={s['query_groups']}", f"model.ffn_hidden_size={s['ffn']}",
                      'model.position_embedding="rope"', f"model.rope_base={s['rope_base']}", 'model.mlp="swiglu"',
                      'model.norm="rmsnorm"', "model.norm_epsilon=1e-5", "model.bias=false",
                      "model.tie_embeddings=false"]
    return overrides


def zero3d_row(shape: dict, device, steps: int, fp8: str = "none", stage: int = 2, compiled: bool = False,
               dry: bool = False, profile=None) -> dict:
    """One rank of `pretrain`: megatron GPTModel (model.attention auto, the fused chunked loss) under the ZeRO engine
    at `stage`, its layers `compiled` (model.compile: inductor; the dry run aot_eager) or eager; `fp8`: precision.fp8's
    recipe (in bf16, whatever the shape's dtype). With the row: the estimator's peak of this rank (`estimate_bytes`,
    no margin: what `python -m pretrain --estimate` of the config says), beside the GPU's measured one."""
    import zero3d
    import pretrain.model.gpt as gpt
    from megatron.core import parallel_state
    from pretrain.config import load_config
    from pretrain.memory_check import estimate_config
    from pretrain.model.gpt import build_model, parallel_groups
    from pretrain.runtime.layout import init_layout
    from pretrain.step import loss_share, run_micro_batches, step_mean_loss
    from pretrain.train import engine_settings
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=os.environ.get("MASTER_PORT") or str(free_port()))
    cfg = load_config(None, model_overrides(shape) + [
        f"train.micro_batch_size={shape['micro']}", f"train.global_batch_size={shape['micro']}",
        f"precision.dtype={'bf16' if fp8 != 'none' else shape['dtype']}", f"precision.fp8={fp8}", f"zero.stage={stage}",
        f"model.compile={'true' if compiled else 'false'}", f"optimizer.lr={LR}", f"optimizer.clip_grad={CLIP}",
        "logging.wandb=false"])
    memory = estimate_config(cfg, 1, cfg.cluster.gpu_memory_gb * 2**30)  # the estimator's peak of this rank
    topo = init_layout(cfg)
    backend = gpt.COMPILE_BACKEND
    gpt.COMPILE_BACKEND = "aot_eager" if dry else backend  # the CPU dry run: no C++ build per row
    try:
        model = build_model(cfg, topo.device)
    finally:
        gpt.COMPILE_BACKEND = backend
    engine = zero3d.wrap_model(model, engine_settings(cfg), parallel_groups(model, topo))
    tokens, losses = tokens_batch(shape, topo.device), []

    def step():
        micro = run_micro_batches(engine, [tokens], cfg, topo)
        result = engine.step(cfg.optimizer.lr, sums=loss_share(micro, topo))  # the loop's one host read
        losses.append(step_mean_loss(result, topo))
    try:
        found = {}
        step_s = timed(step, steps, warmup=2, device=topo.device,
                       profile=profile and (lambda s: found.update(profile(s))))
        return dict(row(zero3d_label(shape, fp8, stage, compiled), step_s, shape, topo.device, losses[-1],
                        peak_dtype="fp8" if fp8 != "none" else ""),
                    estimate_bytes=memory.total_bytes - memory.margin_bytes, **found)
    finally:
        engine.close()
        parallel_state.destroy_model_parallel()


# zero3d's rows of each shape, as (stage, compiled): eager stage 2 (the rows measured before compiled layers existed),
# then compiled at stages 2 and 3: what the parity issue (#55) holds against the compiled plain model.
ZERO3D_ROWS = ((2, False), (2, True), (3, True))


def probe_rows(dry: bool, timeout: float, quick: bool = False, fp8: bool = False) -> list:
    """`probe --real` (dry run: fake, 2 layers, 1 step) of each paper rank slice in bf16 and fp16: tools/gpu_check.py's
    row; with `fp8`, the Llama-3 8B slice in bf16 and FP8 tensorwise under an 80 GB cap (the dry run: FP8 only)."""
    spec = importlib.util.spec_from_file_location("gpu_check", REPO / "tools/gpu_check.py")
    gpu_check = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gpu_check)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    # The paper configs pin the paper's Megatron kernels (materialized scores, whole-vocabulary logits) for its
    # memory figures; throughput rows run this stack's own: SDPA (or TE) and the chunked loss.
    fast = ['model.attention="auto"', "model.loss_chunk_tokens=1024"]
    rows = [gpu_check.probe_row(name, config, env, dry, timeout, overrides=[f"precision.dtype=\"{dtype}\""] + fast)
            for name, config in (PROBES[-1:] if quick else PROBES) for dtype in (("bf16",) if quick else ("bf16", "fp16"))]
    precisions = ([] if dry else [[]]) + [['precision.fp8="tensorwise"']]
    return rows + [gpu_check.probe_row(FP8_PROBE[0], FP8_PROBE[1], env, dry, timeout, overrides=extra + fast,
                                       memory_gb=80) for extra in (precisions if fp8 else [])]


def release_cuda(device) -> None:
    """Drop the previous rows' compiled graphs (dynamo's caches: a layer class recompiled for each row's model would
    reach its recompilation limit and run eager) and, on a GPU, the cached blocks they held, before the next row."""
    import gc
    torch._dynamo.reset()
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def fmt(value, spec: str) -> str:
    return "—" if value is None else format(value, spec)


def table(rows: list, title: str) -> str:
    """The rows as a markdown table; training rows with their tokens/s and peak ÷ the compiled plain model's."""
    plain = next((r for r in rows if r["row"].startswith("plain PyTorch") and r["row"].endswith("compiled")
                  and "tokens_per_s" in r), None)
    lines = [f"{title}", "", "| row | tokens/s | ÷ compiled plain | TFLOP/s | MFU | peak GiB | peak ÷ compiled plain "
             "| estimate GiB | step s | loss |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if "tokens_per_s" not in r:  # a probe row
            peak = r.get("peak_bytes")
            verdict = (r.get("verdict") or f"error: {r.get('error')}").split(" — ")[0]  # e.g. "verdict: FITS"
            lines.append(f"| {r['row']} (rc {r['rc']}, {verdict}) | — | — | "
                         f"{fmt(r.get('tflops'), '.1f')} | {fmt(r.get('mfu'), '.1%')} | "
                         f"{fmt(peak / 2**30 if peak else None, '.2f')} | — | — | {fmt(r.get('step_s'), '.3f')} | — |")
            continue
        peak = r["peak_bytes"] / 2**30 if r["peak_bytes"] else None
        speed = r["tokens_per_s"] / plain["tokens_per_s"] if plain else None
        memory = r["peak_bytes"] / plain["peak_bytes"] if plain and r["peak_bytes"] and plain["peak_bytes"] else None
        estimate = r.get("estimate_bytes")
        lines.append(f"| {r['row']} | {r['tokens_per_s']:.0f} | {fmt(speed, '.3f')} | {r['tflops']:.3g} | "
                     f"{fmt(r['mfu'], '.1%')} | {fmt(peak, '.2f')} | {fmt(memory, '.2f')} | "
                     f"{fmt(estimate / 2**30 if estimate else None, '.2f')} | {r['step_s']:.4f} | {r['loss']:.4f} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python bench/bench_gpu.py", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cpu-dry-run", action="store_true", help="tiny versions of every row on CPU")
    ap.add_argument("--steps", type=int, default=10, help="timed steps per training row (default 10)")
    ap.add_argument("--shapes", choices=("gpt", "llama", "both"), default="both",
                    help="which training rows: the GPT-2 1.3B shape, the Llama shape, or both (default)")
    ap.add_argument("--no-probes", action="store_true", help="skip the paper rank-slice probes")
    ap.add_argument("--quick", action="store_true", help="probe only the 100B slice, in bf16")
    ap.add_argument("--json", action="store_true", help="print the rows as JSON instead of a table")
    ap.add_argument("--profile", metavar="DIR", default="",
                    help="after each row's timed steps, 3 more under torch.profiler: where the device time goes (kernels "
                         "by kind, idle share, top kernels) printed after the tables, each chrome trace gzipped in DIR")
    ap.add_argument("--profile-row", metavar="TEXT", action="append", default=[],
                    help="with --profile, profile only the rows whose label holds TEXT (repeatable; default: every row)")
    ap.add_argument("--fp8", action="store_true",
                    help="add the FP8 rows: the Llama shape in precision.fp8 tensorwise and rowwise beside bf16, and the "
                         "Llama-3 8B rank slice probed in bf16 and FP8 (needs compute capability 8.9; the dry run "
                         "always runs them)")
    args = ap.parse_args(argv)
    if args.steps < 1:
        ap.error(f"--steps {args.steps} is invalid; must be >= 1")
    if args.profile_row and not args.profile:
        ap.error(f"--profile-row {args.profile_row[0]!r} chooses rows to profile: give --profile DIR too")
    dry = args.cpu_dry_run
    if not dry and not torch.cuda.is_available():
        ap.error("no CUDA device visible: run on a GPU machine, or use --cpu-dry-run")
    device = torch.device("cpu") if dry else torch.device("cuda", 0)
    shapes = {"gpt": DRY_SHAPE if dry else SHAPE, "llama": DRY_LLAMA_SHAPE if dry else LLAMA_SHAPE}
    if args.shapes != "both":
        shapes = {args.shapes: shapes[args.shapes]}
    rows, fp8, ceilings = [], args.fp8 or dry, {}

    def profiler(label: str):
        """--profile: each row's steps after the timed ones, under torch.profiler (its kernels' summary in the row)."""
        if not args.profile or (args.profile_row and not any(text in label for text in args.profile_row)):
            return None
        os.makedirs(args.profile, exist_ok=True)
        trace = os.path.join(args.profile, "".join(c if c.isalnum() else "_" for c in label) + ".json.gz")
        return lambda step: {"profile": kernel_profile(step, device, trace_to=trace)}
    for shape in shapes.values():
        release_cuda(device)  # the previous shape's compiled model must not crowd this one's rows
        zero3d = [(zero3d_label(shape, "none", stage, compiled),
                   lambda stage=stage, compiled=compiled: zero3d_row(
                       shape, device, args.steps, stage=stage, compiled=compiled, dry=dry,
                       profile=profiler(zero3d_label(shape, "none", stage, compiled))))
                  for stage, compiled in ZERO3D_ROWS]
        float8 = [(zero3d_label(shape, recipe, 2, True),
                   lambda recipe=recipe: zero3d_row(shape, device, args.steps, recipe, compiled=True, dry=dry,
                                                    profile=profiler(zero3d_label(shape, recipe, 2, True))))
                  for recipe in (FP8_RECIPES if fp8 and shape["kind"] == "llama" else ())]
        plain = [(plain_label(shape, compiled),
                  lambda compiled=compiled: plain_row(shape, device, compiled, dry, args.steps,
                                                      profile=profiler(plain_label(shape, compiled))))
                 for compiled in (False, True)]
        shown = [label for label, _ in (*zero3d, *float8, *plain)]  # the table's order
        measured = []
        for label, make in (*plain[::-1], *zero3d, *float8):  # the baseline first: a table cut short has its ratios
            release_cuda(device)  # each row's compiled graphs and cached blocks gone before the next row's peak
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats()
            measured.append(contained(label, shape, make))
            print(MEASURED + json.dumps(measured[-1], default=str), file=sys.stderr, flush=True)  # kept if cut short
        rows += sorted(measured, key=lambda r: shown.index(r["row"]))
        baseline = next((r for r in measured if r["row"] == zero3d_label(shape, "none", 2, True) and "step_s" in r), None)
        if float8 and baseline:  # what the FP8 rows could gain at most: the linears' GEMMs timed in bf16 and float8
            release_cuda(device)
            try:
                ceilings[shape["kind"]] = [fp8_ceiling(shape, recipe, baseline["step_s"], device)
                                           for recipe in FP8_RECIPES]
            except Exception as err:  # noqa: BLE001 - the rows stand without it
                print(f"FP8 ceiling not measured: {type(err).__name__}: {err}", file=sys.stderr)
    if not args.no_probes:
        release_cuda(device)  # the probes: subprocesses capped at 32 GB that these blocks must not crowd
        rows += probe_rows(dry, timeout=300, quick=args.quick, fp8=fp8)
    gpu = torch.cuda.get_device_name() if device.type == "cuda" else "CPU (dry run: tiny shapes, no GPU figure)"
    if args.json:
        print(json.dumps({"device": gpu, "shapes": shapes, "rows": rows, "fp8_ceilings": ceilings}, default=str))
    else:
        for kind, shape in shapes.items():
            spec = ", ".join(f"{k} {v}" for k, v in shape.items() if k != "kind")
            print(table([r for r in rows if r.get("shape") == kind], f"{gpu}; {NAMES[kind]} shape: {spec}"))
            if kind in ceilings:
                fp8_steps = {recipe: r["step_s"] for recipe in FP8_RECIPES for r in rows
                             if r["row"] == zero3d_label(shape, recipe, 2, True) and "step_s" in r}
                print(ceiling_table(ceilings[kind], fp8_steps, zero3d_label(shape, "none", 2, True)))
        if not args.no_probes:
            print(table([r for r in rows if "shape" not in r], f"{gpu}; the paper's rank slices (probe --real)"))
        if args.profile:
            print(profile_table(rows))
    return 0 if all(r.get("rc", 0) in (0, 1) for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
