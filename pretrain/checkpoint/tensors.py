"""A rank's pieces of each parameter as global tensors: megatron ShardedTensors that DCP writes and reads.

Every parameter is one global tensor per state — "model/<key>" (model dtype), "optim/master/<key>" and
"optim/<state>/<key>" for each of the optimizer's states (in its state dtype, optim/'s OptimizerSpec.states) —
with the key, global shape and offsets of megatron's `model.sharded_state_dict()` (TP/PP-aware; decoder
layers stacked on a leading axis).
A rank's DP piece is a contiguous range of the flattened TP-local parameter; it is cut into the few
contiguous boxes that range covers, so any other layout can read any part of it back.
"""
import math
from collections import defaultdict
from dataclasses import dataclass

import torch
import megatron_patches.lean  # noqa: F401  (megatron-core without its unused torch.compile/wandb set-up)
from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory
from megatron.core.dist_checkpointing.strategies.checkpointable import (CheckpointableShardedTensor,
                                                                        LocalShardsContainer)

from pretrain.errors import CheckpointError

MODEL_PREFIX = "model/"  # the model-dtype parameters ("param"); every other state is "optim/<state>/"


def prefix(state: str) -> str:
    """The DCP key prefix of a state: "model/" for the parameters, "optim/<state>/" for the master and
    each optimizer state."""
    return MODEL_PREFIX if state == "param" else f"optim/{state}/"


def saved_states(saved_keys) -> list:
    """The "optim/<state>/" states (the master and the optimizer's) a checkpoint holds tensors of."""
    return sorted({key.split("/")[1] for key in saved_keys if key.startswith("optim/")})


