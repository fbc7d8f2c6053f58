"""The sections pretrain alone defines — [model], [parallel], [data], [train], [logging], [cluster], [paper] — each
a dataclass that checks its values when built. The sections that extend zero3d's settings, [optimizer] and [precision],
sit beside the tree in config.py; [zero] is zero3d's own (zero3d/config.py), which the tree embeds as it is;
cross-section rules: config.py."""
import dataclasses
import math
from dataclasses import dataclass
from typing import ClassVar, Literal, Optional

from pretrain.blend import Blend, parse_blend, parse_split
from pretrain.errors import ConfigError
from model_shape.flops import StepFlops
from model_shape.gpt import VOCAB_DIVISIBLE_BY, GPTShape

# Over 400 lines: the schema of pretrain's own sections in one place, a docstring per field (docs/config.md is
# generated from them: pretrain/config_reference.py); each section checks its own values.


def require(ok: bool, message: str) -> None:
    """Raise ConfigError(message) unless ok: a message names the bad value and what is valid."""
    if not ok:
        raise ConfigError(message)


def check_finite(name: str, section) -> None:
    """No setting may be inf or nan (optimizer.lr = inf would train NaNs)."""
    for f in dataclasses.fields(section):
        value = getattr(section, f.name)
        require(not isinstance(value, float) or math.isfinite(value),
                f"{name}.{f.name} = {value} is invalid; must be a finite number")


class Section:
    """A section of the config: building it (config.py's validate() rebuilds each after the TOML and the
    overrides are merged) checks that its floats are finite, then its own rules (`check`)."""

    section: ClassVar[str]  # its TOML table: [model], [data] ...

    def __post_init__(self) -> None:
        check_finite(self.section, self)
        self.check()

    def check(self) -> None:
        """This section's own rules; rules that read two sections live in config.py's validate()."""


