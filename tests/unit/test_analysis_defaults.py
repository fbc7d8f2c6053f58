"""`python -m analysis` takes ZeRO defaults from ZeroConfig (CB on), and --largest grows hidden until nothing fits."""
import json

import pytest

from analysis.__main__ import build_parser, main
from analysis.estimate import GIB, gpt_param_count, layer_activation_bytes
from zero3d.config import ZeroConfig


def test_cli_zero_defaults_are_the_engines():
    args, engine = build_parser().parse_args([]), ZeroConfig()
    assert args.bucket_elements == engine.bucket_elements == 50_000_000
    assert (args.stage, args.prefetch_units, args.nvme_buffer_bytes) == (
        engine.stage, engine.prefetch_units, engine.nvme_buffer_bytes)
    assert (args.offload_optimizer, args.offload_params) == (engine.offload_optimizer, engine.offload_params)


def test_shape_without_bucket_flag_counts_one_bucket_and_no_cb_the_fused_buffer(capsys):
    shape = "--layers 24 --hidden 2048 --heads 16 --vocab 50257 --seq 1024 --gpus 4 --stage 2 --json".split()
    psi = gpt_param_count(24, 2048, 50257, 1024)  # 1.3B > one bucket
    assert main(shape) == 0
    assert json.loads(capsys.readouterr().out)["buffer_bytes"] == 4 * 50_000_000
    assert main(shape + ["--no-cb"]) == 0
    assert json.loads(capsys.readouterr().out)["buffer_bytes"] == 4 * psi


def test_bucket_elements_must_be_positive(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main("--largest --stage 3 --gpus 64 --bucket-elements 0".split())
    assert exit_info.value.code == 2
    assert "--bucket-elements 0 is invalid; must be > 0 (--no-cb: no CB)" in capsys.readouterr().err


def stage3_device_bytes(layers, hidden, heads, gpus):
    """Stage 3, fp16, s = 1024, V = 50257 (padded 50304), micro-batch 1, full recompute, CB 5e7, 32 GiB, the gradient
    shard held whole (the paper's accounting). Beside the model states and every layer's checkpoint (s·h·2), the larger
    of two moments: the loss — megatron's on the fp16 logits, each beside its fp32 copy (2 + 4 bytes), the final norm's
    input and output (2·s·h·2) and the gathered output layer (V_pad·h·2) — and the last layer's backward — its working
    set and the buffers (estimate.buffer_terms): the fp16 bucket fc2's weight gradient lands in, two gathered units,
    the output layer's bucket in flight, and the larger of fc2's activation gradients and local attention's score
    gradients. The step's moment, when larger: the chunk of the fp16 gradient shard it casts to fp32 at once, at most
    2²² elements of 4 bytes (never the whole shard), with activations and buffers freed."""
    psi = gpt_param_count(layers, hidden, 50257, 1024)
    layer = 12 * hidden**2 + 13 * hidden
    embedding = 50304 * hidden + 1024 * hidden
    bucket = max(4 * hidden**2, min(50_000_000, layer))
    gradients = max(1024 * hidden * 2 + 1024 * 4 * hidden * 2, 2 * heads * 1024**2 * 2 - 2 * 1024 * 4 * hidden * 2)
    loss = 1024 * 50304 * (2 + 4) + 2 * 1024 * hidden * 2 + 50304 * hidden * 2
    last_layer = (layer_activation_bytes(1024, 1, hidden, heads, 1) + 2 * bucket + 2 * max(layer, embedding) * 2
                  + 50304 * hidden * 2 + gradients)
    backward = layers * 1024 * hidden * 2 + max(loss, last_layer)
    return 16 * psi / gpus + max(backward, 4 * min(psi / gpus, 2**22)) + 0.1 * 32 * GIB


def largest_stage3_by_formula(gpus):
    """Every shape from 1536 × 16 up (Figure 7's, 5120 × 40, then +1024 at head size 128) until none fits."""
    shapes = [(1536, 16), (1920, 16), (2304, 24), (3072, 24), (4096, 32)]
    shapes += [(h, h // 128) for h in range(5120, 10**6, 1024)]
    best = (0, 0, 0)
    for hidden, heads in shapes:
        low, high = 0, 1  # bisect the deepest fitting layer count, as written out here
        while stage3_device_bytes(high, hidden, heads, gpus) <= 32 * GIB:
            low, high = high, 2 * high
        while high - low > 1:
            mid = (low + high) // 2
            low, high = (mid, high) if stage3_device_bytes(mid, hidden, heads, gpus) <= 32 * GIB else (low, mid)
        if low == 0:
            return best
        best = max(best, (gpt_param_count(low, hidden, 50257, 1024), low, hidden))
    raise AssertionError("no shape stopped fitting")


@pytest.mark.parametrize("gpus", [64, 1024])
def test_largest_uses_the_engine_bucket_and_searches_past_5120(capsys, gpus):
    """No --bucket-elements: the engine's 5e7 CB, not a 4Ψ buffer (which capped 64 GPUs at 6.93B);
    at 1024 GPUs the answer's hidden size is beyond the former 5120 bound."""
    params, layers, hidden = largest_stage3_by_formula(gpus)
    assert main(f"--largest --stage 3 --gpus {gpus} --recompute full --gpu-memory-gb 32 --json".split()) == 0
    out = json.loads(capsys.readouterr().out)
    assert (out["params"], out["layers"], out["hidden"]) == (params, layers, hidden)
    assert (hidden > 5120) == (gpus == 1024) and params > (90e9 if gpus == 64 else 700e9)
