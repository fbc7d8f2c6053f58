"""The memory table's header line: the whole run it estimates, though the estimate is one pipeline stage's rank."""
import pytest

from pretrain.config import load_config
from pretrain.memory_check import config_report


@pytest.mark.parametrize("world, overrides, header", [
    (4, [], "4 layers × hidden 128, seq 128; 4 ranks = TP 2 × PP 1 × DP 2; ZeRO stage 2, micro-batch 4, fp32; "
            "adamw, fp32 states"),
    (8, ["parallel.pipeline=2", "zero.stage=1", "optimizer.state_dtype=\"bf16\""],
     "4 layers × hidden 128, seq 128; 8 ranks = TP 2 × PP 2 × DP 2; ZeRO stage 1, micro-batch 4, fp32; "
     "adamw, bf16 states"),
    (24, ["parallel.context=2", "model.attention=\"sdpa\"", "precision.dtype=\"bf16\"", "train.micro_batch_size=2",
          "train.global_batch_size=12"],
     "4 layers × hidden 128, seq 128; 24 ranks = TP 2 × PP 1 × CP 2 × DP 6; ZeRO stage 2, micro-batch 2, bf16; "
     "adamw, fp32 states"),
])
def test_the_header_names_the_whole_run(world, overrides, header):
    """configs/tiny.toml (4 layers, TP 2, micro-batch 4, global batch 16) and two layouts of it; by hand."""
    _, table = config_report(load_config("configs/tiny.toml", overrides), world)
    assert table.splitlines()[0] == header
