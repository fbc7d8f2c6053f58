"""Per-GPU memory estimator for a GPT shape under tensor parallelism × ZeRO: `estimate(shape, layout, zero, step,
budget, optimizer)`, each argument one of analysis/job.py's objects (or the model's GPTShape, the optimizer's
OptimizerStates)."""
import dataclasses
from dataclasses import dataclass
from fractions import Fraction
from typing import Optional

from analysis.activations import layer_bytes, mlp_activation_bytes, selective_layer_bytes
from analysis.context import context_backward_bytes, context_layer_bytes, local_shape, validate_context
from analysis.float8 import float8_copy_bytes, gathered_unit_bytes
from analysis.job import (DEFAULT_BUCKET_ELEMENTS, DEFAULT_MARGIN_FRACTION, GIB, V100_MEMORY_BYTES,  # noqa: F401
                          Budget, Parallelism, Step, ZeroChoice, job_of)
from analysis.loss_memory import loss_bytes
from analysis.model_states import (ADAMW_FP32, MASTER_BYTES, PRECISIONS, OptimizerStates,  # noqa: F401
                                   Precision, late_shard_room, model_state_bytes)
from analysis.modes import extra_state_bytes, mode_costs  # noqa: F401 (extra_state_bytes: its readers)
from analysis.stage3_peak import final_norm_bytes, stage3_moments, stage3_peak
from analysis.step_moment import gradient_join_bytes, step_moment_bytes, whole_matrix_step_bytes
from model_shape.gpt import VOCAB_DIVISIBLE_BY, GPTShape, padded_vocab

GB = 10**9  # the paper's unit: 7.5B params × 16 bytes = 120 GB exactly


def paper_shape(hidden: int, layers: int = 1, heads: int = 1, vocab: int = 1, seq: int = 1, tied: bool = False,
                ffn_hidden: Optional[int] = None, vocab_divisible_by: int = VOCAB_DIVISIBLE_BY) -> GPTShape:
    """The paper's GPT-2-shaped decoder (learned positions, GELU, LayerNorm, biases, multi-head) as a GPTShape."""
    return GPTShape(layers=layers, hidden=hidden, heads=heads, seq=seq, vocab=vocab, ffn=ffn_hidden, tied=tied,
                    vocab_divisible_by=vocab_divisible_by)


def layer_param_count(hidden: int, tp: int = 1, ffn_hidden: Optional[int] = None) -> int:
    """Parameters of one GPT-2 layer on one TP rank (12h² + 13h at tp = 1, ffn = 4h): GPTShape.layer_params."""
    return paper_shape(hidden, ffn_hidden=ffn_hidden).layer_params(tp)


def embedding_param_count(hidden: int, vocab: int, seq: int, tp: int = 1,
                          vocab_divisible_by: int = VOCAB_DIVISIBLE_BY) -> int:
    """Word embedding (this rank's slice of the padded vocabulary) + learned position embedding."""
    return paper_shape(hidden, vocab=vocab, seq=seq, vocab_divisible_by=vocab_divisible_by).embedding_params(tp)


def gpt_param_count(layers: int, hidden: int, vocab: int, seq: int, tp: int = 1, tied: bool = False,
                    ffn_hidden: Optional[int] = None, vocab_divisible_by: int = VOCAB_DIVISIBLE_BY) -> int:
    """Parameters on one TP rank of megatron-core's GPTModel (local spec, learned positions, biases)."""
    return paper_shape(hidden, layers, 1, vocab, seq, tied, ffn_hidden, vocab_divisible_by).params(tp)


