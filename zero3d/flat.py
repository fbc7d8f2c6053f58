"""The flat-buffer layer every stage shares: parameter groups packed into bucket-sharded, padded buffers."""
import fnmatch
from dataclasses import dataclass

import torch
import torch.nn as nn


@dataclass(frozen=True)
class ParamSlot:
    """Where one parameter lives in its group's flat buffer."""

    name: str
    shape: tuple
    start: int  # offset in the flat buffer
    numel: int
    tp_partitioned: bool  # Megatron `tensor_model_parallel`: each TP rank holds a different slice
    partition_dim: int = 0  # the dimension TP splits it along (megatron's `partition_dim`: 0 column-, 1 row-parallel)

    @property
    def end(self) -> int:
        return self.start + self.numel


@dataclass(frozen=True)
class Bucket:
    """A contiguous, padded range of a flat buffer, communicated as one unit (CB)."""

    index: int  # 0 = the bucket whose gradients backward produces first
    start: int  # a multiple of dp_size: every bucket before it is padded
    end: int  # padded end
    slot_indices: tuple  # slots whose elements lie in this range
    dp_size: int

    @property
    def numel(self) -> int:
        return self.end - self.start

    @property
    def piece_numel(self) -> int:
        """Elements of this bucket each DP rank owns."""
        return self.numel // self.dp_size

    @property
    def shard_start(self) -> int:
        """Where this bucket's piece begins in every rank's shard."""
        return self.start // self.dp_size

    def piece(self, dp_rank: int) -> tuple[int, int]:
        """This rank's piece, in flat coordinates."""
        lo = self.start + dp_rank * self.piece_numel
        return lo, lo + self.piece_numel


