"""Shared test body: a few training steps of a tiny megatron GPTModel under zero3d, on synthetic tokens."""
import zlib

import torch
import torch.distributed as dist

import zero3d
from pretrain.config import load_config
from pretrain.model.gpt import activation_checkpointing, build_model, parallel_groups, record_context_into
from pretrain.runtime.layout import init_layout
from pretrain.step import forward_backward, mean_loss
from pretrain.train import Batches, engine_settings

# Steps of every run compared across stages and layouts through the dist tier's cache (tests/dist/conftest.py's
# gpt_run): test_zero, test_stage3, test_offload and test_comm_accumulation train the same runs once between them.
REFERENCE_STEPS = 8
BUCKET_ELEMENTS = 4000  # zero.bucket_elements of every run unless overridden
BASE = ["model.num_layers=2", "model.hidden_size=32", "model.num_attention_heads=4", "model.seq_length=16",
        "model.vocab_size=128", "train.micro_batch_size=2", "train.global_batch_size=8",
        "optimizer.warmup_steps=0", "optimizer.lr=1e-3", "optimizer.min_lr=1e-3", "logging.wandb=false",
        f"zero.bucket_elements={BUCKET_ELEMENTS}"]


class Unwrapped:
    """The engine's interface to the loop over the bare model: plain autograd (the reference runs
    of tests that train a model without zero3d through pretrain's own step)."""

    def __init__(self, model):
        self.model = model

    def __call__(self, *args, **kwargs):
        return self.model(*args, **kwargs)

    def backward(self, loss):
        loss.backward()