@dataclass
class ModelConfig(Section):
    section: ClassVar[str] = "model"
    num_layers: int = 2
    """Transformer layers (a multiple of parallel.pipeline)."""
    hidden_size: int = 64
    """Model width h (a multiple of num_attention_heads and of parallel.tensor)."""
    num_attention_heads: int = 4
    """Heads per layer (a multiple of parallel.tensor)."""
    ffn_hidden_size: Optional[int] = None
    """MLP width; None: 4 × hidden_size."""
    seq_length: int = 64
    """Tokens per sample."""
    vocab_size: int = 512
    """Tokenizer vocabulary; the embedding is padded (see padded_vocab_size)."""
    make_vocab_size_divisible_by: int = VOCAB_DIVISIBLE_BY
    """The padded vocabulary is a multiple of this × parallel.tensor (Megatron's rule)."""
    tie_embeddings: bool = False
    """Share the input embedding with the output layer."""
    hidden_dropout: float = 0.0
    """Dropout after attention and MLP, in [0, 1)."""
    attention_dropout: float = 0.0
    """Dropout of the attention probabilities, in [0, 1)."""
    init_method_std: float = 0.02
    """Standard deviation of the normal initialisation (> 0)."""
    recompute: Literal["none", "selective", "full"] = "none"
    """full: every transformer layer recomputed in backward from its input; selective: each layer keeps only its GEMMs'
    and fused attention's outputs and recomputes the rest (norms, RoPE, activations, materialised attention scores:
    pretrain/model/recompute.py); none: every activation kept."""
    attention: Literal["auto", "sdpa", "local", "te"] = "auto"
    """Core attention (pretrain/model/attention.py): auto = Transformer Engine on GPU where importable, else torch's
    scaled_dot_product_attention; local = megatron's DotProductAttention; te refused where missing."""
    loss_chunk_tokens: int = 1024
    """Output layer + cross-entropy this many tokens at a time, every gradient computed in the forward pass (fused:
    no [tokens × vocab] logits, no second output GEMM; pretrain/model/loss.py); 0: megatron's, in one piece."""
    loss_recompute: bool = False
    """With loss_chunk_tokens > 0: each chunk recomputed in backward instead (one more output GEMM per step, nothing
    of the loss kept between forward and backward, any function of the per-token losses differentiable)."""
    compile: Literal["auto", True, False] = "auto"
    """torch.compile (inductor) of each transformer layer's forward, its ZeRO hooks eager around it: true, false, or
    auto (the default) = on CUDA, eager on CPU (where inductor's C++ build costs more than it gains) and with Transformer
    Engine's layers (not measured compiled). On an H200 the compiled layers ran 1–5% faster than eager
    (docs/gpu-check.md: `tools/gpu_check.py --parity` measures both)."""
    position_embedding: Literal["learned", "rope"] = "learned"
    """learned: GPT-2's absolute position table (seq_length × hidden); rope: rotary embeddings (Llama)."""
    rope_base: int = 10000
    """RoPE's frequency base θ (Llama-3: 500000); read only with position_embedding = "rope"."""
    rope_scaling_factor: Optional[float] = None
    """Llama-3.1's RoPE frequency scaling ("llama3") by this factor (Meta's 3.1: 8.0, 3.2: 32.0); None: none."""
    rope_scaling_low_freq_factor: float = 1.0
    """Llama-3.1's RoPE scaling: wavelengths above original_max_positions / this are divided by the factor (Meta: 1)."""
    rope_scaling_high_freq_factor: float = 4.0
    """Llama-3.1's RoPE scaling: wavelengths below original_max_positions / this are kept; between the two, a
    smooth mix (Meta: 4; > low_freq_factor)."""
    rope_scaling_original_max_positions: int = 8192
    """Llama-3.1's RoPE scaling: the context length the model was first trained at (Meta: 8192)."""
    mlp: Literal["gelu", "gelu_tanh", "swiglu"] = "gelu"
    """gelu: fc1 → exact GELU → fc2; gelu_tanh: GELU's tanh approximation (GPT-2's gelu_new, megatron's
    openai_gelu); swiglu: silu(gate) × up → fc2, ffn_hidden_size wide each (Llama)."""
    norm: Literal["layernorm", "rmsnorm"] = "layernorm"
    """The pre-attention, pre-MLP and final norms (and the q/k norms): LayerNorm (weight, bias) or RMSNorm."""
    norm_epsilon: float = 1e-5
    """The norms' epsilon (> 0; Llama-3: 1e-5)."""
    head_dim: Optional[int] = None
    """The size of each attention head (megatron's kv_channels, HF's head_dim); None: hidden_size /
    num_attention_heads. Heads × head_dim need not be the hidden size (Qwen3-0.6B: 16 × 128, hidden 1024)."""
    num_query_groups: Optional[int] = None
    """Key/value heads: grouped-query attention (Llama-3: 8), 1 = multi-query; None: one per head. Must
    divide num_attention_heads and be divisible by parallel.tensor."""
    qk_layernorm: bool = False
    """A norm over each query and key head before attention (its weights summed over the TP group)."""
    bias: bool = True
    """Biases on the linear layers (QKV, projection, fc1, fc2); false: none (Llama)."""
    qkv_bias: bool = False
    """Biases on the QKV projection alone (Qwen2), with bias = false (megatron's add_qkv_bias)."""
    sliding_window: Optional[int] = None
    """A published model's sliding attention window (Mistral's, Qwen2's), kept so that it exports as it came; the
    attention is full causal, the same function only where the window covers the sequence (>= seq_length)."""

    def check(self) -> None:
        for key in ("num_layers", "hidden_size", "num_attention_heads", "seq_length", "vocab_size",
                    "make_vocab_size_divisible_by"):
            require(getattr(self, key) > 0, f"model.{key} = {getattr(self, key)} is invalid; must be > 0")
        require(self.head_dim is None or self.head_dim > 0, f"model.head_dim = {self.head_dim} is invalid; must be > 0 "
                "(or unset: hidden_size / num_attention_heads)")
        require(self.head_dim is not None or self.hidden_size % self.num_attention_heads == 0,
                f"model.hidden_size = {self.hidden_size} is not divisible by model.num_attention_heads = "
                f"{self.num_attention_heads}; choose a head count that divides the hidden size (or set model.head_dim)")
        require(not (self.qkv_bias and self.bias), "model.qkv_bias = true with model.bias = true is redundant: bias "
                "already puts biases on QKV (and the other linear layers); set one of them")
        require(self.sliding_window is None or self.sliding_window >= self.seq_length,
                f"model.sliding_window = {self.sliding_window} does not cover model.seq_length = {self.seq_length}: "
                "zero3d's attention is full causal, equal to a sliding window only where the window covers the "
                f"sequence; set seq_length <= {self.sliding_window}")
        require(self.ffn_hidden_size is None or self.ffn_hidden_size > 0,
                f"model.ffn_hidden_size = {self.ffn_hidden_size} is invalid; must be > 0 (or unset: 4 × hidden_size)")
        require(self.loss_chunk_tokens >= 0, f"model.loss_chunk_tokens = {self.loss_chunk_tokens} is invalid; "
                "must be >= 0 (0: the loss over all tokens at once)")
        require(not self.loss_recompute or self.loss_chunk_tokens > 0, "model.loss_recompute = true needs "
                "model.loss_chunk_tokens > 0 (0: megatron's loss, in one piece, has no chunks to recompute)")
        require(self.init_method_std > 0, f"model.init_method_std = {self.init_method_std} is invalid; must be > 0")
        for key in ("hidden_dropout", "attention_dropout"):
            require(0.0 <= getattr(self, key) < 1.0, f"model.{key} = {getattr(self, key)} must be in [0, 1)")
        require(self.norm_epsilon > 0, f"model.norm_epsilon = {self.norm_epsilon} is invalid; must be > 0")
        require(self.num_query_groups is None or (self.num_query_groups > 0
                                                  and self.num_attention_heads % self.num_query_groups == 0),
                f"model.num_query_groups = {self.num_query_groups} is invalid; it must divide "
                f"model.num_attention_heads = {self.num_attention_heads}: valid values "
                + ", ".join(str(g) for g in range(1, self.num_attention_heads + 1)
                            if self.num_attention_heads % g == 0))
        rope = self.position_embedding == "rope"
        require(self.rope_base > 0, f"model.rope_base = {self.rope_base} is invalid; must be > 0")
        require(self.rope_scaling_factor is None or (rope and self.rope_scaling_factor >= 1),
                f"model.rope_scaling_factor = {self.rope_scaling_factor} is invalid; it scales RoPE's frequencies "
                "(position_embedding = \"rope\") by a factor >= 1 (Llama-3.1: 8.0), or is unset")
        low, high = self.rope_scaling_low_freq_factor, self.rope_scaling_high_freq_factor
        require(0 < low < high, f"model.rope_scaling_low_freq_factor = {low} and rope_scaling_high_freq_factor = "
                f"{high} are invalid; they must satisfy 0 < low < high (Meta's: 1 and 4)")
        require(self.rope_scaling_original_max_positions > 0, "model.rope_scaling_original_max_positions = "
                f"{self.rope_scaling_original_max_positions} is invalid; must be > 0 (Meta's: 8192)")

    @property
    def shape(self) -> GPTShape:
        """The model's arithmetic (model_shape.gpt): parameters, FLOPs, activations."""
        return GPTShape(layers=self.num_layers, hidden=self.hidden_size, heads=self.num_attention_heads,
                        seq=self.seq_length, vocab=self.vocab_size, ffn=self.ffn_hidden_size,
                        query_groups=self.num_query_groups, mlp=self.mlp, norm=self.norm,
                        position_embedding=self.position_embedding, bias=self.bias, qk_layernorm=self.qk_layernorm,
                        tied=self.tie_embeddings, vocab_divisible_by=self.make_vocab_size_divisible_by,
                        qkv_bias=self.qkv_bias, kv_channels=self.head_dim)

    def padded_vocab_size(self, tensor_parallel: int) -> int:
        """Megatron's rule (model_shape.gpt.padded_vocab): a multiple of divisible_by × TP."""
        return self.shape.padded_vocab(tensor_parallel)

    def flops_per_step(self, tensor_parallel: int, global_batch: int) -> StepFlops:
        """Model and hardware FLOPs of one training step (model_shape.flops), over the padded vocabulary."""
        return self.shape.step_flops(global_batch, self.recompute == "full", tensor_parallel,
                                     loss_recompute=self.loss_chunk_tokens > 0 and self.loss_recompute,
                                     recomputed_attention=self.recompute == "selective" and self.attention == "local")

    @property
    def ffn_size(self) -> int:
        return self.shape.ffn_size


