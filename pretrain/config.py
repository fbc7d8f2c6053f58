"""One typed config tree from TOML and `section.key=value` overrides, the rules that read two sections or more, and
[optimizer] / [precision]: the engine's settings (optim/config.py, zero3d/config.py) with this recipe's (pretrain's own
sections: sections.py; [zero]: zero3d/config.py)."""
import dataclasses
import difflib
import fnmatch
import json
import tomllib
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal, Optional

from optim import config as optim_config  # [optimizer]: the engine's optimizer keys
from optim.spec import OptimizerConfigError
from pretrain.atomic import write_atomically
from pretrain.errors import ConfigError
from pretrain.sections import (ClusterConfig, DataConfig, LoggingConfig, ModelConfig, PaperConfig,  # noqa: F401
                               ParallelConfig, Section, TrainConfig, check_finite)
from pretrain.sections import require as _require
from zero3d import config as engine_config  # [zero], [precision]: zero3d's own dataclasses
from zero3d.comm.modes import NODE_AWARE_KEYS
from zero3d.config import FLOAT8_ALIGNMENT, ZeroConfig, ZeroConfigError


@dataclass
class OptimizerConfig(optim_config.OptimizerConfig):
    """[optimizer]: the engine's optimizer and its settings (optim/config.py, validated there) with this recipe's defaults, plus the
    schedule. `name` picks the optimizer; each optimizer's own keys are marked with the optimizers that read them, and
    setting another optimizer's key is an error."""

    weight_decay: float = 0.1
    beta2: float = 0.95
    clip_grad: float = 1.0
    min_lr: float = 1e-4
    """The learning rate the decay ends at, in [0, lr]."""
    warmup_steps: int = 5
    """Steps of linear warmup from lr / warmup_steps to lr."""
    decay_steps: Optional[int] = None
    """Step at which the decay reaches min_lr (held there after); unset: train.steps."""
    schedule: Literal["cosine", "linear", "constant", "wsd", "inverse_sqrt"] = "cosine"
    """After the warmup (pretrain/schedule.py): cosine or linear to min_lr at decay_steps; constant; inverse_sqrt
    (lr · √(warmup_steps / step), not below min_lr); wsd: warmup-stable-decay, lr held, then decayed over the last
    decay_fraction of the steps to decay_steps."""
    decay_fraction: float = 0.2
    """wsd only: the share of the steps after the warmup (to decay_steps) spent decaying, in (0, 1]."""
    decay_shape: Literal["linear", "cosine", "1-sqrt"] = "1-sqrt"
    """wsd only: the decay's shape (1-sqrt: Hägele et al. 2024)."""


@dataclass
class PrecisionConfig(engine_config.LossScaleConfig):
    """[precision]: the compute dtype, plus zero3d's fp16 loss-scale settings (validated there)."""

    dtype: Literal["fp32", "bf16", "fp16"] = "fp32"
    """Compute dtype of the model (fp32 masters whatever it is, optimizer states in optimizer.state_dtype); fp16
    scales the loss."""
    fp8: Literal["none", "tensorwise", "rowwise"] = "none"
    """The transformer layers' QKV, projection, fc1 and fc2 GEMMs in float8 with dynamic current scaling (needs
    dtype bf16; docs/fp8.md): "tensorwise" (one scale per tensor, gradients in e5m2) or "rowwise" (a power-of-two
    scale per row / column, all e4m3), torchao's recipes; the output layer, norms, attention core and loss stay bf16."""


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

    def is_set(self, dotted: str) -> bool:
        """Did the TOML file or an override give `section.key` (rather than its default)?"""
        return dotted in vars(self).get("_given", ())

    @property
    def run_dir(self) -> Path:
        return Path(self.logging.run_dir or f"runs/{self.logging.name}")

    @property
    def save_dir(self) -> Path:
        """Where the run's checkpoints are: train.save_dir, else <run_dir>/checkpoints."""
        return Path(self.train.save_dir) if self.train.save_dir else self.run_dir / "checkpoints"


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
        if not any(value == c and type(value) is type(c) for c in choices):  # True is not 1, "true" not True
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
            vars(cfg).setdefault("_given", set()).add(f"{name}.{key}")  # Config.is_set


