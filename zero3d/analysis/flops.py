"""Model FLOPs of a GPT training step (Megatron-LM convention): the one formula the loop, probe and planner use."""


def gpt_flops_per_step(num_layers: int, hidden: int, seq_length: int, vocab_size: int,
                       global_batch: int, recompute: bool) -> float:
    """Model FLOPs of one training step (all ranks together), Megatron-LM convention.

    Narayanan et al. 2021 (eq. 3), with B = global batch, s = sequence, L = layers, h = hidden,
    V = vocabulary (pass the padded vocabulary: that is the width the logit GEMM computes):

      transformer layers, one forward:  24·B·s·L·h²·(1 + s/(6h))
      logit layer, one forward:         2·B·s·h·V
      step = 3 × layers + 3 × logit            (backward = 2 × forward)
      step = 4 × layers + 3 × logit            with full recomputation

    i.e. 72·B·s·L·h²·(1 + s/(6h)) + 6·B·s·h·V without recomputation, 96·… with it. The recomputed
    forward is counted, as Megatron's and the ZeRO paper's TFLOP/s are ("hardware FLOPs"); the logit
    layer is never recomputed. The layer term assumes ffn = 4h and ignores softmax/norms/biases.
    """
    # 24·B·s·L·h²·(1 + s/(6h)) = 24·B·s·L·h² + 4·B·s²·L·h, kept in integers so the result is exact.
    layers_forward = 24 * global_batch * seq_length * num_layers * hidden ** 2 \
        + 4 * global_batch * seq_length ** 2 * num_layers * hidden
    logit_forward = 2 * global_batch * seq_length * hidden * vocab_size
    layer_passes = 4 if recompute else 3
    return float(layer_passes * layers_forward + 3 * logit_forward)
