"""`python -m analysis`: the memory estimator, the paper's tables and the planner from the command line."""
import argparse
import json
import os
import sys
from typing import Optional

from analysis.cluster import add_cluster_flags, described, spec_from_args
from analysis.estimate import (ATTENTION_KINDS, DEFAULT_MARGIN_FRACTION, GB, GIB, PRECISIONS, RECOMPUTE, Budget,
                               OptimizerStates, Parallelism, Step, ZeroChoice, estimate, format_breakdown,
                               model_state_bytes, padded_vocab)
from analysis.float8 import FLOAT8_RECIPES
from analysis.modes import ANALYSED
from analysis.offload_estimate import (OFFLOAD_PLACEMENTS, OFFLOAD_SHAPES, format_offload, largest_offload_gpt,
                                       offload_breakdown)
from model_shape.gpt import MLPS, NORMS, POSITION_EMBEDDINGS, GPTShape
from optim import SPECS, STATE_DTYPES
from zero3d.config import ZeroConfig

# The engine's [zero] defaults are the CLI's; precision, micro-batch, GPU memory and the loss chunk live
# only in pretrain's config (which zero3d never imports), so the flags below keep the paper's V100 set-up.
ZERO = ZeroConfig()
# --plan's CSV: the paper appendix's configurations, in the repository this command runs from.
PAPER_CSV = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "configs", "paper",
                         "reproduction-configs.csv")


def _format_states(params: float, dp: int, precision: str, optimizer: OptimizerStates) -> str:
    k = optimizer.k(precision)
    rows = [f"model states per GPU for Ψ = {params:g} parameters, N_d = {dp}, {precision}; {optimizer.name} with "
            f"{optimizer.state_dtype} states: K = {float(k):g} bytes a parameter",
            f"{'stage':<8}{'params GB':>12}{'grads GB':>12}{'optimizer GB':>14}{'total GB':>12}"]
    for stage in range(4):
        p, g, o = (float(x) / GB for x in model_state_bytes(int(params), stage, dp, precision, optimizer))
        rows.append(f"{stage:<8}{p:12.4f}{g:12.4f}{o:14.4f}{p + g + o:12.4f}")
    return "\n".join(rows)