@dataclass
class ParallelConfig(Section):
    section: ClassVar[str] = "parallel"
    tensor: int = 1
    """Tensor-parallel (megatron TP) group size."""
    pipeline: int = 1
    """Pipeline stages; data parallelism takes the rest of the world."""
    sequence_parallel: bool = False
    """Megatron's sequence parallelism (needs tensor > 1)."""
    context: int = 1
    """Context parallelism: each sequence split into 2 × context equal chunks over that many ranks (rank i holds
    chunks i and 2·context − 1 − i); attention exact across them, ZeRO sharded over data × context."""

    def check(self) -> None:
        require(self.tensor >= 1, f"parallel.tensor = {self.tensor} is invalid; must be >= 1")
        require(self.pipeline >= 1, f"parallel.pipeline = {self.pipeline} is invalid; must be >= 1")
        require(self.context >= 1, f"parallel.context = {self.context} is invalid; must be >= 1")
        require(not (self.sequence_parallel and self.tensor == 1),
                "parallel.sequence_parallel = true needs parallel.tensor > 1")


BLEND_KEYS = ("blend", "train_blend", "valid_blend")
# data's document-boundary keys → the per-sample field of megatron-core's GPTDataset each one changes
DOCUMENT_FIELDS = {"reset_position_ids": "position_ids", "reset_attention_mask": "attention_mask",
                   "eod_mask_loss": "loss_mask"}