class SyntheticTokens:
    """Sample i is a fixed token block (same on every rank, any layout): an arithmetic progression
    mod vocab with a random start and stride, so there is something to learn."""

    def __init__(self, vocab: int, seq_length: int):
        self.vocab, self.seq_length = vocab, seq_length

    def sample(self, i: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(1000 + i)
        start, stride = torch.randint(0, self.vocab, (2,), generator=g).tolist()
        return (start + (stride % 7 + 1) * torch.arange(self.seq_length + 1)) % self.vocab


def init_by_global_name(model) -> None:
    """Draw every weight matrix as a slice of one global tensor seeded by its checkpoint key (megatron's
    sharded_state_dict: global shape and offsets, so any TP size and pipeline split of the model starts from
    the same weights; a SwiGLU fc1 from its [gate; up] halves, a tied output layer as the word embedding);
    norm weights 1, biases 0."""
    from pretrain.checkpoint.tensors import model_templates
    params = dict(model.named_parameters())
    for name, parts in model_templates(model).items():
        p = params[name]
        with torch.no_grad():
            if p.dim() <= 1:
                p.fill_(1.0 if "layernorm.weight" in name else 0.0)
                continue
            for part in parts:
                sh = part.sh
                g = torch.Generator().manual_seed(zlib.crc32(sh.key.encode()))
                full = 0.02 * torch.randn(tuple(sh.global_shape), generator=g)
                shape = (1,) * sh.prepend_axis_num + tuple(sh.local_shape)
                box = full[tuple(slice(o, o + n) for o, n in zip(sh.global_offset, shape))]
                p[part.row:part.row + sh.local_shape[0]].copy_(box.reshape(sh.local_shape))
    missing = set(params) - set(model_templates(model))
    assert not missing, f"parameters outside megatron's sharded_state_dict: {sorted(missing)}"


def run_gpt_steps(rank, world_size, overrides, steps, inject_inf_at=None, layout_free_init=False, dataset=None):
    """Train `steps` steps (on `dataset`'s samples, else SyntheticTokens); returns losses, grad norms, skips, final
    TP-local params, bytes, comm."""
    cfg = load_config(None, BASE + list(overrides))
    topo = init_layout(cfg)
    activations = activation_checkpointing(cfg.zero, topo.tp_group)
    model = build_model(cfg, topo.device, activations)
    if layout_free_init:
        init_by_global_name(model)
    if cfg.train.init_from:  # as pretrain.train does: the HF weights, before the engine takes them
        from pathlib import Path

        from pretrain.checkpoint.hf import ImportedModel, load_into
        load_into(model, ImportedModel(Path(cfg.train.init_from)))
    # Counted before wrapping: stage 3 frees the parameters' own storage.
    psi = sum(p.numel() for p in model.parameters())
    # Group sizes straight from the model (matrices decay, vectors do not), for the byte formulas.
    group_numels = {"decay": sum(p.numel() for p in model.parameters() if p.dim() > 1),
                    "no_decay": sum(p.numel() for p in model.parameters() if p.dim() <= 1)}
    param_numels = named_numels(model)  # for the bucketing rule written out in the tests (buckets_by_rule)
    engine = zero3d.wrap_model(model, engine_settings(cfg), parallel_groups(model, topo))
    if activations is not None:
        activations.record_into(engine.comm_stats)
    record_context_into(model, engine.comm_stats)
    dataset = dataset or SyntheticTokens(cfg.model.vocab_size, cfg.model.seq_length)
    batches = Batches(dataset, cfg.train, cfg.data, topo)
    out = {"loss": [], "grad_norm": [], "skipped": [], "loss_scale": [], "comm": [], "comm_bytes": [], "comm_elements": [],
           "param_checksum": [], "params_init": {n: p.detach().float().clone() for n, p in full_params(engine).items()}}
    for step in range(steps):
        engine.comm_stats.reset()
        losses = forward_backward(engine, batches, step, cfg, topo)
        if inject_inf_at is not None and step == inject_inf_at[0] and topo.rank == inject_inf_at[1]:
            poison_gradients(engine)
        result = engine.step(cfg.optimizer.lr)
        out["loss"].append(mean_loss(losses, topo))
        out["grad_norm"].append(result.grad_norm)
        out["skipped"].append(result.skipped)
        out["loss_scale"].append(result.loss_scale)
        out["comm"].append(engine.comm_stats.report())
        out["comm_bytes"].append(dict(engine.comm_stats.bytes))  # {(collective, purpose): exact Fraction}
        out["comm_elements"].append(engine.comm_stats.total(("grads", "params")))
        out["param_checksum"].append(sum(p.double().sum().item() for p in full_params(engine).values()))
    out["params"] = {n: p.detach().float().clone() for n, p in full_params(engine).items()}
    out["state_bytes"] = engine.state_bytes()
    out["tp_rank"], out["pp_rank"], out["dp_rank"] = topo.tp_rank, topo.pp_rank, topo.dp_rank
    out["psi"], out["group_numels"] = psi, group_numels
    out["value_bytes"] = next(iter(engine.groups.values())).param_flat.element_size()  # b: model-dtype bytes
    # Flat buffer sizes with each bucket padded to a multiple of N_d, and buckets per group.
    out["padded_numels"] = {name: g.layout.padded_numel for name, g in engine.groups.items()}
    out["buckets"] = {name: len(g.layout.buckets) for name, g in engine.groups.items()}
    out["bucket_numels"], out["param_numels"] = raw_bucket_numels(engine), param_numels
    out["decaying"] = sorted(slot.name for g in engine.groups.values() if g.decays for slot in g.layout.slots)
    out["activations"] = activations.report() if activations else {}
    # the optimizer's whole matrices (Muon): (name, owner DP rank or -1, each DP rank's (lo, hi, at) or None, numel, TP-split)
    whole = engine.whole_matrices
    out["whole_matrices"] = [(m.slot.name, m.owner, m.parts, m.slot.numel, m.slot.tp_partitioned)
                             for m in whole.matrices] if whole else []
    from megatron.core import parallel_state
    # megatron's gloo copy of each DP group (a full TCP mesh at start-up, a polling thread a rank): never read here
    out["megatron_gloo_dp_group"] = parallel_state._DATA_PARALLEL_GROUP_GLOO is not None
    dist.barrier()
    return out


def named_numels(model) -> list[tuple[str, int, bool]]:
    """(name, numel, decays) of each parameter in model order, counted before wrapping (stage 3 empties them);
    decays: a matrix (the tests' models set no optimizer.no_weight_decay patterns)."""
    return [(name, p.numel(), p.dim() > 1) for name, p in model.named_parameters()]


def raw_bucket_numels(engine) -> dict:
    """{group: [elements of bucket 0, 1, …]}: each bucket's parameters as the engine laid them out, unpadded."""
    return {name: [sum(g.layout.slots[i].numel for i in bucket.slot_indices) for bucket in g.layout.buckets]
            for name, g in engine.groups.items()}


def stage3_unit(name: str) -> str:
    """The stage 3 gather unit owning a GPTModel parameter (pretrain/model/gpt.py's gather_units: the embedding,
    each transformer layer, the output layer; any other parameter, such as the final layer norm's, in a unit
    of the module holding it)."""
    parts = name.split(".")
    if parts[0] in ("embedding", "output_layer"):
        return parts[0]
    if parts[:2] == ["decoder", "layers"]:
        return ".".join(parts[:3])
    return name.rpartition(".")[0]


def buckets_by_rule(params: list, stage: int, bucket_elements: int, threshold: int = 0) -> dict:
    """{group: [elements of bucket 0, 1, …]} by zero3d/flat.py's documented rule, written out here from the
    parameters' sizes in model order (`named_numels`): stages 0-2 one group per weight-decay class; stage 3 one
    per (gather unit, class), parameters of at most `threshold` elements in the replicated "persistent/<class>"
    groups. Within a group, walking its parameters backwards, a bucket closes once it holds >= bucket_elements
    (bucket 0: the last parameters), so a bucket never spans two gather units."""
    groups: dict = {}
    for name, numel, decays in params:
        kind = "decay" if decays else "no_decay"
        group = kind if stage < 3 else f"persistent/{kind}" if numel <= threshold else f"{stage3_unit(name)}/{kind}"
        groups.setdefault(group, []).append(numel)
    out = {}
    for group, numels in groups.items():
        sizes, size = [], 0
        for numel in reversed(numels):
            size += numel
            if size >= bucket_elements:
                sizes.append(size)
                size = 0
        out[group] = sizes + ([size] if size else [])
    return out


def padded_numel(sizes: list, n: int) -> int:
    """Elements of a flat buffer whose buckets hold `sizes` elements, each padded to a multiple of n ranks."""
    return sum(-(-size // n) * n for size in sizes)


def assert_bucket_layout(rank_out, stage: int, n: int, bucket_elements: int = BUCKET_ELEMENTS,
                         threshold: int = 0) -> int:
    """A rank's flat buffers as zero3d/flat.py documents them: each group's buckets are the rule's
    (buckets_by_rule, from the model's parameter sizes), hold every parameter once (Ψ in all), and are each
    padded to a multiple of the n ranks they are sharded over: the group's buffer is Σ ceil(bucket / n)·n
    elements. Returns Ψ padded: the Ψ of the byte and volume formulas."""
    rule = buckets_by_rule(rank_out["param_numels"], stage, bucket_elements, threshold)
    assert rank_out["bucket_numels"] == rule, (rank_out["bucket_numels"], rule)
    assert sum(map(sum, rule.values())) == rank_out["psi"], (rule, rank_out["psi"])
    expected = {group: padded_numel(sizes, n) for group, sizes in rule.items()}
    assert rank_out["padded_numels"] == expected, (rank_out["padded_numels"], expected)
    return sum(expected.values())


def full_params(engine):
    """TP-local parameters as the model sees them (stage 3 gathers them for inspection)."""
    gather = getattr(engine, "gathered_parameters", None)
    engine.finish_param_sync()  # stages 1/2 leave the parameter all-gathers in flight after step()
    return gather() if gather else dict(engine.model.named_parameters())


def poison_gradients(engine):
    """Put an inf in this rank's local gradient storage (whatever the stage keeps)."""
    engine.grad_shard(next(iter(engine.groups.values()))).view(-1)[0] = float("inf")


def assert_close_runs(ref: list, out: list, rtol: float) -> None:
    """Two runs' per-rank results agree: losses and gradient norms (relative), parameters (rtol = atol)."""
    for r_ref, r_out in zip(ref, out):
        torch.testing.assert_close(torch.tensor(r_out["loss"]), torch.tensor(r_ref["loss"]), rtol=rtol, atol=0)
        torch.testing.assert_close(torch.tensor(r_out["grad_norm"]), torch.tensor(r_ref["grad_norm"]),
                                   rtol=rtol, atol=0)
        assert r_out["params"].keys() == r_ref["params"].keys()
        for name, p in r_ref["params"].items():
            torch.testing.assert_close(r_out["params"][name], p, rtol=rtol, atol=rtol, msg=name)
