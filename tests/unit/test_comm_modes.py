"""One vocabulary for ZeRO's communication modes (zero3d/comm/modes.py): config keys and analysis names
(analysis/modes.py) map both ways."""
import itertools

import pytest

from analysis.comm_model import STAGE_MODES
from analysis.modes import mode_name, mode_parts, named_modes, zero_keys
from zero3d.config import ZeroConfig, ZeroConfigError


def test_the_analysed_modes_per_stage_are_the_papers_and_the_engines():
    # hybrid shards at stages 1-3, qgZ reduces buckets at 2-3, hpZ and qwZ act on stage 3's gathers
    assert STAGE_MODES == {0: ("",), 1: ("", "+hybrid"), 2: ("", "+hybrid", "+qgZ"),
                           3: ("", "+hpZ", "+hybrid", "+qwZ", "+qgZ", "qwZ+hpZ+qgZ")}


@pytest.mark.parametrize("name,keys", [
    ("", ("none", "none", "none", "none")),
    ("+hpZ", ("node", "none", "none", "none")),
    ("+hybrid", ("none", "node", "none", "none")),
    ("+qwZ", ("none", "none", "int8", "none")),
    ("+qgZ", ("none", "none", "none", "int4")),
    ("qwZ+hpZ+qgZ", ("node", "none", "int8", "int4")),
])
def test_a_name_is_the_config_keys_it_switches_on(name, keys):
    fields = ("secondary_partition", "hybrid", "quantize_weights", "quantize_gradients")
    modes = named_modes(name)
    assert zero_keys(modes) == dict(zip(fields, keys))
    zero = ZeroConfig(stage=3, **dict(zip(fields, keys)))
    assert zero.comm_modes() == modes and mode_name(modes) == name
    assert zero.node_aware() == (name != "")


def test_every_valid_config_has_a_name_that_reads_back():
    fields = {"secondary_partition": ("none", "node"), "hybrid": ("none", "node"),
              "quantize_weights": ("none", "int8"), "quantize_gradients": ("none", "int8", "int4")}
    seen = 0
    for stage, values in itertools.product(range(4), itertools.product(*fields.values())):
        try:
            zero = ZeroConfig(stage=stage, **dict(zip(fields, values)))
        except ZeroConfigError:
            continue
        modes = zero.comm_modes()
        assert modes.min_stage <= stage
        back = named_modes(mode_name(modes))  # the analysis models qgZ at int4: bits aside, the same modes
        assert mode_parts(back) == mode_parts(modes)
        seen += 1
    # by stage: plain; + hybrid; + hybrid, qgZ int8 / int4; stage 3: hpZ or not × qwZ or not × qgZ none / int8 / int4
    # (12), and hybrid × qwZ or not (2: hybrid refuses hpZ and qgZ)
    assert seen == 1 + 2 + 4 + 14


@pytest.mark.parametrize("bad", ["hpZ+hpZ", "+zpZ", "stage 3"])
def test_an_unknown_name_is_refused_with_the_valid_ones(bad):
    with pytest.raises(ValueError, match=r"is invalid; valid: '', '\+hpZ', '\+hybrid', '\+qwZ', '\+qgZ', 'qwZ\+hpZ\+qgZ'"):
        named_modes(bad)
