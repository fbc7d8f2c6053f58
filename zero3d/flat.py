"""The flat-buffer layer every stage shares: parameter groups laid out in padded, DP-sharded buffers."""
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

    @property
    def end(self) -> int:
        return self.start + self.numel


@dataclass(frozen=True)
class Bucket:
    """A contiguous range of a flat buffer, communicated as one unit (CB)."""

    index: int
    start: int
    end: int
    slot_indices: tuple  # slots whose elements lie in this range

    @property
    def numel(self) -> int:
        return self.end - self.start


class FlatLayout:
    """Parameters of one group, packed end to end and padded to a multiple of the DP size.

    DP rank r owns the contiguous shard [r·S, (r+1)·S), S = padded_numel / dp_size.
    """

    def __init__(self, named_params: list[tuple[str, nn.Parameter]], dp_size: int):
        self.dp_size = dp_size
        slots, offset = [], 0
        for name, p in named_params:
            slots.append(ParamSlot(name, tuple(p.shape), offset, p.numel(),
                                   bool(getattr(p, "tensor_model_parallel", False))))
            offset += p.numel()
        self.slots: list[ParamSlot] = slots
        self.numel = offset
        self.padded_numel = -(-offset // dp_size) * dp_size if offset else dp_size
        self.shard_numel = self.padded_numel // dp_size

    def shard_range(self, dp_rank: int) -> tuple[int, int]:
        return dp_rank * self.shard_numel, (dp_rank + 1) * self.shard_numel

    def owner_ranges(self, start: int, end: int) -> list[tuple[int, int, int]]:
        """Split [start, end) by owner: [(owner_rank, lo, hi)] in flat coordinates."""
        out = []
        lo = start
        while lo < end:
            owner = lo // self.shard_numel
            hi = min(end, (owner + 1) * self.shard_numel)
            out.append((owner, lo, hi))
            lo = hi
        return out

    def slots_in_shard(self, dp_rank: int) -> list[tuple[ParamSlot, int, int]]:
        """[(slot, lo, hi)]: the part of each slot inside this rank's shard, in shard coordinates."""
        s0, s1 = self.shard_range(dp_rank)
        out = []
        for slot in self.slots:
            lo, hi = max(slot.start, s0), min(slot.end, s1)
            if lo < hi:
                out.append((slot, lo - s0, hi - s0))
        return out

    def buckets(self, bucket_elements: int) -> list[Bucket]:
        """Buckets of whole parameters in reverse layout order (the order backward produces them).

        A bucket closes once it holds >= bucket_elements; a parameter larger than that is a bucket
        of its own, so the largest bucket is max(bucket_elements, largest parameter). The padding
        tail belongs to the first bucket.
        """
        buckets, current, end = [], [], self.padded_numel
        for i in reversed(range(len(self.slots))):
            current.append(i)
            size = end - self.slots[i].start
            if size >= bucket_elements:
                buckets.append(Bucket(len(buckets), self.slots[i].start, end, tuple(current)))
                current, end = [], self.slots[i].start
        if current:
            buckets.append(Bucket(len(buckets), 0, end, tuple(current)))
        return buckets


def param_groups(model: nn.Module) -> dict[str, list[tuple[str, nn.Parameter]]]:
    """Trainable parameters split by weight decay: matrices decay, biases and norms do not."""
    groups: dict[str, list] = {"decay": [], "no_decay": []}
    for name, p in model.named_parameters():  # deduplicated: tied weights appear once
        if p.requires_grad:
            groups["decay" if p.dim() > 1 else "no_decay"].append((name, p))
    dtypes = {p.dtype for ps in groups.values() for _, p in ps}
    if len(dtypes) > 1:
        raise ValueError(f"zero3d needs one parameter dtype per model, found {sorted(map(str, dtypes))}")
    return {k: v for k, v in groups.items() if v}


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
