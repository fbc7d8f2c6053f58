"""Micro-batches through megatron-core's pipeline schedule (1F1B), with zero3d's engine doing the rest."""
from typing import Optional

import torch

from pretrain.data.batch import token_mean, tokens_of
from pretrain.model.gpt import local_inputs


def pipeline_micro_batches(engine, micro_batches: list, seq_length: int, forward_only: bool,
                           loss_tokens: Optional[torch.Tensor] = None, context: tuple = (1, 0)) -> list[torch.Tensor]:
    """Forward (and backward) of all micro-batches across the pipeline stages.

    megatron's schedule runs backward itself: the engine scales the loss (grad_scale_func) and
    finishes the step's backward once all micro-batches are done (finalize_model_grads_func:
    tied-embedding sums and, for stage 2, the last buckets). Every stage reads the same micro-batch,
    so each one's position ids and document mask reach every stage's layers; the loss mask, the last
    stage's loss (÷ `loss_tokens`, see pretrain.data.batch.token_mean). With context parallelism
    (`context` = (cp, cp_rank), cp > 1) each stage runs this rank's chunks (local_inputs; megatron's p2p
    shapes are [s/cp (/tp with SP), b, h]) and the loss is this rank's share, which megatron's schedule
    multiplies by cp before the backward (as run_micro_batches does; the engine averages over data ×
    context). Returns the per-micro-batch losses (shares) on the last stage, nothing elsewhere.
    """
    from megatron.core.pipeline_parallel import get_forward_backward_func

    config = engine.model.config
    config.grad_scale_func = engine.scale_loss
    config.finalize_model_grads_func = lambda *args, **kwargs: engine.finish_backward()

    def forward_step(data_iterator, model):
        batch = next(data_iterator)
        inputs, positions, mask, labels, loss_mask = local_inputs(batch, context)  # middle stages: the mask
        output = engine(inputs, positions, mask, labels=labels, loss_mask=loss_mask)  # the fused loss's weights

        def loss_func(per_token):
            loss = token_mean(per_token, loss_mask, loss_tokens, context[0])
            return loss, {"loss": loss.detach().clone()}  # megatron then divides `loss` in place
        return output, loss_func

    results = get_forward_backward_func()(
        forward_step_func=forward_step, data_iterator=iter(micro_batches), model=engine.model,
        num_microbatches=len(micro_batches), seq_length=seq_length,
        micro_batch_size=tokens_of(micro_batches[0]).shape[0], forward_only=forward_only)
    return [r["loss"] for r in results]