def _unset(cfg: Config, text: str) -> None:
    """`~section.key`: back to the key's default, as if neither the TOML file nor an earlier override set it."""
    parts = text[1:].strip().split(".")
    if len(parts) != 2 or not all(parts):
        raise ConfigError(f"override {text!r} must look like ~section.key (unset a key), e.g. ~data.blend")
    name, key = parts
    sections = {f.name: f for f in dataclasses.fields(Config)}
    if name not in sections:
        raise _unknown(name, list(sections))
    section = getattr(cfg, name)
    fields = {f.name: f for f in dataclasses.fields(section)}
    if key not in fields:
        raise _unknown(f"{name}.{key}", list(fields))
    f = fields[key]
    setattr(section, key, f.default_factory() if f.default is dataclasses.MISSING else f.default)
    vars(cfg).setdefault("_given", set()).discard(f"{name}.{key}")


def _parse_override(text: str) -> tuple[str, str, object]:
    if "=" not in text:
        raise ConfigError(f"override {text!r} must look like section.key=value (or ~section.key to unset a "
                          "key), e.g. zero.stage=2")
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
    return write_atomically(run_dir / RESOLVED_CONFIG, json.dumps(cfg.to_dict(), indent=2) + "\n")


def load_config(path: Optional[str | Path] = None, overrides: tuple[str, ...] | list[str] = (),
                check: bool = True) -> Config:
    """Defaults ← TOML file ← `section.key=value` overrides (`~section.key` unsets one: its default again);
    then validate() (unless check=False)."""
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
        if text.startswith("~"):
            _unset(cfg, text)
            continue
        section, key, value = _parse_override(text)
        _merge(cfg, {section: {key: value}}, f"override {text!r}")
    if check:
        validate(cfg)
    return cfg


# ---------------------------------------------------------------- validation


FP16_ONLY = tuple(f.name for f in dataclasses.fields(engine_config.LossScaleConfig))


def _check_fp16_only(pr: PrecisionConfig) -> None:
    """Loss-scaling settings act only with fp16: changed with bf16/fp32 they would be silently ignored."""
    if pr.dtype == "fp16":
        return
    defaults = PrecisionConfig()
    for key in FP16_ONLY:
        _require(getattr(pr, key) == getattr(defaults, key),
                 f"precision.{key} = {getattr(pr, key)} has no effect with precision.dtype = {pr.dtype!r}; "
                 f"remove it, or set precision.dtype = \"fp16\" (dynamic loss scaling is fp16-only)")


def _rebuild_sections(cfg: Config) -> None:
    """The TOML and the overrides set keys one by one: build each section again from its final values, so
    that it checks itself (a section without checks of its own gets the finite-number rule here)."""
    for f in dataclasses.fields(Config):
        try:
            setattr(cfg, f.name, dataclasses.replace(getattr(cfg, f.name)))
        except (ZeroConfigError, OptimizerConfigError) as err:
            raise ConfigError(str(err)) from None
        if not isinstance(getattr(cfg, f.name), Section):
            check_finite(f.name, getattr(cfg, f.name))


# (key, the keys whose setting makes it unused, why): both given is an error, not a silent choice
IRRELEVANT = (("data.corpus", ("data.blend", "data.train_blend"), "a blend reads its .bin/.idx prefixes instead"),
              ("data.split", ("data.train_blend",), "per-split blends are not split"))


def _check_irrelevant(cfg: Config) -> None:
    """A key the TOML or an override gave that another given key makes unused is an error naming both."""
    for key, overriders, why in IRRELEVANT:
        for other in overriders:
            _require(not (cfg.is_set(key) and cfg.is_set(other)),
                     f"{key} and {other} are both set, but {key} is unused with {other} ({why}); remove one "
                     f"(an override can unset a key of the TOML file: ~{key})")


