"""zero3d's ZeroConfig checks itself once when built; pretrain's [zero] section is that dataclass."""
import dataclasses

import pytest

from pretrain.config import ConfigError, load_config
from zero3d.config import ZeroConfig, ZeroConfigError


@pytest.mark.parametrize("fields,message", [
    (dict(stage=4), "zero.stage = 4 is invalid; valid values: 0, 1, 2, 3"),
    (dict(bucket_elements=0), "zero.bucket_elements = 0 must be > 0"),
    (dict(grad_predivide_factor=-1.0), "zero.grad_predivide_factor = -1.0 must be >= 0 (0: the DP size)"),
    (dict(param_persistence_threshold=-5), "zero.param_persistence_threshold = -5 must be >= 0"),
    (dict(prefetch_units=-1), "zero.prefetch_units = -1 must be >= 0"),
    (dict(cpu_checkpointing=True), "zero.cpu_checkpointing = true needs zero.partition_activations = true"),
    (dict(stage=3, secondary_partition="rack"),
     "zero.secondary_partition = 'rack' is invalid; valid values: 'none', 'node'"),
    (dict(stage=2, secondary_partition="node"), "zero.secondary_partition = 'node' needs zero.stage = 3"),
    (dict(stage=2, hybrid="all"), "zero.hybrid = 'all' is invalid; valid values: 'none', 'node'"),
    (dict(stage=0, hybrid="node"), "zero.hybrid = 'node' needs zero.stage = 1, 2 or 3"),
    (dict(stage=3, quantize_weights="int4"), "zero.quantize_weights = 'int4' is invalid; valid values: 'none', 'int8'"),
    (dict(stage=2, quantize_weights="int8"), "zero.quantize_weights = 'int8' needs zero.stage = 3"),
    (dict(stage=3, quantize_gradients="fp8"),
     "zero.quantize_gradients = 'fp8' is invalid; valid values: 'none', 'int8', 'int4'"),
    (dict(stage=1, quantize_gradients="int4"), "zero.quantize_gradients = 'int4' needs zero.stage = 2 or 3"),
    (dict(quant_block=7), "zero.quant_block = 7 is invalid; must be an even integer > 0"),
    (dict(quant_block=0), "zero.quant_block = 0 is invalid; must be an even integer > 0"),
    (dict(stage=3, hybrid="node", secondary_partition="node"), "zero.hybrid = 'node' with zero.secondary_partition"),
    (dict(stage=2, hybrid="node", quantize_gradients="int8"),
     "zero.hybrid = 'node' with zero.quantize_gradients is refused: qgZ's hierarchical reduce-scatter spans the nodes"),
    (dict(stage=1, hybrid="node", offload_optimizer="cpu"),
     "zero.hybrid = 'node' with zero.offload_optimizer = 'cpu' is not supported; use one of them"),
    (dict(stage=3, fp8_gather=True, quantize_weights="int8"),
     "zero.fp8_gather = true with zero.secondary_partition or zero.quantize_weights is refused"),
])
def test_invalid_settings_name_key_value_and_what_is_valid(fields, message):
    with pytest.raises(ZeroConfigError) as err:
        ZeroConfig(**fields)
    assert message in str(err.value)


@pytest.mark.parametrize("override,message", [
    ("zero.bucket_elements=0", "zero.bucket_elements = 0 must be > 0"),
    ("zero.grad_predivide_factor=-2", "zero.grad_predivide_factor = -2.0 must be >= 0"),
])
def test_toml_keys_build_the_same_dataclass(override, message):
    cfg = load_config(None, ["zero.stage=2", "zero.overlap_param_gather=false", "zero.grad_predivide_factor=4"])
    assert isinstance(cfg.zero, ZeroConfig)
    assert dataclasses.asdict(cfg.zero) == dataclasses.asdict(
        ZeroConfig(stage=2, overlap_param_gather=False, grad_predivide_factor=4.0))
    with pytest.raises(ConfigError, match=message):
        load_config(None, [override])


def test_predivide_defaults_to_the_dp_size():
    assert ZeroConfig().predivide(25) == 25.0
    assert ZeroConfig(grad_predivide_factor=1.0).predivide(25) == 1.0


def test_node_aware_modes_are_named():
    assert not ZeroConfig(stage=3).node_aware()
    assert ZeroConfig(stage=3, secondary_partition="node").node_aware()
    assert ZeroConfig(stage=1, hybrid="node").node_aware()
    assert ZeroConfig(stage=3, quantize_weights="int8").node_aware()
    assert ZeroConfig(stage=2, quantize_gradients="int4").node_aware()


def test_hpz_and_hybrid_need_two_dp_ranks_per_node():
    z = ZeroConfig(stage=3, secondary_partition="node")
    assert z.node_layout_error(1, 8) == ("zero.hybrid / zero.secondary_partition = 'node' need >= 2 DP ranks per "
                                         "node; this layout has 1 (cluster.gpus_per_node = 8, after tensor "
                                         "parallelism's share): use zero.hybrid = zero.secondary_partition = 'none'")
    assert z.node_layout_error(2, 8) == ""
    assert ZeroConfig(stage=2, hybrid="node").node_layout_error(1, 2) != ""
    assert ZeroConfig(stage=3, quantize_weights="int8").node_layout_error(1, 1) == ""  # qwZ runs anywhere
