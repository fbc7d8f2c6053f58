"""Decisions all ranks take together: rank 0's value handed to every rank, a flag raised anywhere raised everywhere."""
import torch
import torch.distributed as dist


def rank0_value(value):
    """Rank 0's value on every rank; the other ranks' own `value` is ignored."""
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def on_main_then_share(topo, fn):
    """Run fn on rank 0 (`topo.is_main`) and hand its result (or its error, raised everywhere) to every rank."""
    outcome = None
    if topo.is_main:
        try:
            outcome = ("ok", fn())
        except Exception as err:  # noqa: BLE001 - re-raised on every rank below
            outcome = ("error", err)
    status, value = rank0_value(outcome)
    if status == "error":
        raise value
    return value


def agree(topo, *flags: bool) -> list[bool]:
    """Each flag true on any rank is true on every rank (one all-reduce on `topo.device` for all of them)."""
    values = torch.tensor([float(f) for f in flags], device=topo.device)
    dist.all_reduce(values, op=dist.ReduceOp.MAX)
    return [bool(v) for v in values.tolist()]