def validate(cfg: Config, world_size: Optional[int] = None) -> None:
    """Each section's own checks, then the rules that read two sections or more; with `world_size`, also
    the layout's divisibility. Needs no process group."""
    _check_fp16_only(cfg.precision)  # before the rebuild: its message names the dtype
    _rebuild_sections(cfg)
    m, p, z, o, t = cfg.model, cfg.parallel, cfg.zero, cfg.optimizer, cfg.train
    _require(m.recompute != "selective" or p.context == 1,
             f"model.recompute = \"selective\" with parallel.context = {p.context} is not supported: context-parallel "
             "attention's causal bias is a tensor subclass torch's selective checkpoint cannot replay; use "
             "model.recompute = \"full\" or \"none\"")
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
    _require(m.shape.groups % p.tensor == 0,
             f"model.num_query_groups = {m.shape.groups} is not divisible by parallel.tensor = {p.tensor}: each TP "
             "rank holds whole key/value heads; valid parallel.tensor values: "
             + ", ".join(str(t) for t in range(1, m.shape.groups + 1)
                         if m.shape.groups % t == 0 and m.num_attention_heads % t == 0))
    _require(m.position_embedding == "rope" or not cfg.is_set("model.rope_base"),
             f"model.rope_base is set but model.position_embedding = {m.position_embedding!r} does not use it; "
             "remove it or set model.position_embedding = \"rope\"")
    for key in ("rope_scaling_low_freq_factor", "rope_scaling_high_freq_factor", "rope_scaling_original_max_positions"):
        _require(m.rope_scaling_factor is not None or not cfg.is_set(f"model.{key}"),
                 f"model.{key} is set but model.rope_scaling_factor is unset (no RoPE scaling reads it); remove it or "
                 "set model.rope_scaling_factor")
    _require(not (cfg.data.reset_position_ids and m.position_embedding == "rope"),
             "data.reset_position_ids = true with model.position_embedding = 'rope' is refused: megatron-core's "
             "rotary embedding takes positions from the sequence, not the batch's position ids; use "
             "position_embedding = 'learned' or data.reset_position_ids = false")
    _require(not (p.sequence_parallel and z.partition_activations),
             "parallel.sequence_parallel = true with zero.partition_activations = true is refused: with "
             "sequence parallelism each TP rank already stores only its 1/TP of every checkpoint, so Pa "
             "would partition it twice")
    _require(not (z.partition_activations or z.contiguous_checkpointing) or m.recompute == "full",
             "zero.partition_activations / zero.contiguous_checkpointing need model.recompute = "
             f"\"full\" (they store the recomputation checkpoints); got model.recompute = {m.recompute!r}")
    _require(0 <= o.min_lr <= o.lr, f"optimizer.min_lr = {o.min_lr} must be in [0, optimizer.lr = {o.lr}]")
    _require(o.warmup_steps >= 0, f"optimizer.warmup_steps = {o.warmup_steps} must be >= 0")
    _require(o.decay_steps is None or o.decay_steps >= 1,
             f"optimizer.decay_steps = {o.decay_steps} is invalid; must be >= 1 (or unset: train.steps)")
    _require(0 < o.decay_fraction <= 1, f"optimizer.decay_fraction = {o.decay_fraction} is invalid; must be in (0, 1]")
    for key in ("decay_fraction", "decay_shape"):
        _require(o.schedule == "wsd" or not cfg.is_set(f"optimizer.{key}"),
                 f"optimizer.{key} is set but optimizer.schedule = {o.schedule!r} does not use it (only 'wsd' "
                 f"does); remove it or set optimizer.schedule = \"wsd\"")
    for key in o.foreign_keys(sorted(k.removeprefix("optimizer.") for k in vars(cfg).get("_given", ())
                                     if k.startswith("optimizer."))):
        _require(False, o.foreign_key_error(key))
    _require(not (o.name == "muon" and z.offload_optimizer == "nvme"),
             "optimizer.name = 'muon' with zero.offload_optimizer = 'nvme' is not supported: Muon's step needs each "
             "hidden matrix's direction whole, which the NVMe stream's chunks do not hold; use zero.offload_optimizer "
             "= 'cpu' or 'none'")
    _check_irrelevant(cfg)
    _check_context(cfg)
    _check_float8(cfg)
    names = m.shape.parameter_names() if o.no_decay_patterns else []
    for pattern in o.no_decay_patterns:
        _require(any(fnmatch.fnmatchcase(name, pattern) for name in names),
                 f"optimizer.no_weight_decay pattern {pattern!r} matches no parameter of this model; names look like "
                 "embedding.word_embeddings.weight, decoder.layers.0.mlp.linear_fc1.weight, output_layer.weight")
    evaluating, d = t.eval_interval > 0, cfg.data
    _require(not (d.reset_attention_mask and m.attention == "te"),
             "data.reset_attention_mask = true with model.attention = 'te' is refused: Transformer Engine's layers "
             "apply only their causal mask, not the per-sample document mask; use model.attention = 'auto', 'sdpa' "
             "or 'local'")
    _require(not (evaluating and d.per_split() and d.valid_blend is None),
             f"train.eval_interval = {t.eval_interval} needs data.valid_blend with data.train_blend "
             "(or train.eval_interval = 0)")
    _require(not (evaluating and not d.per_split() and d.split_shares()[1] == 0),
             f"data.split = {d.split!r} leaves no validation documents but train.eval_interval = "
             f"{t.eval_interval}; give the second share a value > 0 (or train.eval_interval = 0)")
    if world_size is not None:
        validate_layout(cfg, world_size)


