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
