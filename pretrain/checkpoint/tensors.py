"""A rank's pieces of each parameter as global tensors: megatron ShardedTensors that DCP writes and reads.

Every parameter is one global tensor per state — "model/<key>" (model dtype), "optim/master/<key>",
"optim/exp_avg/<key>", "optim/exp_avg_sq/<key>" (fp32) — with the key, global shape and offsets of
megatron's `model.sharded_state_dict()` (TP/PP-aware; decoder layers stacked on a leading axis).
A rank's DP piece is a contiguous range of the flattened TP-local parameter; it is cut into the few
contiguous boxes that range covers, so any other layout can read any part of it back.
"""
import math
from collections import defaultdict

import torch
import megatron_patches.lean  # noqa: F401  (megatron-core without its unused torch.compile/wandb set-up)
from megatron.core.dist_checkpointing.mapping import ShardedTensor
from megatron.core.dist_checkpointing.strategies.checkpointable import (CheckpointableShardedTensor,
                                                                        LocalShardsContainer)

from pretrain.checkpoint.files import CheckpointError

PREFIXES = {"param": "model/", "master": "optim/master/", "exp_avg": "optim/exp_avg/",
            "exp_avg_sq": "optim/exp_avg_sq/"}
TRAINING_STATES = ("master", "exp_avg", "exp_avg_sq")  # what a resume loads; parameters follow from master


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


def model_templates(model) -> dict:
    """{parameter name: megatron ShardedTensor} (key, global shape and offset, replica id)."""
    return {name: sh for name, sh in model.sharded_state_dict().items() if isinstance(sh, ShardedTensor)}


def parameter_names(templates: dict) -> dict:
    """{checkpoint key: parameter name}, a stacked decoder layer's index left as "{layer}" (the
    global layer is the key's first offset): how the export names the tensors it unstacks."""
    out = {}
    for name, sh in templates.items():
        if not is_main_replica(sh.replica_id):
            continue
        if sh.prepend_axis_num:
            parts = name.split(".")
            index = next(i for i, part in enumerate(parts) if part.isdigit())
            name = ".".join(parts[:index] + ["{layer}"] + parts[index + 1:])
        out[sh.key] = name
    return out


def _piece_shards(key: str, sh: ShardedTensor, piece, tensor: torch.Tensor) -> list[ShardedTensor]:
    prepend = sh.prepend_axis_num
    out = []
    for offset, size in flat_range_boxes(piece.shape, piece.lo, piece.hi):
        start = flat_index(piece.shape, offset) - piece.lo
        data = tensor[start:start + math.prod(size)].view((1,) * prepend + tuple(size))
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
        sh = templates.get(piece.name)
        if sh is None:
            raise CheckpointError(f"parameter {piece.name!r} is not in megatron's sharded_state_dict")
        if tuple(sh.local_shape) != tuple(piece.shape):
            raise CheckpointError(f"parameter {piece.name!r}: megatron's local shape {tuple(sh.local_shape)} "
                                  f"differs from the engine's {tuple(piece.shape)}")
        if writing and not is_main_replica(sh.replica_id):
            continue
        for state in states:
            key = PREFIXES[state] + sh.key
            shards[key] += _piece_shards(key, sh, piece, piece.tensors[state])
    return {key: (CheckpointableShardedTensor.from_sh_ten(s[0]) if len(s) == 1 else
                  LocalShardsContainer([CheckpointableShardedTensor.from_sh_ten(x) for x in s]))
            for key, s in shards.items()}



def global_shapes(templates: dict, states: tuple) -> dict:
    """{DCP key: global shape} of every tensor a sharded_state() over these templates can hold."""
    return {PREFIXES[state] + sh.key: tuple(sh.global_shape) for sh in templates.values() for state in states}
