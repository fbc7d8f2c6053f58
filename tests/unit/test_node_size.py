"""Ranks per node for the node-aware zero.* modes: the launcher's count unless cluster.gpus_per_node is set."""
import pytest

from pretrain.config import load_config
from pretrain.errors import ConfigError
from pretrain.runtime.layout import ranks_per_node

TORCHRUN_4 = {"LOCAL_WORLD_SIZE": "4"}  # torchrun --nproc-per-node 4
SLURM_2X3 = {"SLURM_TASKS_PER_NODE": "3(x2)"}  # srun: 2 nodes × 3 tasks


@pytest.mark.parametrize("env, expected", [(TORCHRUN_4, 4), (SLURM_2X3, 3),
                                           ({"SLURM_NTASKS_PER_NODE": "2", "LOCAL_WORLD_SIZE": "4"}, 2)])
def test_the_launcher_count_when_the_key_is_not_set(env, expected):
    """The default cluster.gpus_per_node (8) does not count as set: the launcher's count is used."""
    assert ranks_per_node(load_config(None, ["zero.stage=3", "zero.secondary_partition=node"]), env) == expected


def test_an_explicit_key_wins_over_the_launcher(tmp_path):
    """4 CPU ranks under torchrun --nproc-per-node 4 run as 2 nodes × 2, from an override or the TOML."""
    assert ranks_per_node(load_config(None, ["cluster.gpus_per_node=2"]), TORCHRUN_4) == 2
    toml = tmp_path / "c.toml"
    toml.write_text("[cluster]\ngpus_per_node = 8\n")  # the default's value, but given: it wins
    assert ranks_per_node(load_config(toml), TORCHRUN_4) == 8


def test_neither_is_a_one_line_error_naming_both_fixes():
    with pytest.raises(ConfigError) as err:
        ranks_per_node(load_config(None, ["zero.stage=3", "zero.secondary_partition=node"]), {})
    text = str(err.value)
    assert "\n" not in text and "LOCAL_WORLD_SIZE" in text
    assert "cluster.gpus_per_node" in err.value.fix and "torchrun" in err.value.fix