def build_parser() -> argparse.ArgumentParser:
    """Flags for the estimator, the paper tables and the planner."""
    ap = argparse.ArgumentParser(prog="python -m analysis", description=__doc__)
    mode = ap.add_argument_group("modes")
    mode.add_argument("--table1", action="store_true", help="print the paper's Table I")
    mode.add_argument("--table2", action="store_true", help="print Table II's theoretical columns")
    mode.add_argument("--plan", choices=["paper", "csv", "rank"],
                      help="paper: findings + CSV verdicts; csv: verdicts only; rank: layouts for a shape")
    mode.add_argument("--global-batch", type=int, help="--plan rank: samples per step")
    mode.add_argument("--batch-per-gpu", type=int, help="--plan rank: samples per DP rank instead")
    mode.add_argument("--top", type=int, default=10, help="--plan rank: how many layouts to print")
    mode.add_argument("--csv", default=os.path.normpath(PAPER_CSV),
                      help="reproduction-configs.csv for --plan (default: this repository's configs/paper/ copy)")
    mode.add_argument("--params", type=float, help="bare parameter count: model states per stage only")
    for name in ("layers", "hidden", "heads", "vocab", "seq", "gpus"):
        ap.add_argument(f"--{name}", type=int)
    ap.add_argument("--dp", type=int, help="N_d: with --params, the DP size; with a shape, gpus = dp × tp")
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--stage", type=int, default=ZERO.stage, choices=[0, 1, 2, 3])
    ap.add_argument("--micro-batch", type=int, default=1)
    ap.add_argument("--recompute", choices=["none", "selective", "full", "any"], default="none",
                    help="model.recompute; any (--plan rank): the planner chooses per layout")
    ap.add_argument("--attention", choices=list(ATTENTION_KINDS), default="local",
                    help="local: megatron's materialised scores (the paper's); fused: SDPA / Transformer Engine, "
                         "the run's default (model.attention = auto / sdpa / te)")
    ap.add_argument("--loss-chunk-tokens", type=int, default=0,
                    help="model.loss_chunk_tokens: the fused loss's tokens at a time (0: megatron's loss over all "
                         "tokens' logits, the paper's; a run's default is 1024)")
    ap.add_argument("--loss-recompute", action="store_true", help="model.loss_recompute: each loss chunk recomputed")
    ap.add_argument("--compile", action="store_true",
                    help="model.compile: the compute at the share of peak measured with compiled layers "
                         "(analysis/throughput.py), and the fused loss's compiled softmax (in fp16 / bf16 2 + 2 "
                         "bytes a logit, not eager's 2 + 4)")
    ap.add_argument("--sequence-parallel", action="store_true",
                    help="parallel.sequence_parallel: activations sliced over TP's tokens (--plan rank: at tp > 1)")
    ap.add_argument("--pa", action="store_true", help="partition activation checkpoints over TP")
    ap.add_argument("--pa-cpu", action="store_true", help="Pa + offload the slices to host (implies --pa)")
    ap.add_argument("--bucket-elements", type=int, default=ZERO.bucket_elements,
                    help=f"CB: constant buffer size in elements (default: zero.bucket_elements = {ZERO.bucket_elements:_})")
    ap.add_argument("--no-cb", action="store_true", help="no CB: one 4Ψ fused fp32 gradient buffer instead")
    ap.add_argument("--precision", choices=list(PRECISIONS), default="fp16")
    ap.add_argument("--optimizer", choices=list(SPECS), default="adamw",
                    help="optimizer.name: its states give K (Muon's with a shape: its hidden matrices' share)")
    ap.add_argument("--state-dtype", choices=list(STATE_DTYPES), default="fp32",
                    help="optimizer.state_dtype: bytes of each optimizer state element")
    ap.add_argument("--fp8", choices=list(FLOAT8_RECIPES), default="none",
                    help="precision.fp8: the layers' GEMMs in float8 (their copies in memory; --plan rank: at the "
                         "GPU's float8 peak)")
    ap.add_argument("--fp8-gather", action="store_true",
                    help="zero.fp8_gather: stage 3 gathers the layers' linear weights as float8 (needs --fp8 tensorwise)")
    ap.add_argument("--tied", action="store_true", help="output layer shares the word embedding")
    arch = ap.add_argument_group("architecture (default GPT-2's; a Llama-3: --ffn 14336 --query-groups 8 --mlp swiglu "
                                 "--norm rmsnorm --position-embedding rope --no-bias)")
    arch.add_argument("--ffn", type=int, help="MLP width (each of gate and up under SwiGLU); default 4 × hidden")
    arch.add_argument("--query-groups", type=int, help="key/value heads (GQA); default one per head")
    arch.add_argument("--mlp", choices=list(MLPS), default="gelu")
    arch.add_argument("--norm", choices=list(NORMS), default="layernorm")
    arch.add_argument("--position-embedding", choices=list(POSITION_EMBEDDINGS), default="learned")
    arch.add_argument("--no-bias", action="store_true", help="no biases on the linear layers")
    arch.add_argument("--qk-layernorm", action="store_true", help="a norm over each query and key head")
    arch.add_argument("--qkv-bias", action="store_true",
                      help="biases on the QKV projection alone (Qwen2; with --no-bias)")
    arch.add_argument("--head-dim", type=int, help="the head size (megatron's kv_channels); default hidden / heads")
    ap.add_argument("--prefetch-units", type=int, default=ZERO.prefetch_units, help="stage 3 units gathered ahead")
    ap.add_argument("--margin-fraction", type=float, default=DEFAULT_MARGIN_FRACTION)
    ap.add_argument("--json", action="store_true", help="print JSON instead of a table (not with --plan)")
    off = ap.add_argument_group("offload (ZeRO-Offload / ZeRO-Infinity; docs/estimator.md, Offload)")
    off.add_argument("--offload-optimizer", choices=list(OFFLOAD_PLACEMENTS), default=ZERO.offload_optimizer,
                     help="fp32 master + Adam moments on the host (cpu) or in files (nvme); stages 1-3")
    off.add_argument("--offload-params", choices=list(OFFLOAD_PLACEMENTS), default=ZERO.offload_params,
                     help="stage 3: parameter shards on the host or in files (needs --offload-optimizer)")
    off.add_argument("--nvme-buffer-bytes", type=int, default=ZERO.nvme_buffer_bytes,
                     help="host buffers of the NVMe stream (zero.nvme_buffer_bytes)")
    off.add_argument("--largest", action="store_true",
                     help="the largest GPT whose device memory fits: bisects layers at --hidden/--heads, or at "
                          "the Figure 7 shapes, 5120 × 40, then hidden + 1024 (heads = hidden / 128) until not "
                          "one layer fits; --gpus/--vocab/--seq default 1 (the described cluster's GPUs with a "
                          "cluster flag)/50257/1024")
    off.add_argument("--shape-rule", choices=["trained", "free"],
                     help="--largest: 'trained' searches published aspect ratios (32 <= hidden/layers <= 131, head "
                          "size 128); 'free' bisects layers at each hidden (the paper's study). Default: free on the "
                          "paper's cluster, trained with a cluster flag")
    add_cluster_flags(ap)
    mode.add_argument("--predict-table", action="store_true",
                      help="Figure 2's ZeRO rows (1.5B..170B) on the described cluster: the planner's layout, memory "
                           "and predicted TFLOP/s per GPU (files and plot: python slurm/collect.py --predict)")
    mode.add_argument("--efficiency", action="store_true",
                      help="the measured rows the planner's compute time reads (analysis/throughput.py): each GPU and "
                           "kernel path's share of peak, and each row predicted from the others")
    mode.add_argument("--sizes", help="--predict-table: Figure 2 rows to keep, e.g. 8B,20B (default: all)")
    zpp = ap.add_argument_group("ZeRO++ (node-aware stage 3; docs/estimator.md, ZeRO++)")
    zpp.add_argument("--zeropp", nargs="*", metavar="MODEL",
                     help=f"α-β step time per link for stage 3, {', '.join(ANALYSED[1:-1])} and all three on "
                          "Figure 2's 400-GPU rows (default: 100B 170B), DGX-2 and H100 nodes")
    zpp.add_argument("--grad-bits", type=int, choices=[4, 8], default=4, help="--zeropp: qgZ's bits")
    zpp.add_argument("--quant-block", type=int, default=256, help="--zeropp: elements per quantization scale")
    return ap


