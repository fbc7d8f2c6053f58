"""Stage 3's float8 parameter gather (zero.fp8_gather): FP8 linear weights all-gathered as e4m3 codes and scales."""
import torch

from zero3d.float8 import E4M3, FLOAT8_GATHERED, FLOAT8_WEIGHT, Float8Weight, cast, scale_from_amax
from zero3d.flat import FlatLayout


def is_float8_weight(param) -> bool:
    return bool(getattr(param, FLOAT8_WEIGHT, False))


class Float8Group:
    """One stage 3 group whose every parameter is an FP8 linear weight: its slots' ranges in this rank's shard."""

    def __init__(self, layout: FlatLayout, rank: int):
        index = {slot.name: i for i, slot in enumerate(layout.slots)}
        self.layout = layout
        self.ranges = [(index[slot.name], lo, hi) for slot, lo, hi in layout.slots_in_shard(rank)]

    def shard_amax(self, shard: torch.Tensor) -> torch.Tensor:
        """fp32 [weights]: the amax of each weight's elements in this rank's shard; 0 for weights it holds none of."""
        amax = torch.zeros(len(self.layout.slots), dtype=torch.float32, device=shard.device)
        for i, lo, hi in self.ranges:
            amax[i] = torch.linalg.vector_norm(shard[lo:hi], ord=float("inf")).float()
        return amax

    def cast_shard(self, shard: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
        """The shard's e4m3 codes, each weight's elements cast with its scale; padding stays 0."""
        codes = torch.zeros(shard.numel(), dtype=E4M3, device=shard.device)
        for i, lo, hi in self.ranges:
            codes[lo:hi] = cast(shard[lo:hi], E4M3, scales[i])
        return codes

    def gather(self, plan, shard: torch.Tensor, phase: str, params: list, keep_alive: list,
               stream=None) -> tuple[torch.Tensor, list]:
        """(full codes, handles): the amaxes reduced, the shard cast, every bucket's codes all-gathered through the
        plan (in flight: wait on the handles before reading) and attached to `params` (`attach`); the cast shard is
        appended to `keep_alive`, which must outlive the handles. `stream`: a side CUDA stream to issue it all on,
        as stage 3's plain gathers (the current stream waits for it when a gather ran synchronously: one rank)."""
        if stream is None:
            full, scales, handles = self._issue(plan, shard, phase, keep_alive)
        else:
            stream.wait_stream(torch.cuda.current_stream(shard.device))
            with torch.cuda.stream(stream):
                full, scales, handles = self._issue(plan, shard, phase, keep_alive)
            if any(handle is None for handle in handles):
                torch.cuda.current_stream(shard.device).wait_stream(stream)
        self.attach(params, full, scales)
        return full, handles

    def _issue(self, plan, shard, phase, keep_alive):
        amax = self.shard_amax(shard)
        plan.reduce_float8_amax(amax)
        scales = scale_from_amax(amax, E4M3)
        codes = self.cast_shard(shard, scales)
        keep_alive.append(codes)
        full = torch.empty(self.layout.padded_numel, dtype=E4M3, device=shard.device)
        handles = [plan.gather_float8(full[b.start:b.end], codes[b.shard_start:b.shard_start + b.piece_numel], phase)
                   for b in self.layout.buckets]
        return full, scales, handles

    def attach(self, params: list, full: torch.Tensor, scales: torch.Tensor) -> None:
        """Each weight: an empty NaN placeholder of its shape as its data, its gathered codes and scale beside."""
        nan = torch.full((), float("nan"), dtype=params[0].dtype, device=full.device)
        for i, (slot, p) in enumerate(zip(self.layout.slots, params)):
            p.data = nan.expand(slot.shape)
            setattr(p, FLOAT8_GATHERED, Float8Weight(full[slot.start:slot.end].view(slot.shape), scales[i]))

    @staticmethod
    def detach(params: list) -> None:
        for p in params:
            setattr(p, FLOAT8_GATHERED, None)
