"""GPTShape: a GPT decoder described in one place — its dimensions, padded vocabulary, parameters per TP rank and
their names, and its FLOPs (model_shape/flops.py).

The config (pretrain's `model` section), the analysis (estimator, planner, probe) and the metrics all ask it; the
counts are megatron-core 0.16.1's GPTModel with its local layer spec (tests/dist/test_flops.py holds them to the built
model, element for element). What a layer keeps for backward, in bytes, is the analysis's (analysis/activations.py).
"""
from dataclasses import dataclass
from typing import Literal, Optional

from model_shape.flops import StepFlops, gpt_step_flops

VOCAB_DIVISIBLE_BY = 128  # Megatron's make-vocab-size-divisible-by default
MLPS = ("gelu", "gelu_tanh", "swiglu")
NORMS = ("layernorm", "rmsnorm")
POSITION_EMBEDDINGS = ("learned", "rope")


def padded_vocab(vocab: int, tp: int = 1, divisible_by: int = VOCAB_DIVISIBLE_BY) -> int:
    """Megatron pads the vocabulary up to a multiple of divisible_by × tp."""
    multiple = divisible_by * tp
    return -(-vocab // multiple) * multiple


@dataclass(frozen=True)
class GPTShape:
    """A decoder-only transformer: GPT-2's (the defaults) or a Llama-shaped one (RoPE, SwiGLU, RMSNorm, GQA,
    no biases, untied head), with Qwen's head size (`kv_channels`) and QKV-only biases. Validated when built: a
    bad value raises ValueError naming it and what is valid."""

    layers: int
    hidden: int
    heads: int
    seq: int
    vocab: int
    """The tokenizer's vocabulary; the embedding holds `padded_vocab(tp)` rows."""
    ffn: Optional[int] = None
    """MLP width (each of the gate and up projections under SwiGLU); None: 4 × hidden."""
    query_groups: Optional[int] = None
    """Key/value heads (GQA; 1: MQA); None: one per query head."""
    mlp: Literal["gelu", "gelu_tanh", "swiglu"] = "gelu"
    """gelu (exact or GPT-2's tanh approximation: the same matrices) or swiglu (gate, up and down)."""
    norm: Literal["layernorm", "rmsnorm"] = "layernorm"
    position_embedding: Literal["learned", "rope"] = "learned"
    bias: bool = True
    """Biases on the linear layers (QKV, projection, fc1, fc2)."""
    qkv_bias: bool = False
    """Biases on the QKV projection alone (Qwen2's), where `bias` is False."""
    kv_channels: Optional[int] = None
    """The size of each attention head (megatron's kv_channels, HF's head_dim); None: hidden / heads. The query
    and the attention's output are heads × kv_channels wide, which need not be `hidden` (Qwen3-0.6B: 16 × 128 over
    a hidden size of 1024)."""
    qk_layernorm: bool = False
    """A norm over each query and key head (head_dim wide, shared by the heads)."""
    tied: bool = False
    """The output layer reuses the word embedding."""
    vocab_divisible_by: int = VOCAB_DIVISIBLE_BY

    def __post_init__(self):
        for name in ("layers", "hidden", "heads", "seq", "vocab", "vocab_divisible_by"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name} = {value!r} is invalid; must be a positive integer")
        if self.kv_channels is not None and (not isinstance(self.kv_channels, int) or self.kv_channels <= 0):
            raise ValueError(f"kv_channels = {self.kv_channels!r} is invalid; must be a positive integer (or None: "
                             "hidden / heads)")
        if self.kv_channels is None and self.hidden % self.heads:
            raise ValueError(f"hidden = {self.hidden} is not divisible by heads = {self.heads} (or give kv_channels, "
                             "the head size)")
        if self.ffn is not None and (not isinstance(self.ffn, int) or self.ffn <= 0):
            raise ValueError(f"ffn = {self.ffn!r} is invalid; must be a positive integer (or None: 4 × hidden)")
        if self.query_groups is not None and (not isinstance(self.query_groups, int) or self.query_groups <= 0
                                              or self.heads % self.query_groups):
            valid = [g for g in range(1, self.heads + 1) if self.heads % g == 0]
            raise ValueError(f"query_groups = {self.query_groups!r} is invalid; it must divide heads = {self.heads}: "
                             f"valid values {', '.join(map(str, valid))}")
        for name, choices in (("mlp", MLPS), ("norm", NORMS), ("position_embedding", POSITION_EMBEDDINGS)):
            if getattr(self, name) not in choices:
                raise ValueError(f"{name} = {getattr(self, name)!r} is invalid; valid: {', '.join(map(repr, choices))}")

    # ------------------------------------------------------------------ derived sizes

    @property
    def ffn_size(self) -> int:
        return self.ffn or 4 * self.hidden

    @property
    def groups(self) -> int:
        return self.query_groups or self.heads

    @property
    def head_dim(self) -> int:
        return self.kv_channels or self.hidden // self.heads

    @property
    def query_width(self) -> int:
        """Width of the query projection and of the attention's output: heads × head size (hidden unless
        kv_channels says otherwise)."""
        return self.heads * self.head_dim

    @property
    def kv_width(self) -> int:
        """Width of the key (and of the value) projection: query groups × head size."""
        return self.groups * self.head_dim

    @property
    def gated(self) -> bool:
        return self.mlp == "swiglu"

    def padded_vocab(self, tp: int = 1) -> int:
        return padded_vocab(self.vocab, tp, self.vocab_divisible_by)

    # ------------------------------------------------------------------ parameters on one TP rank

    def norm_params(self, width: int) -> int:
        """A LayerNorm has a weight and a bias, an RMSNorm a weight only."""
        return width * (2 if self.norm == "layernorm" else 1)

    def layer_params(self, tp: int = 1) -> int:
        """One transformer layer on one TP rank: 12h² + 13h for GPT-2 at tp = 1 (ffn = 4h)."""
        h, f, m, q = self.hidden, self.ffn_size, 2 if self.gated else 1, self.query_width
        qkv = q + 2 * self.kv_width
        # split across TP: the QKV and fc1 (column-parallel) weights and biases, the projection and fc2 weights
        split = (h * qkv + q * h + h * f * m + f * h + (qkv if self.bias or self.qkv_bias else 0)
                 + (f * m if self.bias else 0))
        # whole on every rank: the projection and fc2 biases (row-parallel), the two norms, the q/k norms
        whole = ((2 * h if self.bias else 0) + 2 * self.norm_params(h)
                 + (2 * self.norm_params(self.head_dim) if self.qk_layernorm else 0))
        return split // tp + whole

    def layer_linear_weights(self, tp: int = 1) -> int:
        """The QKV, projection, fc1 and fc2 weights of one layer on one TP rank: what precision.fp8 casts to float8
        (and zero.fp8_gather gathers as float8)."""
        h, f, q = self.hidden, self.ffn_size, self.query_width
        fc1 = h * f * (2 if self.gated else 1)  # SwiGLU's gate and up: one matrix
        return (h * (q + 2 * self.kv_width) + q * h + fc1 + f * h) // tp

    def hidden_matrix_params(self, tp: int = 1) -> int:
        """The layers' 2-D weights on one TP rank (QKV, projection, fc1, fc2): what Muon takes whole."""
        return self.layers * self.layer_linear_weights(tp)

    def embedding_params(self, tp: int = 1) -> int:
        """The word embedding (this rank's slice of the padded vocabulary) and learned positions (none: RoPE)."""
        positions = self.seq * self.hidden if self.position_embedding == "learned" else 0
        return self.padded_vocab(tp) * self.hidden // tp + positions

    def output_params(self, tp: int = 1) -> int:
        return 0 if self.tied else self.padded_vocab(tp) * self.hidden // tp

    def params(self, tp: int = 1) -> int:
        """Parameters on one TP rank of the whole model (every pipeline stage together)."""
        return (self.layers * self.layer_params(tp) + self.norm_params(self.hidden) + self.output_params(tp)
                + self.embedding_params(tp))

    @property
    def vector_params(self) -> int:
        """The 1-D parameters (norms, biases) at TP 1: a group of their own in the engine (no weight decay)."""
        return sum(dims[0] for dims in self.parameter_shapes().values() if len(dims) == 1)

    def parameter_shapes(self) -> dict:
        """{name: shape} of megatron-core GPTModel's parameters at TP 1 (local layer spec, one pipeline stage holding
        every layer; the vocabulary padded as for TP 1): what optimizer.no_weight_decay's patterns are checked
        against, and the layouts the Hugging Face maps read."""
        h, f, m, v = self.hidden, self.ffn_size, 2 if self.gated else 1, self.padded_vocab(1)
        norms = ("weight", "bias") if self.norm == "layernorm" else ("weight",)
        qkv = self.query_width + 2 * self.kv_width
        layer = {f"{n}.{w}": (h,) for n in ("input_layernorm", "pre_mlp_layernorm") for w in norms}
        layer["self_attention.linear_qkv.weight"] = (qkv, h)
        if self.qkv_bias and not self.bias:
            layer["self_attention.linear_qkv.bias"] = (qkv,)
        layer["self_attention.linear_proj.weight"] = (h, self.query_width)
        layer.update({f"self_attention.{n}.{w}": (self.head_dim,) for n in ("q_layernorm", "k_layernorm")
                      for w in norms if self.qk_layernorm})
        layer.update({"mlp.linear_fc1.weight": (f * m, h), "mlp.linear_fc2.weight": (h, f)})
        if self.bias:
            layer.update({"self_attention.linear_qkv.bias": (qkv,), "self_attention.linear_proj.bias": (h,),
                          "mlp.linear_fc1.bias": (f * m,), "mlp.linear_fc2.bias": (h,)})
        shapes = {"embedding.word_embeddings.weight": (v, h)}
        if self.position_embedding == "learned":
            shapes["embedding.position_embeddings.weight"] = (self.seq, h)
        shapes.update({f"decoder.layers.{i}.{n}": s for i in range(self.layers) for n, s in layer.items()})
        shapes.update({f"decoder.final_layernorm.{w}": (h,) for w in norms})
        if not self.tied:
            shapes["output_layer.weight"] = (v, h)
        return shapes

    def parameter_names(self) -> list:
        """The names of `parameter_shapes()`."""
        return list(self.parameter_shapes())

    # ------------------------------------------------------------------ FLOPs

    def step_flops(self, global_batch: int, recompute: bool, tp: int = 1, loss_recompute: bool = False,
                   recomputed_attention: bool = False) -> StepFlops:
        """Model and hardware FLOPs of one step over the vocabulary padded for `tp` (model_shape/flops.py)."""
        return gpt_step_flops(self.layers, self.hidden, self.seq, self.padded_vocab(tp), global_batch, recompute,
                              ffn_hidden=self.ffn_size, num_attention_heads=self.heads,
                              num_query_groups=self.groups, gated_mlp=self.gated, head_dim=self.head_dim,
                              loss_recompute=loss_recompute, recomputed_attention=recomputed_attention)