def _zeropp(ap: argparse.ArgumentParser, args) -> int:
    """--zeropp: the predicted step time of the ZeRO++ modes (zeropp_report)."""
    from analysis.zeropp_report import zeropp_report
    if args.quant_block < 2 or args.quant_block % 2:
        ap.error(f"--quant-block {args.quant_block} is invalid; must be an even integer >= 2")
    try:
        clusters = {"clusters": (args.spec.cluster(args.precision),)} if described(args) else {}
        print(zeropp_report(args.csv, tuple(args.zeropp) or ("100B", "170B"), args.grad_bits, args.quant_block,
                            **clusters))
    except ValueError as err:
        ap.error(str(err))
    return 0


def _offload_args(args) -> dict:
    return dict(offload_optimizer=args.offload_optimizer, offload_params=args.offload_params,
                nvme_buffer_bytes=args.nvme_buffer_bytes)


def _largest(ap: argparse.ArgumentParser, args) -> int:
    """--largest: the biggest GPT whose device memory fits with the requested offload."""
    from analysis.shapes import TRAINED
    shapes = ((args.hidden, args.heads),) if args.hidden and args.heads else None
    rule_name = args.shape_rule or ("trained" if described(args) else "free")
    rule = TRAINED if rule_name == "trained" and shapes is None else None
    gpus = args.gpus or (args.spec.cluster().gpus if described(args) else 1)
    try:
        found = largest_offload_gpt(rule=rule,
            hidden_heads=shapes, gpus=gpus, tp=args.tp, stage=args.stage, micro_batch=args.micro_batch,
            vocab=args.vocab or 50257, seq=args.seq or 1024, recompute=args.recompute,
            bucket_elements=args.bucket_elements, precision=args.precision,
            gpu_memory_bytes=args.gpu_memory_gb * GIB, margin_fraction=args.margin_fraction, **_offload_args(args))
    except ValueError as err:
        ap.error(str(err))
    o = found.offload
    if args.json:
        out = {"layers": found.layers, "hidden": found.hidden, "heads": found.heads, "params": found.params,
               "shape_rule": rule.describe() if rule else "free", "gpus": gpus, "tp": args.tp, "stage": args.stage, "micro_batch": args.micro_batch}
        if found.layers:
            out.update(grads_on_host=o.grads_on_host, device=o.device.to_dict(), offload_host_bytes=o.host_bytes,
                       offload_nvme_bytes=o.nvme_bytes, offload_pcie_bytes_per_step=o.pcie_bytes_per_step)
        print(json.dumps(out, indent=2))
        return 0
    if not found.layers:
        print(f"no GPT of the shape (hidden, heads) {shapes[0]} fits" if shapes else
              f"no GPT fits: not one layer at (hidden, heads) {OFFLOAD_SHAPES[0]} or any larger shape")
        return 0
    print(f"largest GPT: {found.layers} layers × hidden {found.hidden} ({found.heads} heads) = "
          f"{found.params / 1e9:.2f}B parameters on {gpus} GPU(s), tp {args.tp}, stage {args.stage}, "
          f"micro-batch {args.micro_batch}, recompute {args.recompute}, {args.precision}, "
          f"gradients {'on the host' if o.grads_on_host else 'on the device'}")
    print(rule.describe() if rule else "shape rule: free (layers bisected at each hidden size; --shape-rule trained: "
          "published aspect ratios)" if shapes is None else f"shape: given (hidden {found.hidden}, {found.heads} heads)")
    print(format_breakdown(o.device, "device memory:"))
    if args.offload_optimizer != "none":
        print(format_offload(o))
    return 0


