"""Decisions all ranks take together: rank 0's value (or its error) handed to every rank."""
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