@dataclass
class DataConfig(Section):
    """Either a corpus (tokenized into cache_dir) or Megatron .bin/.idx prefixes in blend / per-split blends.
    The blends and the split are parsed once, when the section is built: `blends()`, `split_shares()`."""

    section: ClassVar[str] = "data"
    corpus: Optional[str] = None
    """JSONL, Parquet or Arrow file or glob ({"text": ...} a line; .gz/.zst too), tokenized into cache_dir, used
    without a blend; unset with no blend: the run refuses to start (data/corpus.jsonl: the shipped demo corpus)."""
    text_column: str = "text"
    """The JSON field (JSONL) or column (Parquet, Arrow) of data.corpus holding each document's text."""
    tokenizer_kind: Literal["sentencepiece", "hf", "gpt2_bpe", "tiktoken", "none"] = "sentencepiece"
    """sentencepiece .model, hf tokenizer.json, gpt2_bpe vocab.json+merges.txt, tiktoken BPE file; none: blend ids."""
    tokenizer_model: Optional[str] = None
    """The tokenizer's file (see tokenizer_kind); None: trained from the corpus into cache_dir (sentencepiece, hf)."""
    tokenizer_merges: Optional[str] = None
    """gpt2_bpe's merges.txt (tokenizer_model is its vocab.json)."""
    tokenizer_eod: Optional[str] = None
    """End-of-document token of hf/gpt2_bpe/tiktoken; None: "<|endoftext|>" (tiktoken adds it last)."""
    eod_id: Optional[int] = None
    """tokenizer_kind none: the end-of-document id in the blend's .bin files (< model.vocab_size)."""
    blend: Optional[str] = None
    """Megatron's --data-path: "0.3 prefixA 0.7 prefixB", or "prefixA prefixB" (by size)."""
    train_blend: Optional[str] = None
    """Per-split blend (Megatron's --train-data-path), used instead of blend + split."""
    valid_blend: Optional[str] = None
    """Per-split blend (Megatron's --valid-data-path); needs train_blend."""
    split: str = "95,5,0"
    """train,valid,test shares of each prefix's documents (Megatron's --split)."""
    cache_dir: str = "runs/data"
    """The corpus's tokenizer and tokens, and megatron-core's sample indices."""
    num_workers: Optional[int] = None
    """DataLoader worker processes per rank; None: 2 on CUDA, 0 on CPU."""
    pin_memory: bool = True
    """On CUDA: batches staged in pinned memory and copied asynchronously."""
    reset_position_ids: bool = False
    """Positions restart at 0 after each end-of-document token of a packed sample (Megatron's --reset-position-ids)."""
    reset_attention_mask: bool = False
    """Tokens attend only within their own document of a packed sample: a block-causal mask (Megatron's
    --reset-attention-mask; model.attention sdpa or local, auto takes sdpa)."""
    eod_mask_loss: bool = False
    """No loss where the input token is the end-of-document token: the loss is the mean over the other tokens
    of the global batch (Megatron's --eod-mask-loss; pretrain/data/batch.py)."""

    def check(self) -> None:
        try:
            self._blends = {key: parse_blend(getattr(self, key), f"data.{key}")
                            for key in BLEND_KEYS if getattr(self, key) is not None}
            self._split_shares = parse_split(self.split)
        except ValueError as err:
            raise ConfigError(str(err)) from None
        per_split = self.per_split()
        require(not (per_split and self.blend is not None),
                "data.blend and data.train_blend / data.valid_blend are exclusive: a blend is split by data.split, "
                "per-split blends replace it")
        require(not per_split or self.train_blend is not None, "data.valid_blend needs data.train_blend")
        self._check_tokenizer(per_split or self.blend is not None)
        require(self.num_workers is None or self.num_workers >= 0,
                f"data.num_workers = {self.num_workers} must be >= 0 (or unset: 2 on CUDA, 0 on CPU)")
        for key in ("corpus", "cache_dir", "text_column"):
            require(getattr(self, key) is None or bool(getattr(self, key).strip()),
                    f"data.{key} = {getattr(self, key)!r} is invalid; name a " + ("column" if key == "text_column" else "path"))

    def _check_tokenizer(self, blend: bool) -> None:
        kind = self.tokenizer_kind
        kinds = "sentencepiece, hf, gpt2_bpe, tiktoken, none"
        require(kind in kinds.split(", "), f"data.tokenizer_kind = {kind!r} is unknown; kinds: {kinds}")
        if kind == "none":
            require(blend, "data.tokenizer_kind = 'none' needs data.blend or data.train_blend (.bin/.idx made "
                    "elsewhere); a corpus needs a tokenizer")
            require(self.eod_id is not None, "data.tokenizer_kind = 'none' needs data.eod_id, the end-of-document "
                    "id in the .bin files")
            require(self.eod_id >= 0, f"data.eod_id = {self.eod_id} must be >= 0")
            require(self.tokenizer_model is None, f"data.tokenizer_model = {self.tokenizer_model!r} is set but "
                    "data.tokenizer_kind = 'none' reads no tokenizer file; unset one of them")
        else:
            require(self.eod_id is None, f"data.eod_id = {self.eod_id} applies only to data.tokenizer_kind = 'none' "
                    f"(here {kind!r}, whose tokenizer gives the id)")
        require(not blend or kind == "none" or self.tokenizer_model is not None,
                "data.blend / data.train_blend need data.tokenizer_model; name the tokenizer that made their token ids "
                "(or, with no tokenizer file, set data.tokenizer_kind = 'none' and data.eod_id)")
        require(kind in ("sentencepiece", "hf", "none") or self.tokenizer_model is not None,
                f"data.tokenizer_kind = {kind!r} needs data.tokenizer_model; only sentencepiece and hf are trained "
                "from the corpus")
        if kind == "gpt2_bpe":
            require(self.tokenizer_merges is not None, "data.tokenizer_kind = 'gpt2_bpe' needs data.tokenizer_merges "
                    "(merges.txt) beside data.tokenizer_model (vocab.json)")
        else:
            require(self.tokenizer_merges is None, f"data.tokenizer_merges = {self.tokenizer_merges!r} applies only "
                    f"to data.tokenizer_kind = 'gpt2_bpe' (here {kind!r})")
        require(self.tokenizer_eod is None or (kind in ("hf", "gpt2_bpe", "tiktoken") and self.tokenizer_eod != ""),
                f"data.tokenizer_eod = {self.tokenizer_eod!r} is invalid for data.tokenizer_kind = {kind!r}; it names "
                "a non-empty end-of-document token for hf, gpt2_bpe or tiktoken (sentencepiece has its own)")

    def document_keys(self) -> tuple[str, ...]:
        """The document-boundary keys set: reset_position_ids, reset_attention_mask, eod_mask_loss."""
        return tuple(key for key in DOCUMENT_FIELDS if getattr(self, key))

    def document_fields(self) -> tuple[str, ...]:
        """megatron-core's per-sample fields those keys change, carried with each token block
        (pretrain/data/batch.py)."""
        return tuple(DOCUMENT_FIELDS[key] for key in self.document_keys())

    def blends(self) -> dict[str, Blend]:
        """The blends set, by key ("blend", "train_blend", "valid_blend"), as parsed when the section was built."""
        return dict(self._blends)

    def per_split(self) -> bool:
        """Per-split blends (train_blend / valid_blend) instead of one blend cut by data.split."""
        return self.train_blend is not None or self.valid_blend is not None

    def split_shares(self) -> list[float]:
        """data.split's train, valid and test shares, summing to 1."""
        return list(self._split_shares)