def model_shape(args, vocab: int, seq: int) -> GPTShape:
    """The GPTShape the flags describe (ValueError naming a bad value)."""
    return GPTShape(layers=args.layers, hidden=args.hidden, heads=args.heads, seq=seq, vocab=vocab, ffn=args.ffn,
                    query_groups=args.query_groups, mlp=args.mlp, norm=args.norm,
                    position_embedding=args.position_embedding, bias=not args.no_bias,
                    qk_layernorm=args.qk_layernorm, tied=args.tied, qkv_bias=args.qkv_bias, kv_channels=args.head_dim)


def _rank(ap: argparse.ArgumentParser, args) -> int:
    """--plan rank: feasible layouts for a shape on the described cluster, best modelled throughput first."""
    from analysis.planner import GPT2_VOCAB, PAPER_SEQ, format_candidates, plan
    from analysis.throughput import KernelPath
    if None in (args.layers, args.hidden, args.heads):
        ap.error("--plan rank needs --layers, --hidden, --heads and one of --global-batch, --batch-per-gpu")
    try:
        cluster = args.spec.cluster(args.precision)
        gpus = args.gpus or cluster.gpus
        found = plan(cluster, model=model_shape(args, args.vocab or GPT2_VOCAB, args.seq or PAPER_SEQ), gpus=gpus,
                     global_batch=args.global_batch, batch_per_gpu=args.batch_per_gpu,
                     recompute=RECOMPUTE if args.recompute == "any" else args.recompute,
                     bucket_elements=args.bucket_elements, margin_fraction=args.margin_fraction,
                     fp8_gather=args.fp8_gather, step=_step(args, 1))
    except ValueError as err:
        ap.error(str(err))
    offload = " (none fits without offload; the first offload tier that fits)" if found and found[0].offload else ""
    print(f"{len(found)} feasible layouts on {cluster.name} ({gpus} GPUs){offload}; best first:")
    print(f"compute at {cluster.efficiency_along(KernelPath.of(_step(args, 1)))}")
    print(format_candidates(found, args.top))
    return 0


