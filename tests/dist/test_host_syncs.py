"""Host syncs per training step (docs/metrics.md, "Host syncs per step"): a counting shim over Tensor.item / .cpu /
.tolist / bool() / float() / int() and torch.cuda.synchronize (and CUDA's sync debug mode where a GPU is present),
over every ZeRO stage, fp16 loss scaling, Pa+cpu, a 2-stage pipeline and ZeRO++'s qgZ / qwZ: none in
forward/backward, one in engine.step (one vector all-reduced over every rank: the squared gradient norm — overflow,
clip and norm decided from it — the step's loss sum and the ranks' stop requests), read through the loop's own
`pretrain.step.finish_step`, whose mean loss equals the separately all-reduced `mean_loss` bit for bit; on CPU torch's foreach AdamW also reads its host step counter twice per
optimizer tensor (its two bias corrections; a host tensor: no device wait)."""
import contextlib
import traceback
from collections import Counter

import torch

from gpt_harness import BASE, SyntheticTokens
from ranks import run_ranks

CASES = {  # 2 ranks each
    "stage0": ["zero.stage=0"],
    "stage1_bf16": ["zero.stage=1", "precision.dtype=bf16"],
    "stage2_fp16": ["zero.stage=2", "precision.dtype=fp16"],
    "stage3": ["zero.stage=3"],
    "tp2_pa_cpu": ["parallel.tensor=2", "zero.stage=2", "model.recompute=full", "zero.partition_activations=true",
                   "zero.cpu_checkpointing=true"],
    "pp2": ["parallel.pipeline=2", "zero.stage=1"],
    # ZeRO++ on 2 nodes × 1 rank: qgZ's bucket reduce-scatter (its overflow flag agreed on the device) and
    # qwZ's quantized gathers inside forward/backward
    "stage2_qgz": ["zero.stage=2", "zero.quantize_gradients=int8", "cluster.gpus_per_node=1"],
    "stage3_qwz_qgz": ["zero.stage=3", "zero.quantize_weights=int8", "zero.quantize_gradients=int4",
                       "cluster.gpus_per_node=1"],
}
EXPECTED = {"forward_backward": 0, "engine.step": 1}  # per step; docs/metrics.md


@contextlib.contextmanager
def counting_syncs(counts: Counter, phase: list):
    """Counts every call of the host-reading methods under the current `phase[0]` (`bool(t)`, `float(t)`,
    `int(t)` of a tensor too)."""
    originals = {(torch.Tensor, n): getattr(torch.Tensor, n)
                 for n in ("item", "cpu", "tolist", "__bool__", "__float__", "__int__")}
    originals[(torch.cuda, "synchronize")] = torch.cuda.synchronize

    def counted(name, fn):
        def wrapper(*args, **kwargs):
            # torch's CPU AdamW (foreach) reads its host step counter, twice per parameter tensor
            in_adamw = any("/torch/optim/" in f.filename for f in traceback.extract_stack()[:-1])
            counts[(phase[0], "adamw step counter" if in_adamw else name)] += 1
            return fn(*args, **kwargs)
        return wrapper
    for (owner, name), fn in originals.items():
        setattr(owner, name, counted(name, fn))
    try:
        yield
    finally:
        for (owner, name), fn in originals.items():
            setattr(owner, name, fn)


@contextlib.contextmanager
def no_cuda_syncs():
    """On a GPU, any synchronizing CUDA call (implicit ones too) raises inside; nothing on CPU."""
    if not torch.cuda.is_available():
        yield
        return
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode("default")


def syncs_rank(rank, world_size, steps=2):
    import zero3d
    from pretrain.runtime.layout import destroy_model_parallel_groups
    from pretrain.config import load_config
    from pretrain.model.gpt import activation_checkpointing, build_model, parallel_groups
    from pretrain.runtime.layout import init_layout
    from pretrain.step import finish_step, mean_loss, run_micro_batches
    from pretrain.train import Batches, engine_settings
    out = {}
    for name, overrides in CASES.items():
        cfg = load_config(None, BASE + ["train.global_batch_size=4", *overrides])
        topo = init_layout(cfg)
        activations = activation_checkpointing(cfg.zero, topo.tp_group)
        model = build_model(cfg, topo.device, activations)
        engine = zero3d.wrap_model(model, engine_settings(cfg), parallel_groups(model, topo))
        batches = Batches(SyntheticTokens(cfg.model.vocab_size, cfg.model.seq_length), cfg.train, cfg.data, topo)
        counts, phase, losses_by_path, stops, written = Counter(), ["warm-up"], [], [], []
        with counting_syncs(counts, phase):
            for step in range(1 + steps):  # step 0: warm-up (optimizer states, stage 3's recorded order)
                phase[0] = "data"  # synthetic tokens drawn on the host: not the step's business
                micro_batches = [batches.get(step, i) for i in range(topo.grad_accum)]
                phase[0] = "forward_backward" if step else "warm-up"
                with no_cuda_syncs() if step else contextlib.nullcontext():
                    losses = run_micro_batches(engine, micro_batches, cfg, topo)
                phase[0] = "engine.step" if step else "warm-up"  # the loop's own code after backward
                # a pending save is published only when every rank's part is written: rank 0 alone is not enough
                loss, result, stopping, all_written = finish_step(
                    engine, losses, step, cfg, topo, stop_requested=lambda: step == steps and torch.distributed.get_rank() == 1,
                    save_written=lambda: step == steps or torch.distributed.get_rank() == 0)
                stops.append(stopping)
                written.append(all_written)
                phase[0] = "reference"  # the separate all-reduce the loop used to run (evaluate still does)
                losses_by_path.append((loss, mean_loss(losses, topo)))
        out[name] = dict(counts={k: v for k, v in counts.items() if k[0] not in ("warm-up", "data", "reference")},
                         losses=losses_by_path, stops=stops, written=written,
                         optimizer_tensors=sum(len(g["params"]) for g in engine.optimizer.param_groups),
                         fused=engine.optimizer.fused)
        destroy_model_parallel_groups()
    return out


def test_host_syncs_per_step_hold_the_documented_numbers():
    steps = 2
    for rank_out in run_ranks(syncs_rank, 2, timeout=240):
        for case, out in rank_out.items():
            counts = out["counts"]
            adamw = counts.pop(("engine.step", "adamw step counter"), 0)
            per_phase = Counter()
            for (phase, _), n in counts.items():
                per_phase[phase] += n
            assert dict(per_phase) == {p: n * steps for p, n in EXPECTED.items() if n}, (case, counts)
            # CPU: two host reads of the step counter per optimizer tensor (the bias corrections); CUDA's fused
            # AdamW keeps it on the device
            assert adamw == (0 if out["fused"] else 2 * steps * out["optimizer_tensors"]), (case, adamw)
            # the loss from engine.step's read is the separately all-reduced mean, bit for bit (fp64), every rank
            assert all(new == old for new, old in out["losses"]) and len(out["losses"]) == 1 + steps, (
                case, out["losses"])
            # a stop requested on rank 1 alone in the last step is every rank's stop, in the same read
            assert out["stops"] == [False] * steps + [True], (case, out["stops"])
            assert out["written"] == [False] * steps + [True], (case, out["written"])