# What core attention keeps for backward besides Q, K, V and its output (docs/estimator.md, Activations):
# "local": megatron's DotProductAttention materializes the [b·a, s, s] scores and keeps, per score, the
#   softmax output (e), the dropout mask (1 byte) and the dropout output (e) (Korthikanti et al.; the paper's
#   Megatron, so the paper's tables use it); "fused": a flash / memory-efficient / cuDNN SDPA kernel or
#   Transformer Engine's fused attention keeps only the softmax statistics, one fp32 logsumexp per query
#   row and head, and regenerates dropout from the RNG state (no mask).
ATTENTION_KINDS = ("local", "fused")
# What a layer keeps for backward: every activation, its GEMMs' and fused attention's outputs (selective:
# pretrain/model/recompute.py), or only its input (full: recomputed whole in backward).
RECOMPUTE = ("none", "selective", "full")
SOFTMAX_STAT_BYTES = 4  # fp32 logsumexp


def attention_state_bytes(attention: str, seq: int, micro_batch: int, heads: int, act_bytes: int = 2) -> int:
    """Bytes core attention keeps for backward beyond Q, K, V and its output, over all heads (÷ tp per rank)."""
    s, b, a, e = seq, micro_batch, heads, act_bytes
    if attention == "local":
        return a * s * s * b * (2 * e + 1)
    if attention == "fused":
        return a * s * b * SOFTMAX_STAT_BYTES
    raise ValueError(f"attention = {attention!r} is invalid; valid: {', '.join(map(repr, ATTENTION_KINDS))}")


def layer_activation_bytes(seq: int, micro_batch: int, hidden: int, heads: int, tp: int,
                           act_bytes: int = 2, ffn_hidden: Optional[int] = None, attention: str = "local") -> int:
    """Korthikanti et al. 2022 (no sequence parallelism) activations one GPT-2 layer keeps for backward
    (activations.layer_bytes for any shape).

    At 2-byte activations, ffn = 4h and local attention this is s·b·h·(10 + 24/t + 5·a·s/(h·t)); dropout
    masks are 1 byte per element whatever the activation dtype, so the general form keeps them apart.
    Fused attention (ATTENTION_KINDS) replaces the 5·a·s/(h·t) score term by a·s·b·4/t bytes of statistics.
    """
    shape = paper_shape(hidden, heads=heads, seq=seq, ffn_hidden=ffn_hidden)
    return layer_bytes(shape, micro_batch, tp, act_bytes,
                       attention_state_bytes(attention, seq, micro_batch, heads, act_bytes))


def document_mask_bytes(seq: int, micro_batch: int, micro_batches: int, in_flight: int, act_bytes: int,
                        attention: str) -> int:
    """Per-sample attention masks of document boundaries (pretrain's data.reset_attention_mask): the step's
    [b, 1, s, s] bool masks, one byte each, all on the device from the step's start (its micro-batches are
    loaded together), and under fused attention (SDPA) the additive [b, 1, s, s] bias of `act_bytes` each
    micro-batch in flight keeps for backward (one per forward, shared by its layers); whole on every TP rank."""
    per_mask = micro_batch * seq * seq
    bias = per_mask * act_bytes * min(in_flight, micro_batches) if attention == "fused" else 0
    return micro_batches * per_mask + bias


def backward_transient_bytes(shape: GPTShape, micro_batch: int, tp: int, act_bytes: int = 2,
                             attention: str = "local") -> int:
    """Activation gradients alive beside the working set while a layer back-propagates (the last layer, first
    in backward, recomputed under full recomputation): the larger of two moments of its backward.

    - fc2, the MLP's output GEMM: the gradient arriving at its output, s·b·h·e (whole on every TP rank), and
      the one it produces for its input, s·b·f·e/t (its weight's gradient lands in a bucket:
      `gradient_bucket_elements`);
    - local attention's score backward: the gradients of the dropout output and of the softmax output,
      2·a·s²·b·e/t, less the fc1 and activation outputs the MLP's backward has freed by then (2·s·b·f·e/t,
      3·s·b·f·e/t gated). Fused attention (ATTENTION_KINDS) keeps no scores, so fc2's moment is the one.
    """
    s, b, h, a, t, e = shape.seq, micro_batch, shape.hidden, shape.heads, tp, act_bytes
    fc2 = s * b * h * e + s * b * shape.ffn_size * e // t
    if attention != "local":
        return fc2
    scores = (2 * a * s * s * b * e - mlp_activation_bytes(shape, b, e)) // t
    return max(fc2, scores)


