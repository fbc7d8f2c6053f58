"""Decisions all ranks take together: rank 0's value handed to every rank, a flag raised anywhere raised everywhere."""
import torch
import torch.distributed as dist


def from_rank0(fn):
    """Run fn on rank 0 alone and hand its result (or its error, raised everywhere) to every rank."""
    outcome = None
    if dist.get_rank() == 0:
        try:
            outcome = ("ok", fn())
        except Exception as err:  # noqa: BLE001 - re-raised on every rank below
            outcome = ("error", err)
    box = [outcome]
    dist.broadcast_object_list(box, src=0)
    status, value = box[0]
    if status == "error":
        raise value
    return value


def agree(topo, *flags: bool) -> list[bool]:
    """Each flag true on any rank is true on every rank (one all-reduce on `topo.device` for all of them)."""
    values = torch.tensor([float(f) for f in flags], device=topo.device)
    dist.all_reduce(values, op=dist.ReduceOp.MAX)
    return [bool(v) for v in values.tolist()]