class FlatLayout:
    """Parameters of one group packed in buckets of about `bucket_elements`, each padded to N_d."""

    def __init__(self, named_params: list[tuple[str, nn.Parameter]], dp_size: int, bucket_elements: int):
        if not named_params:
            raise ValueError("a flat layout needs at least one parameter")
        if dp_size < 1 or bucket_elements < 1:
            raise ValueError(f"dp_size = {dp_size} and bucket_elements = {bucket_elements} must be >= 1")
        self.dp_size = dp_size
        numels = [p.numel() for _, p in named_params]
        members = bucket_members(numels, bucket_elements)
        starts, offset = [0] * len(numels), 0
        spans = {}
        for index in reversed(range(len(members))):  # buffer order: the first parameters first
            begin = offset
            for i in sorted(members[index]):
                starts[i] = offset
                offset += numels[i]
            offset = begin + -(-(offset - begin) // dp_size) * dp_size
            spans[index] = (begin, offset)
        self.slots: list[ParamSlot] = [
            ParamSlot(name, tuple(p.shape), starts[i], numels[i], bool(getattr(p, "tensor_model_parallel", False)),
                      int(getattr(p, "partition_dim", 0)))
            for i, (name, p) in enumerate(named_params)]
        self.buckets: list[Bucket] = [Bucket(index, *spans[index], tuple(members[index]), dp_size)
                                      for index in range(len(members))]
        self.numel = sum(numels)
        self.padded_numel = offset
        self.shard_numel = offset // dp_size

    @property
    def padding(self) -> int:
        """Elements added so that every bucket divides evenly over the DP ranks (< N_d per bucket)."""
        return self.padded_numel - self.numel

    def pieces(self, dp_rank: int) -> list[tuple[Bucket, int, int]]:
        """[(bucket, flat_lo, flat_hi)] for this rank, in shard order."""
        return [(bucket, *bucket.piece(dp_rank)) for bucket in sorted(self.buckets, key=lambda b: b.start)]

    def owned_slot_ranges(self, dp_rank: int) -> list[tuple[ParamSlot, int, int, int]]:
        """[(slot, flat_lo, flat_hi, shard_lo)]: the part of each slot this rank owns (one range at most)."""
        out = []
        for bucket, lo, hi in self.pieces(dp_rank):
            for i in sorted(bucket.slot_indices):
                slot = self.slots[i]
                part_lo, part_hi = max(slot.start, lo), min(slot.end, hi)
                if part_lo < part_hi:
                    out.append((slot, part_lo, part_hi, bucket.shard_start + part_lo - lo))
        return out

    def slots_in_shard(self, dp_rank: int) -> list[tuple[ParamSlot, int, int]]:
        """[(slot, lo, hi)]: the part of each slot inside this rank's shard, in shard coordinates.

        The contract: at most one contiguous range per slot; element j of it is element
        `flat_lo - slot.start + j` of the flattened parameter (`owned_slot_ranges` gives flat_lo)."""
        return [(slot, shard_lo, shard_lo + flat_hi - flat_lo)
                for slot, flat_lo, flat_hi, shard_lo in self.owned_slot_ranges(dp_rank)]

    def shard_of(self, flat: torch.Tensor, dp_rank: int) -> torch.Tensor:
        """This rank's shard of a full flat buffer: its pieces concatenated (a new tensor)."""
        return torch.cat([flat[lo:hi] for _, lo, hi in self.pieces(dp_rank)])


def bucket_members(numels: list[int], bucket_elements: int) -> list[list[int]]:
    """Parameter indices per bucket, walking the parameters backwards (the order backward produces them).

    A bucket closes once it holds >= bucket_elements; a parameter larger than that is a bucket of
    its own, so the largest bucket is max(bucket_elements, largest parameter) plus < N_d padding.
    """
    buckets, current, size = [], [], 0
    for i in reversed(range(len(numels))):
        current.append(i)
        size += numels[i]
        if size >= bucket_elements:
            buckets.append(current)
            current, size = [], 0
    if current:
        buckets.append(current)
    return buckets


def group_kind(decays: bool, matrix: bool = False) -> str:
    """A group's name part for its kind: "decay" / "no_decay", "matrix" / "matrix_no_decay" for the parameters the
    optimizer takes whole (Muon's hidden matrices: their own states, so their own groups)."""
    if matrix:
        return "matrix" if decays else "matrix_no_decay"
    return "decay" if decays else "no_decay"


def param_groups(model: nn.Module, no_decay: tuple = (), takes_whole=None) -> dict[tuple, list[tuple[str, nn.Parameter]]]:
    """Trainable parameters by kind, {(decays, matrix): [(name, param)]}: matrices decay, biases and norms do not,
    nor any parameter whose name matches a `no_decay` fnmatch pattern (optimizer.no_weight_decay); `matrix`: the
    optimizer takes it whole (`takes_whole(name, shape)`, its spec's matrix rule; None: none)."""
    groups: dict = {}
    for name, p in model.named_parameters():  # deduplicated: tied weights appear once
        if p.requires_grad:
            decays = p.dim() > 1 and not any(fnmatch.fnmatchcase(name, pattern) for pattern in no_decay)
            matrix = takes_whole is not None and takes_whole(name, tuple(p.shape))
            groups.setdefault((decays, matrix), []).append((name, p))
    dtypes = {p.dtype for ps in groups.values() for _, p in ps}
    if len(dtypes) > 1:
        raise ValueError(f"zero3d needs one parameter dtype per model, found {sorted(map(str, dtypes))}")
    return dict(sorted(groups.items(), key=lambda item: (item[0][1], not item[0][0])))


def view_params_into(buffer: torch.Tensor, layout: FlatLayout, params: list[nn.Parameter]) -> None:
    """Copy each parameter into the buffer and make it a view of its slot (MD: one allocation)."""
    for slot, p in zip(layout.slots, params):
        view = buffer[slot.start:slot.end].view(slot.shape)
        view.copy_(p.data)
        p.data = view


def flatten_params(layout: FlatLayout, params: list, dtype, device) -> torch.Tensor:
    """One padded model-dtype buffer holding every parameter of the group; params become views."""
    buffer = torch.zeros(layout.padded_numel, dtype=dtype, device=device)
    view_params_into(buffer, layout, params)
    return buffer


def flatten_grads(layout: FlatLayout, params: list, dtype, device) -> torch.Tensor:
    """One padded gradient buffer; each `param.grad` is a view, so autograd accumulates in place."""
    buffer = torch.zeros(layout.padded_numel, dtype=dtype, device=device)
    for slot, p in zip(layout.slots, params):
        p.grad = buffer[slot.start:slot.end].view(slot.shape)
    return buffer