def gradient_bucket_elements(shape: GPTShape, psi: int, tp: int, bucket_elements: Optional[int]) -> int:
    """Elements of the stage 3 gradient bucket a layer's backward fills first: the one holding fc2's weight
    (h·f/t, the first gradient a layer makes). zero3d/flat.py's `bucket_members` closes a bucket at
    >= bucket_elements and gives a larger parameter a bucket of its own; a bucket never spans two gather units,
    so it is at most the layer's parameters. Without CB (None): the whole Ψ."""
    if bucket_elements is None:
        return psi
    return max(shape.hidden * shape.ffn_size // tp, min(bucket_elements, shape.layer_params(tp)))


def buffer_terms(shape: GPTShape, *, stage: int, psi: int, micro_batch: int, tp: int,
                 bucket_elements: Optional[int], precision: str, prefetch_units: int,
                 attention: str = "local", cp: int = 1, float8: str = "none", fp8_gather: bool = False,
                 dp: int = 1) -> dict:
    """{term: bytes} of the temporary buffers at the rank's peak; `buffer_bytes` is their sum.

    Stages 0-2 (the paper's ZeRO-100B, whose tables and maxima this estimator reproduces): the paper's fused
    fp32 gradient buffer, 4Ψ (§III-B), capped by CB at one bucket, 4·min(CB, Ψ). Their executed backward
    transients (docs/estimator.md, Rank-local probe) stay inside the margin, as in the paper's accounting.

    Stage 3 (not in the paper: this engine, zero3d/stage3.py) at the backward of the last layer, every checkpoint
    still held (one of its moments, stage3_peak.py; docs/estimator.md, Temporary buffers):
    - "gradient bucket": the bucket fc2's weight gradient lands in, b_g·gradient_bucket_elements (the
      compute dtype: GradientBuckets stages in it; without CB the paper's 4Ψ fused buffer instead);
    - "gathered units": the unit being computed plus `prefetch_units` gathered ahead, (1 + p)·U·b_p, U the
      largest unit (a layer's or the embedding's TP slice);
    - "output-layer bucket": the output layer's weight gradient, V_pad·h/t elements in a bucket of its own
      (its unit's only weight), reduce-scattered just before the last layer's backward and held until two more
      buckets launch (zero3d/buckets.py, MAX_BUCKETS_IN_FLIGHT), b_g·V_pad·h/t;
    - "activation gradients": backward_transient_bytes at this CP rank's S/C tokens (`cp`), or with cp > 1
      the attention's backward if larger (context.context_backward_bytes).

    With `float8` (precision.fp8) at every stage: "float8 copies", the codes and scales of fc2's backward
    (float8_copy_bytes); at stage 3 with `fp8_gather` the gathered units hold the layers' linear weights in float8
    (gathered_unit_bytes, `dp` the ranks they are sharded over).
    """
    p = PRECISIONS[precision]
    float8_copies = ({"float8 copies": float8_copy_bytes(shape, micro_batch, tp, float8, fp8_gather, cp)}
                     if float8 != "none" else {})
    if stage != 3:
        return {"gradient buffer": 4 * (psi if bucket_elements is None else min(bucket_elements, psi)),
                **float8_copies}
    bucket = gradient_bucket_elements(shape, psi, tp, bucket_elements)
    return {"gradient bucket": (4 if bucket_elements is None else p.grad_bytes) * bucket,
            "gathered units": (1 + prefetch_units) * gathered_unit_bytes(shape, tp, p.param_bytes, fp8_gather, dp),
            "output-layer bucket": shape.padded_vocab(tp) * shape.hidden // tp * p.grad_bytes,
            "activation gradients": max(backward_transient_bytes(local_shape(shape, cp), micro_batch, tp,
                                                                 p.activation_bytes, attention),
                                        context_backward_bytes(shape, micro_batch, tp, cp, p.activation_bytes)),
            **float8_copies}


@dataclass(frozen=True)
class MemoryBreakdown:
    """Per-GPU bytes by category; total = model states + activations + buffers + margin."""

    params_per_rank: int  # Ψ: parameters on one TP rank, embeddings included
    param_bytes: float
    grad_bytes: float
    optimizer_bytes: float
    checkpoint_bytes: float  # recomputation checkpoints kept on the device
    working_set_bytes: float  # per-layer activations (all layers without recomputation, one with)
    logits_bytes: float
    buffer_bytes: float  # temporary buffers at the peak: the sum of buffer_terms
    margin_bytes: float
    gpu_memory_bytes: float
    margin_fraction: float = DEFAULT_MARGIN_FRACTION
    host_bytes: float = 0.0  # Pa+cpu: checkpoints moved to host memory
    mask_bytes: float = 0.0  # per-sample attention masks of document boundaries (document_mask_bytes)
    grads_not_at_peak: float = 0.0  # of the gradient shard a step allocates late: what the peak does not hold
    step_bytes: float = 0.0  # the optimizer step's moment beside the model states (analysis/step_moment.py)
    matrix_step_bytes: float = 0.0  # of step_bytes: Muon's whole-matrix step, on the device wherever its optimizer runs
    step_join_bytes: float = 0.0  # of step_bytes: stage 1's shard joined for the step, wherever the update runs
    # stage 3: the moment of backward the activation, loss, buffer and gradient bytes are held at (stage3_peak.py)
    peak_moment: str = ""

    @property
    def model_state_bytes(self) -> float:
        return self.param_bytes + self.grad_bytes + self.optimizer_bytes

    @property
    def activation_bytes(self) -> float:
        return self.checkpoint_bytes + self.working_set_bytes + self.logits_bytes + self.mask_bytes

    @property
    def backward_bytes(self) -> float:
        """Beside the model states at the backward's peak: activations and buffers, less the late shard's room."""
        return self.activation_bytes + self.buffer_bytes - self.grads_not_at_peak

    @property
    def peaks_at_step(self) -> bool:
        """Whether the optimizer step's moment, not the backward, is the peak (activations and buffers freed)."""
        return self.step_bytes > self.backward_bytes

    @property
    def total_bytes(self) -> float:
        return self.model_state_bytes + max(self.backward_bytes, self.step_bytes) + self.margin_bytes

    @property
    def fits(self) -> bool:
        return self.total_bytes <= self.gpu_memory_bytes

    def fits_in(self, gpu_memory_bytes: float) -> bool:
        """Would it fit a GPU of another size (the margin scales with that size)?"""
        needed = self.total_bytes - self.margin_bytes + self.margin_fraction * gpu_memory_bytes
        return needed <= gpu_memory_bytes

    @property
    def dominant(self) -> str:
        """The largest consumer other than the margin."""
        terms = {"model states": self.model_state_bytes, "activations": self.activation_bytes,
                 "buffers": self.buffer_bytes}
        return max(terms, key=terms.get)

    def to_dict(self) -> dict:
        out = dataclasses.asdict(self)
        out.update(model_state_bytes=self.model_state_bytes, activation_bytes=self.activation_bytes,
                   total_bytes=self.total_bytes, fits=self.fits, dominant=self.dominant)
        return out


def validate_layout(shape: GPTShape, gpus, tp, stage, micro_batch, recompute, pa, pa_cpu, precision,
                    bucket_elements=None, prefetch_units=1, attention="local") -> None:
    """Raise ValueError naming the bad value and what would be valid (the shape validated itself)."""
    for name, value in (("gpus", gpus), ("tp", tp), ("micro_batch", micro_batch)):
        if not isinstance(value, int) or value <= 0:
            raise ValueError(f"{name} = {value!r} is invalid; must be a positive integer")
    for name, value in (("heads", shape.heads), ("query_groups", shape.groups), ("hidden", shape.hidden),
                        ("gpus", gpus)):
        if value % tp:
            valid = [d for d in range(1, shape.heads + 1)
                     if shape.heads % d == 0 and shape.groups % d == 0 and shape.hidden % d == 0 and gpus % d == 0]
            raise ValueError(f"{name} = {value} is not divisible by tp = {tp}; valid tp values: "
                             f"{', '.join(map(str, valid))}")
    if shape.ffn_size % tp:
        raise ValueError(f"ffn_hidden = {shape.ffn_size} is invalid; must be > 0 and divisible by tp = {tp}")
    if stage not in (0, 1, 2, 3):
        raise ValueError(f"stage = {stage!r} is invalid; valid stages: 0, 1, 2, 3")
    if recompute not in RECOMPUTE:
        raise ValueError(f"recompute = {recompute!r} is invalid; valid values: {', '.join(map(repr, RECOMPUTE))}")
    if precision not in PRECISIONS:
        raise ValueError(f"precision = {precision!r} is invalid; valid: {', '.join(PRECISIONS)}")
    if pa_cpu and not pa:
        raise ValueError("pa_cpu = True needs pa = True (Pa+cpu offloads the partitioned checkpoints)")
    if pa and recompute != "full":
        raise ValueError("pa = True needs recompute = 'full' (Pa partitions recomputation checkpoints)")
    if bucket_elements is not None and bucket_elements <= 0:
        raise ValueError(f"bucket_elements = {bucket_elements} is invalid; must be > 0 (or None: no CB)")
    if prefetch_units < 0:
        raise ValueError(f"prefetch_units = {prefetch_units} is invalid; must be >= 0")
    if attention not in ATTENTION_KINDS:
        raise ValueError(f"attention = {attention!r} is invalid; valid: {', '.join(map(repr, ATTENTION_KINDS))}")


def estimate_from_shape(*, layers: int, hidden: int, heads: int, vocab: int, seq: int, tied: bool = False,
                        ffn_hidden: Optional[int] = None, vocab_divisible_by: int = VOCAB_DIVISIBLE_BY,
                        optimizer: str = "adamw", state_dtype: str = "fp32", **fields) -> MemoryBreakdown:
    """`estimate` of the paper's GPT-2-shaped decoder given by its dimensions, the other objects' fields given flat
    (job_of; `optimizer`, `state_dtype`: OptimizerStates.of_shape): the tables' and searches' form."""
    shape = GPTShape(layers=layers, hidden=hidden, heads=heads, seq=seq, vocab=vocab, ffn=ffn_hidden, tied=tied,
                     vocab_divisible_by=vocab_divisible_by)
    layout, zero, step, budget = job_of(**fields)
    return estimate(shape, layout, zero, step, budget, OptimizerStates.of_shape(shape, layout.tp, optimizer, state_dtype))


def estimate(shape: GPTShape, layout: Parallelism, zero: ZeroChoice, step: Step = Step(), budget: Budget = Budget(),
             optimizer: Optional[OptimizerStates] = None) -> MemoryBreakdown:
    """Per-GPU memory of the GPT `shape` on `layout`'s gpus = tp × cp × dp under `zero` (formulas: docs/estimator.md),
    a step holding `step` and judged against `budget`.

    `zero`: its stage; CB, `bucket_elements` (None means no CB, the 4Ψ fused buffer); Pa and Pa+cpu; with
    `layout.dp_per_node` DP ranks per node its node-aware mode, as its card in analysis/modes.py says (hpZ, the
    secondary partition, adds Ψb/m of parameters; hybrid shards the model states over the node's m ranks instead of
    all dp); `fp8_gather` (zero.fp8_gather, stage 3
    tensorwise): buffer_terms. `step`: `loss_chunk_tokens` > 0, the loss holds that many tokens' logits at once
    (pretrain/model/loss.py), fused (its weight and hidden-state gradients kept from forward to backward) or,
    `loss_recompute`, recomputed in backward; `attention` (ATTENTION_KINDS): "local" (the paper's Megatron) keeps the
    [b·a, s, s] scores, "fused" (SDPA / Transformer Engine) only the softmax statistics, in every layer's activations and
    so in the working set; `document_masks`: per-sample attention masks (document_mask_bytes: the step's
    `accumulation` micro-batches, `layout.pp` of them in flight), counted with the activations; `float8`
    (precision.fp8: "tensorwise", "rowwise"): buffer_terms. `layout.cp` context-parallel ranks
    (analysis/context.py) split each sequence: ZeRO shards over their dp·cp = gpus/tp ranks, each rank's
    activations are for S/C tokens, plus the other ranks' K and V gathered (context_layer_bytes). `step.sequence_parallel`:
    the activations TP leaves whole are cut over its ranks' tokens too (activations.layer_bytes). `optimizer`
    (OptimizerStates.of_shape; None: AdamW with fp32 states) gives K."""
    gpus, tp, cp, dp_per_node = layout.gpus, layout.tp, layout.cp, layout.dp_per_node
    stage, pa, pa_cpu, bucket_elements, prefetch_units = (zero.stage, zero.pa, zero.pa_cpu, zero.bucket_elements,
                                                          zero.prefetch_units)
    splits_node, cards, fp8_gather = zero.modes.needs_two_per_node, mode_costs(zero.modes), zero.fp8_gather
    micro_batch, recompute, precision, attention = step.micro_batch, step.recompute, step.precision, step.attention
    loss_chunk_tokens, loss_recompute, float8 = step.loss_chunk_tokens, step.loss_recompute, step.float8
    gpu_memory_bytes, margin_fraction = budget.gpu_memory_bytes, budget.margin_fraction
    validate_layout(shape, gpus, tp, stage, micro_batch, recompute, pa, pa_cpu, precision, bucket_elements,
                    prefetch_units, attention)
    validate_context(cp, shape.seq, gpus, tp, attention, splits_node)
    if cp > 1 and recompute == "selective":
        raise ValueError(f"recompute = 'selective' with cp = {cp} is not supported; use 'none' or 'full'")
    if gpu_memory_bytes <= 0 or not 0 <= margin_fraction < 1:
        raise ValueError(f"gpu_memory_bytes = {gpu_memory_bytes} must be > 0 and margin_fraction = "
                         f"{margin_fraction} in [0, 1)")
    prec = PRECISIONS[precision]
    dp = gpus // tp  # ZeRO's group: data × context
    seq, hidden = shape.seq // cp, shape.hidden  # this rank's tokens of a sequence
    psi = shape.params(tp)
    if splits_node and (dp_per_node < 1 or dp % dp_per_node):
        raise ValueError(f"dp_per_node = {dp_per_node} is invalid; must divide dp = {dp}")
    states = optimizer or OptimizerStates.of_shape(shape, tp)
    state_ranks = dp
    for card in cards:
        state_ranks = card.state_ranks(state_ranks, dp_per_node)
    param, grad, optimizer_bytes = (float(x) for x in model_state_bytes(psi, stage, state_ranks, precision, states))
    for card in cards:
        param += card.added_param_bytes(psi, dp_per_node, precision)

    e = prec.activation_bytes
    mask_bytes = (document_mask_bytes(shape.seq, micro_batch, step.accumulation, layout.pp, e, attention)
                  if step.document_masks else 0)
    sp = step.sequence_parallel
    if sp and (tp == 1 or pa):
        raise ValueError(f"sequence_parallel with tp = {tp}{' and pa' if pa else ''} is invalid; it needs tp > 1 "
                         "and no pa (the layer inputs are sliced over TP already)")
    kept_by_layer = layer_bytes(local_shape(shape, cp), micro_batch, tp, e, attention_state_bytes(
        attention, seq, micro_batch, shape.heads, e), sp) + context_layer_bytes(shape, micro_batch, tp, cp, e)
    # the loss is computed on this rank's vocabulary slice of the logits, a chunk of tokens at a time (loss_bytes)
    if loss_chunk_tokens < 0:
        raise ValueError(f"loss_chunk_tokens = {loss_chunk_tokens} is invalid; must be >= 0 (0: all tokens)")
    host = 0.0
    if recompute == "none":
        checkpoints, working = 0.0, float(shape.layers * kept_by_layer)
    elif recompute == "selective":
        # every layer's kept GEMM and fused-attention outputs; the one layer being back-propagated makes the rest
        # again (its norms, activations, local attention's scores)
        kept = selective_layer_bytes(local_shape(shape, cp), micro_batch, tp, e, attention == "fused", sp)
        checkpoints, working = float(shape.layers * kept), float(max(kept_by_layer - kept, 0))
    else:
        # one checkpoint per layer (its input), sliced over the TP group under Pa or sequence parallelism
        checkpoints = shape.layers * micro_batch * seq * hidden * e / (tp if pa or sp else 1)
        if pa_cpu:
            checkpoints, host = 0.0, checkpoints
        # the one layer being recomputed and back-propagated (fused attention: no [b·a, s, s] buffer either)
        working = float(kept_by_layer)

    if fp8_gather and (stage != 3 or float8 != "tensorwise"):
        raise ValueError(f"fp8_gather needs stage 3 and float8 = 'tensorwise'; got stage {stage}, float8 {float8!r}")
    terms = buffer_terms(shape, stage=stage, psi=psi, micro_batch=micro_batch, tp=tp,
                         bucket_elements=bucket_elements, precision=precision, prefetch_units=prefetch_units,
                         attention=attention, cp=cp, float8=float8, fp8_gather=fp8_gather,
                         dp=state_ranks)
    buffers = float(sum(terms.values()))
    # the fused loss's stored gradients live from its forward to its backward's first step: beside the layer
    # recomputed then (none yet) and the buffers (none in use), so only what exceeds those raises the peak
    logits = loss_bytes(shape, micro_batch * seq, tp, e, loss_chunk_tokens, loss_recompute,
                        beside=buffers + (kept_by_layer if recompute != "none" else 0), compiled=step.compiled)
    # What the optimizer step holds beside the model states (analysis/step_moment.py): stage 1's joined shard, the
    # larger of Muon's exchange and the chunks it casts to fp32 (none on the device with "cpu")
    on_device = zero.offload_optimizer != "cpu"
    matrix_step = float(whole_matrix_step_bytes(shape, tp, stage, state_ranks)) if states.matrix_share else 0.0
    joined = float(gradient_join_bytes(stage, state_ranks, bucket_elements, prec.grad_bytes, psi,
                                       shape.vector_params, psi * states.matrix_share))
    step_moment = step_moment_bytes(zero.offload_optimizer, Fraction(psi, state_ranks if stage else 1),
                                    prec.master_bytes > 0, states.elementwise_states if states.state_dtype == "bf16"
                                    else 0, joined, matrix_step)
    # One micro-batch a step (`step.grad_shard_per_step`): the stage 2/3 shard on the device is not all held at the
    # activations' peak; the step's moment holds it whole (MemoryBreakdown.total_bytes).
    late_shard = step.grad_shard_per_step and on_device
    not_at_peak, moment = 0.0, ""
    if stage == 3:
        # the activations, buffers and shards the largest of the step's moments holds (stage3_peak.py): at the loss,
        # its whole memory (nothing else in use beside it), the final norm's tensors and the gathered output layer
        loss = loss_bytes(shape, micro_batch * seq, tp, e, loss_chunk_tokens, loss_recompute, compiled=step.compiled)
        final_norm = final_norm_bytes(shape, micro_batch * seq, tp, e, sp)
        output_unit = (shape.output_params(tp) or shape.embedding_params(tp)) * prec.param_bytes
        peak = stage3_peak(*stage3_moments(shape, tp, grad, late_shard, checkpoints, working, recompute, loss,
                                           final_norm, buffers, output_unit))
        checkpoints, working, logits, buffers = peak.checkpoints, peak.working, peak.loss, peak.buffers
        not_at_peak, moment = grad - peak.grads, peak.name
    elif late_shard and stage == 2:
        # (late_shard_room) a layer's backward frees for good its activations (none) or its checkpoint (a recomputed
        # layer's working set is made again by the next)
        freed_by_layer = kept_by_layer if recompute == "none" else checkpoints / shape.layers
        room = late_shard_room(shape, tp, bucket_elements, grad, logits, freed_by_layer)
        not_at_peak = min(room, checkpoints + working + logits + mask_bytes + buffers)
    return MemoryBreakdown(
        params_per_rank=psi, param_bytes=param, grad_bytes=grad, optimizer_bytes=optimizer_bytes,
        checkpoint_bytes=float(checkpoints), working_set_bytes=working, logits_bytes=float(logits),
        buffer_bytes=buffers, margin_bytes=margin_fraction * gpu_memory_bytes,
        gpu_memory_bytes=float(gpu_memory_bytes), margin_fraction=margin_fraction, host_bytes=float(host),
        mask_bytes=float(mask_bytes), grads_not_at_peak=float(not_at_peak), step_bytes=step_moment,
        matrix_step_bytes=matrix_step, step_join_bytes=joined, peak_moment=moment)


def largest_fitting_layers(fits) -> int:
    """The largest layer count n with fits(n), memory growing with layers (so bisect); 0 if not even 1."""
    if not fits(1):
        return 0
    good, bad = 1, 2
    while fits(bad):
        good, bad = bad, bad * 2
    while bad - good > 1:
        middle = (good + bad) // 2
        good, bad = (middle, bad) if fits(middle) else (good, middle)
    return good


# ---------------------------------------------------------------- CLI


def format_breakdown(m: MemoryBreakdown, header: str, device: str = "GPU") -> str:
    """The breakdown table; the verdict line names the device (and so the budget) it judges."""
    rows = [("parameters", m.param_bytes), ("gradients", m.grad_bytes),
            ("optimizer states (incl. master)", m.optimizer_bytes), ("  = model states", m.model_state_bytes),
            ("activation checkpoints", m.checkpoint_bytes), ("layer working set", m.working_set_bytes),
            ("loss (logits, fused kept grads)", m.logits_bytes)]
    if m.mask_bytes:
        rows.append(("attention masks (documents)", m.mask_bytes))
    rows.append(("  = activations", m.activation_bytes))
    if m.grads_not_at_peak:
        rows.append(("gradients backward made room for", -m.grads_not_at_peak))
    rows.append(("temporary buffers", m.buffer_bytes))
    if m.peaks_at_step:  # the step's fp32 gradient copy outweighs what backward holds beside the model states
        rows.append(("optimizer step over backward", m.step_bytes - m.backward_bytes))
    rows += [(f"margin ({m.margin_fraction:.0%} of GPU)", m.margin_bytes), ("total", m.total_bytes)]
    if m.host_bytes:
        rows.append(("host memory (Pa+cpu checkpoints)", m.host_bytes))
    verdict = "fits" if m.fits else "does NOT fit"
    lines = [header, f"Ψ (parameters per TP rank, embeddings included) = {m.params_per_rank:,}"]
    if m.peak_moment:
        lines.append(f"activations, buffers and gradients as held at {m.peak_moment}")
    lines += ["", f"{'category':<34}{'GB':>10}"] + [f"{name:<34}{value / GB:10.3f}" for name, value in rows]
    lines.append(f"{device}: {m.gpu_memory_bytes / GIB:.2f} GiB = {m.gpu_memory_bytes / GB:.2f} GB: {verdict} (headroom "
                 f"{(m.gpu_memory_bytes - m.total_bytes) / GB:.2f} GB; largest: {m.dominant})")
    return "\n".join(lines)