@dataclass
class TrainConfig(Section):
    section: ClassVar[str] = "train"
    steps: int = 40
    """Optimizer steps of the run."""
    micro_batch_size: int = 4
    """Samples per rank per micro-batch."""
    global_batch_size: int = 16
    """Samples per step over all data-parallel ranks (a multiple of micro_batch_size × DP)."""
    seed: int = 1234
    """Model initialisation and data order, in [0, 2**32 - 2**20)."""
    eval_interval: int = 20
    """Steps between validations; 0 disables validation."""
    eval_iters: int = 2
    """Global batches per evaluation (Megatron: eval_iters × global batch samples)."""
    save_interval: int = 0
    """Steps between checkpoints; 0: save only at the end (and on a stop signal)."""
    save_final: bool = True
    """false for throughput runs: no multi-TB checkpoint at the last step."""
    save_dir: Optional[str] = None
    """Checkpoint directory; None: <run_dir>/checkpoints."""
    resume: bool = True
    """Continue from the latest checkpoint in save_dir when there is one."""
    allow_schedule_change: bool = False
    """A resume whose train.steps or optimizer schedule keys change the learning rate of a step still to train is
    refused unless this is true (pretrain/runtime/resume.py)."""
    init_from: Optional[str] = None
    """A Hugging Face model directory of a family docs/families.md lists (GPT-2, Llama, Qwen2, Qwen3, Mistral;
    safetensors and JSON only, no remote code) whose weights start the run at step 0 with a fresh optimizer, on any
    layout and ZeRO stage; its config.json must describe this [model] section (`python -m pretrain.hf_config DIR` prints
    it). A run that resumes a checkpoint ignores it."""
    save_final_hf: Optional[str] = None
    """A new (or empty) directory: after the last step's checkpoint, rank 0 writes the model there in the Hugging
    Face format with the run's tokenizer (what `python -m pretrain.export <checkpoint> DIR --format hf` writes).
    A run stopped early writes none (the run that resumes it does). Needs save_final."""
    keep_checkpoints: int = 0
    """Keep the last K checkpoints (never the one `latest` names); 0 keeps all."""
    async_save: bool = True
    """Write checkpoints in the background; the step waits only for the copy."""
    timeout_minutes: float = 10.0
    """Collective timeout (fractions allowed: 0.1 = 6 s); the watchdog waits 2×."""
    max_nonfinite_steps: int = 3
    """Stop (exit 4) after this many consecutive non-finite steps."""
    max_failed_saves: int = 3
    """A failed save is logged and retried at the next one; this many in a row: exit 3."""
    ignore_memory_estimate: bool = False
    """Run even when the start-up estimate exceeds GPU memory."""

    def check(self) -> None:
        for key in ("steps", "micro_batch_size", "global_batch_size", "eval_iters"):
            require(getattr(self, key) > 0, f"train.{key} = {getattr(self, key)} must be > 0")
        require(self.eval_interval >= 0 and self.save_interval >= 0,
                "train.eval_interval and train.save_interval must be >= 0")
        require(self.keep_checkpoints >= 0,
                f"train.keep_checkpoints = {self.keep_checkpoints} must be >= 0 (0 keeps all)")
        require(self.timeout_minutes * 60 >= 1,
                f"train.timeout_minutes = {self.timeout_minutes} is invalid; must be at least 1 second (1/60)")
        require(self.max_failed_saves >= 1,
                f"train.max_failed_saves = {self.max_failed_saves} is invalid; must be >= 1")
        require(self.max_nonfinite_steps >= 1,
                f"train.max_nonfinite_steps = {self.max_nonfinite_steps} is invalid; must be >= 1")
        require(0 <= self.seed < 2**32 - 2**20, f"train.seed = {self.seed} is invalid; must be in [0, 2**32 - 2**20)")
        require(self.save_final_hf is None or self.save_final,
                f"train.save_final_hf = {self.save_final_hf!r} is invalid with train.save_final = false; it exports "
                "the final checkpoint: set save_final = true or unset save_final_hf")