def _step(args, micro_batch: int) -> Step:
    """What a step holds, from the flags (its micro-batch and recompute the caller's)."""
    return Step(micro_batch, "none" if args.recompute == "any" else args.recompute, args.precision, args.attention,
                args.loss_chunk_tokens, args.loss_recompute, args.fp8, sequence_parallel=args.sequence_parallel,
                compiled=args.compile)


def _print_tables(args) -> int:
    """--table1 / --table2, as markdown or (--json) as the cells: text and bold per Table I cell."""
    from analysis.paper_tables import table_one, table_one_cells, table_two, table_two_cells
    if not args.json:
        print("\n\n".join(t() for t, on in ((table_one, args.table1), (table_two, args.table2)) if on))
        return 0
    out = {}
    if args.table1:
        out["table1"] = [{"dp": dp, "cells": [{"text": text, "bold": bold} for text, bold in cells]}
                         for dp, cells in table_one_cells()]
    if args.table2:
        out["table2"] = [{"mp": mp, "gpus": gpus, "baseline": c[0], "p_os": c[1], "p_os+g": c[2], "p_os+g+p": c[3]}
                         for mp, gpus, c in table_two_cells()]
    print(json.dumps(out, indent=2))
    return 0


def main(argv: Optional[list] = None) -> int:
    """CLI entry point; see build_parser() and docs/estimator.md."""
    ap = build_parser()
    args = ap.parse_args(argv)
    if args.no_cb:
        args.bucket_elements = None
    elif args.bucket_elements <= 0:
        ap.error(f"--bucket-elements {args.bucket_elements} is invalid; must be > 0 (--no-cb: no CB)")
    if args.table1 or args.table2:
        return _print_tables(args)
    if args.efficiency:
        from analysis.throughput import rows_table
        print(rows_table())
        return 0
    if not 0 <= args.margin_fraction < 1:
        ap.error(f"--margin-fraction {args.margin_fraction} is invalid; must be in [0, 1)")
    if args.gpu_memory_gb is not None and args.gpu_memory_gb <= 0:
        ap.error(f"--gpu-memory-gb {args.gpu_memory_gb} is invalid; must be > 0")
    try:
        args.spec = spec_from_args(args)
    except (ValueError, OSError) as err:
        ap.error(str(err))
    args.gpu_memory_gb = args.spec.gpu_memory_bytes / GIB
    if args.zeropp is not None:
        return _zeropp(ap, args)
    if args.predict_table:
        from analysis.predict_table import format_rows, predict_rows
        try:
            cluster = args.spec.cluster(args.precision)
            rows = predict_rows(cluster, args.csv, args.sizes.split(",") if args.sizes else None, args.precision,
                                args.gpus)
        except ValueError as err:
            ap.error(str(err))
        print(format_rows(cluster, rows))
        return 0
    if args.plan and args.json:
        ap.error(f"--json is not available with --plan {args.plan} (its report is text); "
                 "--json works with --table1/--table2, --params, --largest and a shape")
    if args.dp is not None and (args.plan or args.largest):
        ap.error(f"--dp {args.dp} is not used by {'--plan' if args.plan else '--largest'}; "
                 "give --gpus (and --tp) instead")
    if args.loss_chunk_tokens < 0:
        ap.error(f"--loss-chunk-tokens {args.loss_chunk_tokens} is invalid; must be >= 0 (0: whole logits)")
    if args.recompute == "any" and args.plan != "rank":
        ap.error("--recompute any is the planner's choice (--plan rank); elsewhere give none, selective or full")
    if args.plan == "rank":
        return _rank(ap, args)
    if args.largest:
        return _largest(ap, args)
    if args.plan:
        if described(args):
            ap.error(f"--plan {args.plan} judges the paper's runs on the paper's cluster; a cluster flag is not used "
                     "there (your cluster: --plan rank, --largest, --zeropp, --predict-table)")
        from analysis.paper_configs import paper_report
        if not os.path.isfile(args.csv):
            ap.error(f"--csv {args.csv!r} is not a file")
        print(paper_report(csv_path=args.csv, csv_only=args.plan == "csv"))
        return 0
    if args.params is not None:
        if args.params <= 0 or args.dp is None or args.dp <= 0:
            ap.error(f"--params {args.params:g} needs a value > 0 and --dp a positive integer "
                     f"(got --dp {args.dp})")
        if SPECS[args.optimizer].matrix is not None:
            ap.error(f"--optimizer {args.optimizer} with --params: its K depends on the share of hidden matrices; "
                     "give a shape (--layers --hidden --heads --vocab --seq) instead")
        optimizer = OptimizerStates(args.optimizer, args.state_dtype)
        states = {s: [float(x) for x in model_state_bytes(int(args.params), s, args.dp, args.precision, optimizer)]
                  for s in range(4)}
        print(json.dumps(states) if args.json else _format_states(args.params, args.dp, args.precision, optimizer))
        return 0
    if args.dp is not None:  # shape mode: N_d = gpus / tp, so --dp gives the GPUs or must agree with them
        if args.dp < 1:
            ap.error(f"--dp {args.dp} is invalid; must be >= 1")
        if args.gpus is None:
            args.gpus = args.dp * args.tp
        elif args.gpus != args.dp * args.tp:
            ap.error(f"--dp {args.dp} disagrees with --gpus {args.gpus} / --tp {args.tp} = {args.gpus / args.tp:g}; "
                     "give --gpus or --dp, or values with gpus = dp × tp")
    missing = [f"--{n}" for n in ("layers", "hidden", "heads", "vocab", "seq", "gpus")
               if getattr(args, n) is None]
    if missing:
        ap.error(f"missing {', '.join(missing)} (or use --params, --table1, --table2, --plan)")
    pa = args.pa or args.pa_cpu
    try:
        shape = model_shape(args, args.vocab, args.seq)
        layout = Parallelism(args.gpus, args.tp)
        zero = ZeroChoice(args.stage, pa, args.pa_cpu, bucket_elements=args.bucket_elements,
                          prefetch_units=args.prefetch_units, fp8_gather=args.fp8_gather, **_offload_args(args))
        step = _step(args, args.micro_batch)
        optimizer = OptimizerStates.of_shape(shape, args.tp, args.optimizer, args.state_dtype)
        m = estimate(shape, layout, zero, step, Budget(args.gpu_memory_gb * GIB, args.margin_fraction), optimizer)
        offload = None
        if args.offload_optimizer != "none" or args.offload_params != "none":
            offload = offload_breakdown(m, layout, zero, args.precision, optimizer=optimizer)
            m = offload.device
    except ValueError as err:
        ap.error(str(err))
    if args.json:
        out = m.to_dict()
        if offload is not None:
            out.update({f"host_{k}_bytes": v for k, v in offload.host.items()})
            out.update({f"nvme_{k}_bytes": v for k, v in offload.nvme.items()})
            out.update(offload_host_bytes=offload.host_bytes, offload_nvme_bytes=offload.nvme_bytes,
                       offload_pcie_bytes_per_step=offload.pcie_bytes_per_step,
                       offload_nvme_bytes_per_step=offload.nvme_bytes_per_step)
        print(json.dumps(out, indent=2))
        return 0
    cb = f"CB {args.bucket_elements} elements" if args.bucket_elements else "no CB"
    zr = " + Pa+cpu" if args.pa_cpu else " + Pa" if pa else ""
    header = (f"{args.layers} layers, hidden {args.hidden}, {args.heads} heads, vocab {args.vocab} "
              f"(padded {padded_vocab(args.vocab, args.tp)}), seq {args.seq}\n"
              f"{args.gpus} GPUs = tp {args.tp} × dp {args.gpus // args.tp}; ZeRO stage {args.stage}"
              f"{zr}, {cb}, recompute {args.recompute}, micro-batch {args.micro_batch}, {args.precision}, "
              f"{args.optimizer} with {args.state_dtype} states")
    print(format_breakdown(m, header))
    if offload is not None:
        print(format_offload(offload))
    return 0


if __name__ == "__main__":
    sys.exit(main())
