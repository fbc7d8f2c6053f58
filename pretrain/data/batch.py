"""A micro-batch: its [b, seq+1] token block, with document boundaries a dict of it and megatron's per-sample fields.

Without data.reset_position_ids / reset_attention_mask / eod_mask_loss a micro-batch is the token block itself.
With any of them it is {"tokens": the block, and the fields those keys change (DataConfig.document_fields)}:
"position_ids" [b, s] restarting after each end-of-document token, "attention_mask" [b, 1, s, s] bool
block-causal (True = masked out, megatron's convention), "loss_mask" [b, s] float (0 where the input token
is the end-of-document token). megatron-core's GPTDataset builds them (pretrain/data/datasets.py).
"""
from typing import Optional, Union

import torch
import torch.distributed as dist

Batch = Union[torch.Tensor, dict]


def collate(samples: list) -> Batch:
    """The micro-batch of a list of samples (token blocks, or dicts of them and their fields)."""
    return torch.utils.data.default_collate(samples)


def to_device(batch: Batch, device: torch.device, non_blocking: bool = False) -> Batch:
    if isinstance(batch, dict):
        return {key: value.to(device, non_blocking=non_blocking) for key, value in batch.items()}
    return batch.to(device, non_blocking=non_blocking)


def tokens_of(batch: Batch) -> torch.Tensor:
    """The [b, seq+1] token block."""
    return batch["tokens"] if isinstance(batch, dict) else batch


def field(batch: Batch, name: str) -> Optional[torch.Tensor]:
    """A per-sample field of the micro-batch, or None when the run's keys do not carry it."""
    return batch.get(name) if isinstance(batch, dict) else None


def loss_tokens(micro_batches: list, dp_group) -> Optional[torch.Tensor]:
    """With loss masks (data.eod_mask_loss): the mean count of unmasked tokens per micro-batch over this step's
    micro-batches and every DP rank (one all-reduce, no host read); None without loss masks.

    Each micro-batch's loss is then its masked loss sum ÷ this count: the step's losses are averaged over
    micro-batches and DP ranks as ever (÷ accumulation in backward, the engine's DP mean), which makes the loss,
    and so its gradient, exactly the mean over every unmasked token of the global batch."""
    masks = [field(batch, "loss_mask") for batch in micro_batches]
    if not masks or masks[0] is None:
        return None
    count = torch.stack([mask.sum(dtype=torch.float64) for mask in masks]).sum().reshape(1)
    ranks = 1
    if dp_group is not None and dist.get_world_size(dp_group) > 1:
        dist.all_reduce(count, group=dp_group)
        ranks = dist.get_world_size(dp_group)
    return (count.clamp(min=1.0) / (len(masks) * ranks)).float()


def context_chunk_indices(cp: int, cp_rank: int) -> tuple[int, int]:
    """The two of a sequence's 2·cp equal chunks context rank `cp_rank` holds, in that order: chunk cp_rank, then
    chunk 2·cp − 1 − cp_rank (causal load balance: every rank holds as many early as late tokens; megatron's
    get_batch_on_this_cp_rank cuts them alike)."""
    return cp_rank, 2 * cp - 1 - cp_rank


def context_chunks(t: torch.Tensor, cp: int, cp_rank: int, dim: int = 1) -> torch.Tensor:
    """Context parallelism: this rank's two chunks of `t` along `dim` (context_chunk_indices)."""
    if cp == 1:
        return t
    chunks = t.chunk(2 * cp, dim=dim)
    return torch.cat([chunks[i] for i in context_chunk_indices(cp, cp_rank)], dim=dim)


def token_mean(per_token: torch.Tensor, loss_mask: Optional[torch.Tensor],
               loss_tokens: Optional[torch.Tensor] = None, cp: int = 1) -> torch.Tensor:
    """A micro-batch's loss from its per-token losses [b, s]: their mean, or with a loss mask the masked sum ÷
    `loss_tokens` (see `loss_tokens`; None: this micro-batch's own unmasked count). With context parallelism
    (`cp` ranks, each holding 1/cp of every sequence) this rank's share of it: the shares sum to the loss."""
    if loss_mask is None:
        return per_token.float().mean() if cp == 1 else per_token.float().mean() / cp
    if cp > 1 and loss_tokens is None:
        raise ValueError("a context-parallel share of a masked loss needs the whole micro-batch's count (loss_tokens)")
    total = (per_token.float() * loss_mask).sum()
    return total / (loss_mask.sum().clamp(min=1.0) if loss_tokens is None else loss_tokens.squeeze())