@dataclass
class LoggingConfig(Section):
    section: ClassVar[str] = "logging"
    name: str = "run"
    """The run's name: its directory runs/<name> and its wandb run."""
    run_dir: Optional[str] = None
    """Where the run writes; None: runs/<name>."""
    log_interval: int = 1
    """Steps between logged records (>= 1)."""
    straggler_factor: float = 1.5
    """A rank whose step takes this many times the median is named (perf/slowest_*)."""
    console: Literal["auto", "bar", "plain"] = "auto"
    """Console output: a progress bar, plain lines, or auto (a bar on a terminal)."""
    wandb: bool = True
    """Log to Weights & Biases (offline unless WANDB_MODE says otherwise)."""
    wandb_project: str = "zero3d"
    """The wandb project."""
    wandb_group: Optional[str] = None
    """The wandb group (a sweep's runs share one)."""
    tensorboard: bool = True
    """TensorBoard event files in <run_dir>/tensorboard: metrics.jsonl's numeric keys as scalars."""
    summary_warmup_steps: int = 10
    """Steps left out of the run summary's medians (warm-up)."""

    def check(self) -> None:
        require(self.log_interval >= 1, f"logging.log_interval = {self.log_interval} is invalid; must be >= 1")
        require(math.isfinite(self.straggler_factor) and self.straggler_factor > 1,
                f"logging.straggler_factor = {self.straggler_factor} is invalid; must be a finite number > 1")
        require(self.summary_warmup_steps >= 0,
                f"logging.summary_warmup_steps = {self.summary_warmup_steps} is invalid; must be >= 0")
        require(bool(self.name.strip()) and "/" not in self.name,
                f"logging.name = {self.name!r} is invalid; must be a non-empty name without '/'")