def flat_range_boxes(shape: tuple, lo: int, hi: int) -> list[tuple[tuple, tuple]]:
    """Elements [lo, hi) of a row-major tensor of `shape` as [(offset, size)] boxes, in order; each box
    is itself a contiguous range, at most 2·ndim − 1 of them."""
    if lo >= hi:
        return []
    if len(shape) == 1:
        return [((lo,), (hi - lo,))]
    inner = math.prod(shape[1:])
    boxes = []
    if lo % inner:  # a partial first row
        row, end = lo // inner, min(hi, (lo // inner + 1) * inner)
        boxes += [((row, *o), (1, *s)) for o, s in flat_range_boxes(shape[1:], lo - row * inner, end - row * inner)]
        lo = end
    rows = hi // inner - lo // inner if lo < hi else 0
    if rows:  # whole rows
        boxes.append(((lo // inner,) + (0,) * (len(shape) - 1), (rows, *shape[1:])))
        lo += rows * inner
    if lo < hi:  # a partial last row
        row = lo // inner
        boxes += [((row, *o), (1, *s)) for o, s in flat_range_boxes(shape[1:], 0, hi - lo)]
    return boxes


def flat_index(shape: tuple, offset: tuple) -> int:
    index = 0
    for size, o in zip(shape, offset):
        index = index * size + o
    return index


def is_main_replica(replica_id) -> bool:
    """megatron's replica_id is (PP, TP, DP): a weight kept whole on several TP ranks (layer norms) or
    PP stages (a tied output layer) is written by the first of them. The DP coordinate is not used:
    each DP rank writes a different piece."""
    if isinstance(replica_id, int):
        return replica_id == 0
    return all(i == 0 for i in tuple(replica_id)[:-1])


@dataclass(frozen=True)
class Part:
    """Rows [row, row + sh.local_shape[0]) of a parameter's TP-local tensor and where megatron puts them globally."""

    row: int
    sh: ShardedTensor


def model_templates(model) -> dict:
    """{parameter name: [Part]} from megatron's `model.sharded_state_dict()`: a parameter's ShardedTensor (key,
    global shape and offset, replica id), or the ShardedTensors of its factory, each over the local rows it
    covers — SwiGLU's fc1 holds [gate; up] rows on each TP rank, which megatron stores as one global
    [gate of every rank; up of every rank] tensor, so a checkpoint reads back at any TP size."""
    out = {}
    for name, sh in model.sharded_state_dict().items():
        if isinstance(sh, ShardedTensor):
            out[name] = [Part(0, sh)]
        elif isinstance(sh, ShardedTensorFactory):
            parts, row = [], 0
            for built in sh.build():
                if not isinstance(built, ShardedTensor) or tuple(built.local_shape[1:]) != tuple(sh.data.shape[1:]):
                    raise CheckpointError(f"parameter {name!r}: megatron's sharded-state factory builds "
                                          f"{type(built).__name__} pieces this checkpoint cannot cut into rows")
                parts.append(Part(row, built))
                row += built.local_shape[0]
            if row != sh.data.shape[0]:
                raise CheckpointError(f"parameter {name!r}: megatron's factory covers {row} of its "
                                      f"{sh.data.shape[0]} local rows")
            out[name] = parts
    return out


def parameter_names(templates: dict) -> dict:
    """{checkpoint key: parameter name}, a stacked decoder layer's index left as "{layer}" (the
    global layer is the key's first offset): how the export names the tensors it unstacks."""
    out = {}
    for name, parts in templates.items():
        sh = parts[0].sh
        if not is_main_replica(sh.replica_id):
            continue
        if sh.prepend_axis_num:
            pieces = name.split(".")
            index = next(i for i, piece in enumerate(pieces) if piece.isdigit())
            name = ".".join(pieces[:index] + ["{layer}"] + pieces[index + 1:])
        out[sh.key] = name
    return out


def _piece_shards(key: str, part: Part, piece, tensor: torch.Tensor) -> list[ShardedTensor]:
    """The boxes of the piece's elements [lo, hi) (of the local tensor, `tensor` holding them) inside `part`."""
    sh, prepend = part.sh, part.sh.prepend_axis_num
    inner = math.prod(piece.shape[1:])
    start, end = part.row * inner, (part.row + sh.local_shape[0]) * inner
    lo, hi = max(piece.lo, start), min(piece.hi, end)
    out = []
    for offset, size in flat_range_boxes(tuple(sh.local_shape), lo - start, hi - start):
        first = start + flat_index(tuple(sh.local_shape), offset) - piece.lo
        data = tensor[first:first + math.prod(size)].view((1,) * prepend + tuple(size))
        global_offset = (*sh.global_offset[:prepend],
                         *(base + o for base, o in zip(sh.global_offset[prepend:], offset)))
        out.append(ShardedTensor(key=key, data=data, dtype=data.dtype, local_shape=tuple(data.shape),
                                 global_shape=tuple(sh.global_shape), global_offset=global_offset,
                                 axis_fragmentations=None, replica_id=0))
    return out


def sharded_state(pieces: list, templates: dict, states: tuple, writing: bool) -> dict:
    """DCP state dict over this rank's pieces: {key: CheckpointableShardedTensor | LocalShardsContainer}.

    Writing keeps only the main replica of weights megatron marks as replicated over TP/PP ranks;
    reading asks for every piece this rank holds.
    """
    shards = defaultdict(list)
    for piece in pieces:
        parts = templates.get(piece.name)
        if parts is None:
            raise CheckpointError(f"parameter {piece.name!r} is not in megatron's sharded_state_dict")
        local = (sum(p.sh.local_shape[0] for p in parts), *parts[0].sh.local_shape[1:])
        if local != tuple(piece.shape):
            raise CheckpointError(f"parameter {piece.name!r}: megatron's local shape {local} "
                                  f"differs from the engine's {tuple(piece.shape)}")
        if writing and not is_main_replica(parts[0].sh.replica_id):
            continue
        for state in (s for s in states if s in piece.tensors):  # a kind of group keeps its own states
            for part in parts:
                shards[prefix(state) + part.sh.key] += _piece_shards(prefix(state) + part.sh.key, part, piece,
                                                                     piece.tensors[state])
    return {key: (CheckpointableShardedTensor.from_sh_ten(s[0]) if len(s) == 1 else
                  LocalShardsContainer([CheckpointableShardedTensor.from_sh_ten(x) for x in s]))
            for key, s in shards.items()}


def global_shapes(templates: dict, states: tuple) -> dict:
    """{DCP key: global shape} of every tensor a sharded_state() over these templates can hold."""
    return {prefix(state) + part.sh.key: tuple(part.sh.global_shape) for parts in templates.values()
            for part in parts for state in states}