def _check_context(cfg: Config) -> None:
    """Context parallelism's rules: equal chunks, an attention that computes across them, no per-sample masks."""
    m, c = cfg.model, cfg.parallel.context
    if c == 1:
        return
    valid = [str(k) for k in range(1, m.seq_length // 2 + 1) if m.seq_length % (2 * k) == 0]
    _require(m.seq_length % (2 * c) == 0,
             f"parallel.context = {c} does not split model.seq_length = {m.seq_length} into 2 × {c} equal chunks; "
             f"valid parallel.context values for this sequence length: {', '.join(valid[:12])}")
    _require(m.attention != "local",
             "parallel.context > 1 with model.attention = 'local' is refused: megatron's local attention has no "
             "context parallelism; use model.attention = 'auto', 'sdpa' or 'te'")
    _require(m.attention_dropout == 0.0,
             f"parallel.context > 1 with model.attention_dropout = {m.attention_dropout} is refused: the dropout "
             "masks would differ from context 1's; use model.attention_dropout = 0")
    _require(not cfg.data.reset_attention_mask, "parallel.context > 1 with data.reset_attention_mask = true is not "
             "supported yet: the per-document masks are not split into context chunks; set it to false")
    _require(not cfg.zero.node_aware(), f"parallel.context > 1 with {NODE_AWARE_KEYS} is not supported yet: their "
             "node groups are built over the data-parallel ranks alone")


def _check_float8(cfg: Config) -> None:
    """precision.fp8's rules: bf16 training, megatron's local linears (not Transformer Engine's), and every
    dimension of the three GEMMs of each FP8 linear on a TP rank divisible by 16 (torch._scaled_mm on CUDA: the
    contraction and output dimensions; the tokens of a micro-batch are the weight gradient's contraction)."""
    m, p, fp8 = cfg.model, cfg.parallel, cfg.precision.fp8
    _require(fp8 == "tensorwise" or not cfg.zero.fp8_gather,
             f"zero.fp8_gather = true needs precision.fp8 = \"tensorwise\" (the gathered weight carries one scale), not "
             f"{fp8!r}; set precision.fp8 = \"tensorwise\" or zero.fp8_gather = false")
    if fp8 == "none":
        return
    _require(cfg.precision.dtype == "bf16", f"precision.fp8 = {fp8!r} needs precision.dtype = \"bf16\" (the float8 "
             f"GEMMs take and give bf16), not {cfg.precision.dtype!r}; set precision.dtype = \"bf16\" or "
             "precision.fp8 = \"none\"")
    _require(m.attention != "te", f"precision.fp8 = {fp8!r} with model.attention = 'te' is refused: the float8 "
             "linears are megatron's local layers, not Transformer Engine's; use model.attention = 'auto' or 'sdpa'")
    t, shape = p.tensor, m.shape
    dims = (("model.hidden_size", m.hidden_size), ("model.hidden_size / parallel.tensor", m.hidden_size // t),
            ("QKV width / parallel.tensor", (m.hidden_size + 2 * shape.kv_width) // t),
            ("model.ffn_hidden_size / parallel.tensor", m.ffn_size // t),
            ("tokens of a micro-batch (train.micro_batch_size × model.seq_length / parallel.context)",
             cfg.train.micro_batch_size * m.seq_length // p.context))
    for name, value in dims:
        _require(value % FLOAT8_ALIGNMENT == 0, f"precision.fp8 = {fp8!r} needs every dimension of its GEMMs divisible by "
                 f"{FLOAT8_ALIGNMENT} (torch._scaled_mm on CUDA), but {name} = {value} is not a multiple of "
                 f"{FLOAT8_ALIGNMENT}; choose sizes that are, or precision.fp8 = \"none\"")


def validate_layout(cfg: Config, world_size: int) -> int:
    """Returns the gradient-accumulation steps; raises if the layout does not divide."""
    p, t = cfg.parallel, cfg.train
    model_parallel = p.tensor * p.pipeline * p.context
    degrees = "parallel.tensor × parallel.pipeline" + (" × parallel.context" if p.context > 1 else "")
    _require(world_size % model_parallel == 0,
             f"world size {world_size} is not divisible by {degrees} = {model_parallel}; valid world sizes are "
             f"multiples of {model_parallel}")
    dp = world_size // model_parallel
    per_step = t.micro_batch_size * dp
    _require(t.global_batch_size % per_step == 0,
             f"train.global_batch_size = {t.global_batch_size} is not divisible by "
             f"train.micro_batch_size × data-parallel size = {t.micro_batch_size} × {dp} = {per_step}; "
             f"valid global batch sizes are multiples of {per_step}")
    return t.global_batch_size // per_step