@dataclass
class ClusterConfig(Section):
    """Where a config runs under Slurm; the training run itself takes its world from the launcher."""

    section: ClassVar[str] = "cluster"
    nodes: int = 1
    """Slurm nodes."""
    min_nodes: Optional[int] = None
    """Elastic jobs: with min_nodes < nodes, slurm/submit.py asks for `sbatch --nodes=min_nodes-nodes` and the
    run takes its DP size from the allocation it gets (the global batch kept); None: exactly `nodes`."""
    gpus_per_node: int = 8
    """GPUs (tasks) per node. The node-aware zero.* modes take the launcher's count (SLURM_NTASKS_PER_NODE,
    LOCAL_WORLD_SIZE) unless the TOML or an override sets this key, which wins."""
    gpu: str = "H100"
    """Peak table key for MFU and the estimator: V100, A100, H100, H200."""
    gpu_memory_gb: float = 80.0
    """GPU memory in GiB: the budget of --estimate, the start-up guard and the planner."""
    time_limit: str = "01:00:00"
    """Slurm's --time."""
    partition: Optional[str] = None
    """Slurm partition; None: the cluster's default."""
    checkpoint_write_gbps: float = 5.0
    """Aggregate write bandwidth (GB/s) of the file system holding the checkpoints: slurm/submit.py
    sizes the SIGUSR1 warning before the time limit from it and the checkpoint's bytes."""

    def check(self) -> None:
        require(self.nodes >= 1 and self.gpus_per_node >= 1, "cluster.nodes and cluster.gpus_per_node must be >= 1")
        require(self.min_nodes is None or 1 <= self.min_nodes <= self.nodes,
                f"cluster.min_nodes = {self.min_nodes} is invalid; must be in 1..cluster.nodes "
                f"({self.nodes}), or unset for exactly cluster.nodes")
        require(self.gpu_memory_gb > 0, f"cluster.gpu_memory_gb = {self.gpu_memory_gb} is invalid; must be > 0")
        require(self.checkpoint_write_gbps > 0,
                f"cluster.checkpoint_write_gbps = {self.checkpoint_write_gbps} must be > 0 (GB/s)")


@dataclass
class PaperConfig(Section):
    """For configs/paper/: what the paper reports for this job; slurm/sweep.py skips "oom" jobs."""

    section: ClassVar[str] = "paper"
    expected: Literal["run", "oom"] = "run"
    """run, or oom: the paper reports this job out of memory."""
    reason: str = ""
    """Why (which figure or table of the paper says so)."""
    shrink: int = 1
    """slurm/sweep.py --cpu --shrink N: every model shape ÷ N on CPU ranks (1: the paper's shapes)."""

    def check(self) -> None:
        require(self.shrink >= 1, f"paper.shrink = {self.shrink} is invalid; must be >= 1 (1: the paper's shapes)")
