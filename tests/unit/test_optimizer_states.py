"""optim/'s OptimizerSpec and FlatOptimizer: a missing state is an error, never a zero tensor; the manifest's
step count and state dtype."""
from types import SimpleNamespace

import pytest
import torch

from pretrain.checkpoint.read import optimizer_fields, saved_optimizer
from optim.config import OptimizerConfig
from optim import ADAMW
from optim.flat_optimizer import FlatOptimizer, FlatTensor
from zero3d.sharded_state import optimizer_states, optimizer_step_count, set_optimizer_step_count


def engine_over(pieces: list, optimizer) -> SimpleNamespace:
    """What zero3d/sharded_state.py reads of an engine (its ShardedEngine protocol), over bare master pieces."""
    group = SimpleNamespace(master_pieces=[(0, p) for p in pieces], matrix=False)
    return SimpleNamespace(groups={"g": group}, optimizer=optimizer, settings=SimpleNamespace(optimizer_spec=ADAMW))


def adamw_engine():
    pieces = [torch.zeros(4), torch.zeros(5)]
    optimizer = FlatOptimizer([FlatTensor(p, 0.0) for p in pieces], ADAMW, OptimizerConfig(lr=0.1, beta2=0.99),
                              fused=False)
    return engine_over(pieces, optimizer), pieces


def test_a_piece_not_stepped_yet_gets_the_specs_initial_state_and_the_count_is_zero():
    engine, pieces = adamw_engine()
    assert optimizer_step_count(engine) == 0
    states = optimizer_states(engine, pieces[0])
    assert list(states) == ["exp_avg", "exp_avg_sq"] and all(torch.equal(s, torch.zeros(4)) for s in states.values())
    set_optimizer_step_count(engine, 7)
    assert optimizer_step_count(engine) == 7 and set(engine.optimizer.state[pieces[1]]) == {"step", "exp_avg", "exp_avg_sq"}


def test_a_state_lacking_one_of_the_specs_names_is_an_error_naming_it():
    engine, pieces = adamw_engine()
    engine.optimizer.state[pieces[0]].update(step=torch.tensor(2.0), exp_avg=torch.ones(4))
    with pytest.raises(KeyError, match=r"lacks \['exp_avg_sq'\].*needs \['exp_avg', 'exp_avg_sq'\]"):
        optimizer_states(engine, pieces[0])
    assert "exp_avg_sq" not in engine.optimizer.state[pieces[0]]  # nothing invented


def test_a_stepped_optimizer_without_a_pieces_state_is_an_error():
    engine, pieces = adamw_engine()
    for p in pieces:
        p.grad = torch.ones_like(p)
    engine.optimizer.step()
    engine.optimizer.state.pop(pieces[1])
    with pytest.raises(KeyError, match="took 1 steps but holds no state"):
        optimizer_states(engine, pieces[1])


def test_the_manifest_names_the_optimizer_and_old_manifests_read_adam_step():
    assert optimizer_fields(ADAMW, 5) == {"optimizer": "adamw", "optimizer_state_dtype": "fp32", "optimizer_step": 5,
                                          "adam_step": 5}
    assert optimizer_fields(ADAMW, 5, "bf16")["optimizer_state_dtype"] == "bf16"
    assert saved_optimizer({"adam_step": 3}) == ("adamw", 3)  # written before optimizer_step
    assert saved_optimizer({"optimizer": "sgd", "optimizer_step": 2}) == ("sgd", 2)
    assert saved_optimizer({}) == (None, None)


def test_adamw_keeps_two_fp32_moments():
    assert (ADAMW.name, ADAMW.states, ADAMW.bytes_per_element(), ADAMW.bytes_per_element(False, "bf16")) == (
        "adamw", ("exp_avg", "exp_avg_sq"), 8, 4)
