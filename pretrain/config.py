"""One typed config tree, loaded from TOML with `section.key=value` overrides, validated with clear errors.
Over 400 lines because all nine sections and their validation live here; giving each section its own
self-validating module (cross-section rules alone here) is issue 27's next step."""
import dataclasses
import difflib
import json
import math
import os
import tomllib
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal, Optional

from pretrain.blend import parse_blend, parse_split
from pretrain.errors import ConfigError
from zero3d.config import ZeroConfig, ZeroConfigError  # the [zero] section: zero3d's own dataclass

REPO_ROOT = Path(__file__).resolve().parent.parent


@dataclass
class ModelConfig:
    num_layers: int = 2
    hidden_size: int = 64
    num_attention_heads: int = 4
    ffn_hidden_size: Optional[int] = None  # None: 4 × hidden_size
    seq_length: int = 64
    vocab_size: int = 512  # tokenizer vocabulary; the embedding is padded (see padded_vocab_size)
    make_vocab_size_divisible_by: int = 128
    tie_embeddings: bool = False
    hidden_dropout: float = 0.0
    attention_dropout: float = 0.0
    init_method_std: float = 0.02
    recompute: Literal["none", "full"] = "none"  # full: every transformer layer recomputed
    # Core attention (pretrain/attention.py): auto = Transformer Engine on GPU where importable, else
    # torch's scaled_dot_product_attention; local = megatron's DotProductAttention; te refused where missing.
    attention: Literal["auto", "sdpa", "local", "te"] = "auto"
    # Output layer + cross-entropy this many tokens at a time (pretrain/loss.py); 0: megatron's, in one piece.
    loss_chunk_tokens: int = 1024
    # torch.compile of each transformer layer (inductor); off: no GPU measurement says it is faster yet.
    compile: bool = False

    def padded_vocab_size(self, tensor_parallel: int) -> int:
        """Megatron's rule: pad the vocabulary to a multiple of divisible_by × TP."""
        multiple = self.make_vocab_size_divisible_by * tensor_parallel
        return -(-self.vocab_size // multiple) * multiple

    @property
    def ffn_size(self) -> int:
        return self.ffn_hidden_size or 4 * self.hidden_size


@dataclass
class ParallelConfig:
    tensor: int = 1
    pipeline: int = 1
    sequence_parallel: bool = False


@dataclass
class OptimizerConfig:
    lr: float = 1e-3
    min_lr: float = 1e-4
    warmup_steps: int = 5
    decay_steps: Optional[int] = None  # None: train.steps
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    clip_grad: float = 1.0  # 0 disables clipping


@dataclass
class PrecisionConfig:
    dtype: Literal["fp32", "bf16", "fp16"] = "fp32"
    initial_loss_scale: float = 2.0**16  # fp16 dynamic loss scaling
    min_loss_scale: float = 1.0
    growth_interval: int = 1000  # clean steps before the scale doubles
    backoff_factor: float = 0.5
    hysteresis: int = 2  # overflows tolerated before backing off


@dataclass
class DataConfig:
    """Either a corpus (tokenized into cache_dir) or Megatron .bin/.idx prefixes in blend / per-split blends."""

    corpus: str = "data/corpus.jsonl"  # JSONL file or glob ({"text": ...} a line; .gz/.zst too), used without a blend
    tokenizer_model: Optional[str] = None  # sentencepiece .model; None: trained from the corpus into cache_dir
    blend: Optional[str] = None  # Megatron's --data-path: "0.3 prefixA 0.7 prefixB", or "prefixA prefixB" (by size)
    train_blend: Optional[str] = None  # per-split blends (Megatron's --train-data-path / --valid-data-path):
    valid_blend: Optional[str] = None  # used instead of blend + split
    split: str = "95,5,0"  # train,valid,test shares of each prefix's documents (Megatron's --split)
    cache_dir: str = "runs/data"  # the corpus's tokenizer and tokens, and megatron-core's sample indices
    num_workers: Optional[int] = None  # DataLoader worker processes per rank; None: 2 on CUDA, 0 on CPU
    pin_memory: bool = True  # on CUDA: batches staged in pinned memory and copied asynchronously


@dataclass
class TrainConfig:
    steps: int = 40
    micro_batch_size: int = 4
    global_batch_size: int = 16
    seed: int = 1234
    eval_interval: int = 20  # 0 disables validation
    eval_iters: int = 2  # global batches per evaluation (Megatron: eval_iters × global batch samples)
    save_interval: int = 0  # 0: save only at the end (and on a stop signal)
    save_final: bool = True  # false for throughput runs: no multi-TB checkpoint at the last step
    save_dir: Optional[str] = None  # None: <run_dir>/checkpoints
    resume: bool = True  # continue from the latest checkpoint in save_dir when there is one
    keep_checkpoints: int = 0  # keep the last K checkpoints (never the one `latest` names); 0 keeps all
    async_save: bool = True  # write checkpoints in the background; the step waits only for the copy
    timeout_minutes: float = 10.0  # collective timeout (fractions allowed: 0.1 = 6 s); the watchdog waits 2×
    max_nonfinite_steps: int = 3  # stop (exit 4) after this many consecutive non-finite steps
    max_failed_saves: int = 3  # a failed save is logged and retried at the next one; this many in a row: exit 3
    ignore_memory_estimate: bool = False  # run even when the start-up estimate exceeds GPU memory


@dataclass
class LoggingConfig:
    name: str = "run"
    run_dir: Optional[str] = None  # None: runs/<name>
    log_interval: int = 1
    straggler_factor: float = 1.5  # a rank whose step takes this many times the median is named (perf/slowest_*)
    console: Literal["auto", "bar", "plain"] = "auto"
    wandb: bool = True
    wandb_project: str = "zero3d"
    wandb_group: Optional[str] = None
    summary_warmup_steps: int = 10  # steps left out of the run summary's medians (warm-up)


@dataclass
class ClusterConfig:
    """Where a config runs under Slurm; the training run itself takes its world from the launcher."""

    nodes: int = 1
    # Elastic jobs: with min_nodes < nodes, slurm/submit.py asks for `sbatch --nodes=min_nodes-nodes` and the
    # run takes its DP size from the allocation it gets (the global batch kept); None: exactly `nodes`.
    min_nodes: Optional[int] = None
    gpus_per_node: int = 8
    gpu: str = "H100"  # peak table key for MFU and the estimator: V100, A100, H100, H200
    gpu_memory_gb: float = 80.0
    time_limit: str = "01:00:00"
    partition: Optional[str] = None
    # Aggregate write bandwidth (GB/s) of the file system holding the checkpoints: slurm/submit.py
    # sizes the SIGUSR1 warning before the time limit from it and the checkpoint's bytes.
    checkpoint_write_gbps: float = 5.0


@dataclass
class PaperConfig:
    """For configs/paper/: what the paper reports for this job; slurm/sweep.py skips "oom" jobs."""

    expected: Literal["run", "oom"] = "run"
    reason: str = ""  # why (which figure or table of the paper says so)


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    zero: ZeroConfig = field(default_factory=ZeroConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    precision: PrecisionConfig = field(default_factory=PrecisionConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    paper: PaperConfig = field(default_factory=PaperConfig)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @property
    def run_dir(self) -> Path:
        return Path(self.logging.run_dir or f"runs/{self.logging.name}")


# ---------------------------------------------------------------- loading


def _coerce(key: str, value, annotation):
    """Check `value` against a dataclass field annotation; return it (ints widen to floats)."""
    origin = typing.get_origin(annotation)
    if origin is typing.Union:  # Optional[X]
        if value is None:
            return None
        (inner,) = [a for a in typing.get_args(annotation) if a is not type(None)]
        return _coerce(key, value, inner)
    if origin is Literal:
        choices = typing.get_args(annotation)
        if value not in choices or type(value) is not type(choices[0]):
            raise ConfigError(f"{key} = {value!r} is invalid; valid values: "
                              f"{', '.join(repr(c) for c in choices)}")
        return value
    if annotation is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{key} = {value!r} is invalid; expected true or false")
        return value
    if annotation is int:
        if isinstance(value, bool) or not isinstance(value, int):
            if isinstance(value, float) and value.is_integer():
                return int(value)
            raise ConfigError(f"{key} = {value!r} is invalid; expected an integer")
        return value
    if annotation is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{key} = {value!r} is invalid; expected a number")
        return float(value)
    if annotation is str:
        if not isinstance(value, str):
            raise ConfigError(f"{key} = {value!r} is invalid; expected a string")
        return value
    raise TypeError(f"unsupported annotation {annotation} for {key}")


def _unknown(key: str, valid: list[str]) -> ConfigError:
    close = difflib.get_close_matches(key.rsplit(".", 1)[-1], valid, n=1)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    return ConfigError(f"unknown config key {key!r}{hint}; valid keys here: {', '.join(valid)}")


def _merge(cfg: Config, tree: dict, source: str) -> None:
    sections = {f.name: f for f in dataclasses.fields(Config)}
    for name, body in tree.items():
        if name not in sections:
            raise _unknown(name, list(sections))
        if not isinstance(body, dict):
            raise ConfigError(f"[{name}] in {source} must be a table of keys, got {body!r}")
        section = getattr(cfg, name)
        hints = typing.get_type_hints(type(section))
        fields = [f.name for f in dataclasses.fields(section)]
        for key, value in body.items():
            if key not in fields:
                raise _unknown(f"{name}.{key}", fields)
            setattr(section, key, _coerce(f"{name}.{key}", value, hints[key]))


def _parse_override(text: str) -> tuple[str, str, object]:
    if "=" not in text:
        raise ConfigError(f"override {text!r} must look like section.key=value, e.g. zero.stage=2")
    dotted, raw = text.split("=", 1)
    parts = dotted.strip().split(".")
    if len(parts) != 2 or not all(parts):
        raise ConfigError(f"override key {dotted!r} must be section.key, e.g. model.num_layers")
    try:
        value = tomllib.loads(f"v = {raw.strip()}")["v"]
    except tomllib.TOMLDecodeError:
        value = raw.strip()  # bare words are strings: logging.name=foo
    return parts[0], parts[1], value


RESOLVED_CONFIG = "config.json"  # <run_dir>/config.json: the resolved tree a run started with


def save_resolved(cfg: "Config", run_dir: Optional[Path] = None) -> Path:
    """Write the resolved config into the run directory (tmp + rename), for slurm/collect.py and resumes."""
    run_dir = Path(run_dir or cfg.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    target = run_dir / RESOLVED_CONFIG
    tmp = target.with_name(f"{RESOLVED_CONFIG}.tmp{os.getpid()}")
    tmp.write_text(json.dumps(cfg.to_dict(), indent=2) + "\n")
    os.replace(tmp, target)
    return target


def load_config(path: Optional[str | Path] = None, overrides: tuple[str, ...] | list[str] = (),
                check: bool = True) -> Config:
    """Defaults ← TOML file ← `section.key=value` overrides; then validate() (unless check=False)."""
    cfg = Config()
    if path is not None:
        path = Path(path)
        if path.is_dir():
            some = sorted(path.glob("*.toml"))[:1]
            raise ConfigError(f"config file {str(path)!r} is a directory",
                              fix=f"give one TOML file in it, e.g. --config {some[0]}" if some else
                              "give a TOML file")
        if not path.is_file():
            raise ConfigError(f"config file {str(path)!r} does not exist")
        try:
            tree = tomllib.loads(path.read_text())
        except tomllib.TOMLDecodeError as err:
            raise ConfigError(f"config file {str(path)!r} is not valid TOML: {err}") from None
        _merge(cfg, tree, str(path))
    for text in overrides:
        section, key, value = _parse_override(text)
        _merge(cfg, {section: {key: value}}, f"override {text!r}")
    if check:
        validate(cfg)
    return cfg


# ---------------------------------------------------------------- validation


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ConfigError(message)


FP16_ONLY = ("initial_loss_scale", "min_loss_scale", "growth_interval", "backoff_factor", "hysteresis")


def _check_finite(cfg: Config) -> None:
    """No setting may be inf or nan (optimizer.lr = inf would train NaNs)."""
    for section in dataclasses.fields(Config):
        body = getattr(cfg, section.name)
        for f in dataclasses.fields(body):
            value = getattr(body, f.name)
            _require(not isinstance(value, float) or math.isfinite(value),
                     f"{section.name}.{f.name} = {value} is invalid; must be a finite number")


def _check_fp16_only(pr: PrecisionConfig) -> None:
    """Loss-scaling settings act only with fp16: changed with bf16/fp32 they would be silently ignored."""
    if pr.dtype == "fp16":
        return
    defaults = PrecisionConfig()
    for key in FP16_ONLY:
        _require(getattr(pr, key) == getattr(defaults, key),
                 f"precision.{key} = {getattr(pr, key)} has no effect with precision.dtype = {pr.dtype!r}; "
                 f"remove it, or set precision.dtype = \"fp16\" (dynamic loss scaling is fp16-only)")


def validate(cfg: Config, world_size: Optional[int] = None) -> None:
    """Checks that need no process group; with `world_size`, also the layout's divisibility."""
    try:  # the [zero] keys were set one by one: build the dataclass again so it checks itself
        cfg.zero = ZeroConfig(**dataclasses.asdict(cfg.zero))
    except ZeroConfigError as err:
        raise ConfigError(str(err)) from None
    m, p, z, o, t = cfg.model, cfg.parallel, cfg.zero, cfg.optimizer, cfg.train
    _check_finite(cfg)
    for key in ("num_layers", "hidden_size", "num_attention_heads", "seq_length", "vocab_size",
                "make_vocab_size_divisible_by"):
        _require(getattr(m, key) > 0, f"model.{key} = {getattr(m, key)} is invalid; must be > 0")
    _require(m.hidden_size % m.num_attention_heads == 0,
             f"model.hidden_size = {m.hidden_size} is not divisible by model.num_attention_heads = "
             f"{m.num_attention_heads}; choose a head count that divides the hidden size")
    _require(m.ffn_hidden_size is None or m.ffn_hidden_size > 0,
             f"model.ffn_hidden_size = {m.ffn_hidden_size} is invalid; must be > 0 (or unset: 4 × hidden_size)")
    _require(m.loss_chunk_tokens >= 0, f"model.loss_chunk_tokens = {m.loss_chunk_tokens} is invalid; must be "
             ">= 0 (0: the loss over all tokens at once)")
    _require(not (m.compile and z.stage == 3),
             "model.compile = true with zero.stage = 3 is refused: stage 3 swaps each parameter's storage around "
             "its gathers, which the compiled layers' saved tensors do not survive; use stage 0-2 or model.compile = false")
    _require(m.init_method_std > 0, f"model.init_method_std = {m.init_method_std} is invalid; must be > 0")
    for key in ("hidden_dropout", "attention_dropout"):
        _require(0.0 <= getattr(m, key) < 1.0, f"model.{key} = {getattr(m, key)} must be in [0, 1)")
    _require(p.tensor >= 1, f"parallel.tensor = {p.tensor} is invalid; must be >= 1")
    _require(p.pipeline >= 1, f"parallel.pipeline = {p.pipeline} is invalid; must be >= 1")
    _require(m.num_layers % p.pipeline == 0,
             f"model.num_layers = {m.num_layers} is not divisible by parallel.pipeline = {p.pipeline}; "
             "every pipeline stage holds the same number of layers")
    _require(z.stage != 3 or p.pipeline == 1,
             f"zero.stage = 3 with parallel.pipeline = {p.pipeline} is not supported: stage 3 gathers "
             "parameters around each module's forward and backward, which megatron's pipeline schedule "
             "interleaves across micro-batches; use zero.stage <= 2 with pipeline parallelism")
    _require(m.num_attention_heads % p.tensor == 0,
             f"model.num_attention_heads = {m.num_attention_heads} is not divisible by "
             f"parallel.tensor = {p.tensor}; choose a parallel.tensor that divides the head count")
    _require(m.hidden_size % p.tensor == 0,
             f"model.hidden_size = {m.hidden_size} is not divisible by parallel.tensor = {p.tensor}; "
             "choose a parallel.tensor that divides it")
    _require(m.ffn_size % p.tensor == 0,
             f"model.ffn_hidden_size = {m.ffn_size} is not divisible by parallel.tensor = {p.tensor}; "
             "choose a parallel.tensor that divides it")
    _require(not (p.sequence_parallel and p.tensor == 1),
             "parallel.sequence_parallel = true needs parallel.tensor > 1")
    _require(not (p.sequence_parallel and z.stage == 3),
             "parallel.sequence_parallel = true with zero.stage = 3 is not supported: the sequence-parallel "
             "layer-norm gradients must be summed over the TP group before stage 3 buckets them")
    _require(not (p.sequence_parallel and z.partition_activations),
             "parallel.sequence_parallel = true with zero.partition_activations = true is refused: with "
             "sequence parallelism each TP rank already stores only its 1/TP of every checkpoint, so Pa "
             "would partition it twice")
    _require(not (z.partition_activations or z.contiguous_checkpointing) or m.recompute == "full",
             "zero.partition_activations / zero.contiguous_checkpointing need model.recompute = "
             f"\"full\" (they store the recomputation checkpoints); got model.recompute = {m.recompute!r}")
    _require(o.lr > 0, f"optimizer.lr = {o.lr} must be > 0")
    _require(0 <= o.min_lr <= o.lr, f"optimizer.min_lr = {o.min_lr} must be in [0, optimizer.lr = {o.lr}]")
    _require(o.warmup_steps >= 0, f"optimizer.warmup_steps = {o.warmup_steps} must be >= 0")
    _require(o.clip_grad >= 0, f"optimizer.clip_grad = {o.clip_grad} must be >= 0 (0 disables)")
    _require(0 <= o.beta1 < 1 and 0 <= o.beta2 < 1, "optimizer.beta1/beta2 must be in [0, 1)")
    _require(o.eps > 0, f"optimizer.eps = {o.eps} is invalid; must be > 0")
    _require(o.weight_decay >= 0, f"optimizer.weight_decay = {o.weight_decay} is invalid; must be >= 0")
    _require(o.decay_steps is None or o.decay_steps >= 1,
             f"optimizer.decay_steps = {o.decay_steps} is invalid; must be >= 1 (or unset: train.steps)")
    pr = cfg.precision
    _check_fp16_only(pr)
    _require(pr.initial_loss_scale >= pr.min_loss_scale > 0,
             "precision.initial_loss_scale must be >= precision.min_loss_scale > 0")
    _require(0 < pr.backoff_factor < 1, f"precision.backoff_factor = {pr.backoff_factor} must be in (0, 1)")
    _require(pr.growth_interval >= 1 and pr.hysteresis >= 1,
             "precision.growth_interval and precision.hysteresis must be >= 1")
    validate_data(cfg)
    for key in ("steps", "micro_batch_size", "global_batch_size", "eval_iters"):
        _require(getattr(t, key) > 0, f"train.{key} = {getattr(t, key)} must be > 0")
    _require(t.eval_interval >= 0 and t.save_interval >= 0,
             "train.eval_interval and train.save_interval must be >= 0")
    _require(t.keep_checkpoints >= 0, f"train.keep_checkpoints = {t.keep_checkpoints} must be >= 0 (0 keeps all)")
    _require(t.timeout_minutes * 60 >= 1,
             f"train.timeout_minutes = {t.timeout_minutes} is invalid; must be at least 1 second (1/60)")
    _require(t.max_failed_saves >= 1,
             f"train.max_failed_saves = {t.max_failed_saves} is invalid; must be >= 1")
    _require(t.max_nonfinite_steps >= 1,
             f"train.max_nonfinite_steps = {t.max_nonfinite_steps} is invalid; must be >= 1")
    _require(0 <= t.seed < 2**32 - 2**20, f"train.seed = {t.seed} is invalid; must be in [0, 2**32 - 2**20)")
    lg = cfg.logging
    _require(lg.log_interval >= 1, f"logging.log_interval = {lg.log_interval} is invalid; must be >= 1")
    _require(math.isfinite(lg.straggler_factor) and lg.straggler_factor > 1,
             f"logging.straggler_factor = {lg.straggler_factor} is invalid; must be a finite number > 1")
    _require(lg.summary_warmup_steps >= 0,
             f"logging.summary_warmup_steps = {lg.summary_warmup_steps} is invalid; must be >= 0")
    _require(bool(lg.name.strip()) and "/" not in lg.name,
             f"logging.name = {lg.name!r} is invalid; must be a non-empty name without '/'")
    for key in ("corpus", "cache_dir"):
        _require(bool(getattr(cfg.data, key).strip()), f"data.{key} = '' is invalid; name a path")
    _require(cfg.cluster.nodes >= 1 and cfg.cluster.gpus_per_node >= 1,
             "cluster.nodes and cluster.gpus_per_node must be >= 1")
    _require(cfg.cluster.min_nodes is None or 1 <= cfg.cluster.min_nodes <= cfg.cluster.nodes,
             f"cluster.min_nodes = {cfg.cluster.min_nodes} is invalid; must be in 1..cluster.nodes "
             f"({cfg.cluster.nodes}), or unset for exactly cluster.nodes")
    _require(cfg.cluster.gpu_memory_gb > 0,
             f"cluster.gpu_memory_gb = {cfg.cluster.gpu_memory_gb} is invalid; must be > 0")
    _require(cfg.cluster.checkpoint_write_gbps > 0,
             f"cluster.checkpoint_write_gbps = {cfg.cluster.checkpoint_write_gbps} must be > 0 (GB/s)")
    if world_size is not None:
        validate_layout(cfg, world_size)


def validate_data(cfg: Config) -> None:
    """[data]: blends and split parse, one source of samples, a validation source when eval is on."""
    d = cfg.data
    try:
        for key in ("blend", "train_blend", "valid_blend"):
            if getattr(d, key) is not None:
                parse_blend(getattr(d, key), f"data.{key}")
        shares = parse_split(d.split)
    except ValueError as err:
        raise ConfigError(str(err)) from None
    per_split = d.train_blend is not None or d.valid_blend is not None
    _require(not (per_split and d.blend is not None),
             "data.blend and data.train_blend / data.valid_blend are exclusive: a blend is split by data.split, "
             "per-split blends replace it")
    _require(not per_split or d.train_blend is not None, "data.valid_blend needs data.train_blend")
    _require(not (per_split or d.blend) or d.tokenizer_model is not None,
             "data.blend / data.train_blend need data.tokenizer_model; name the tokenizer that made their token ids")
    evaluating = cfg.train.eval_interval > 0
    _require(not (evaluating and per_split and d.valid_blend is None),
             f"train.eval_interval = {cfg.train.eval_interval} needs data.valid_blend with data.train_blend "
             "(or train.eval_interval = 0)")
    _require(not (evaluating and not per_split and shares[1] == 0),
             f"data.split = {d.split!r} leaves no validation documents but train.eval_interval = "
             f"{cfg.train.eval_interval}; give the second share a value > 0 (or train.eval_interval = 0)")
    _require(d.num_workers is None or d.num_workers >= 0,
             f"data.num_workers = {d.num_workers} must be >= 0 (or unset: 2 on CUDA, 0 on CPU)")


def validate_layout(cfg: Config, world_size: int) -> int:
    """Returns the gradient-accumulation steps; raises if the layout does not divide."""
    p, t = cfg.parallel, cfg.train
    model_parallel = p.tensor * p.pipeline
    _require(world_size % model_parallel == 0,
             f"world size {world_size} is not divisible by parallel.tensor × parallel.pipeline = "
             f"{model_parallel}; valid world sizes are multiples of {model_parallel}")
    dp = world_size // model_parallel
    per_step = t.micro_batch_size * dp
    _require(t.global_batch_size % per_step == 0,
             f"train.global_batch_size = {t.global_batch_size} is not divisible by "
             f"train.micro_batch_size × data-parallel size = {t.micro_batch_size} × {dp} = {per_step}; "
             f"valid global batch sizes are multiples of {per_step}")
    return t.global_batch_size // per_step

