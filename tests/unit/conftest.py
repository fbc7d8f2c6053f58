"""Fixtures the one-process unit tests share."""
import pytest
import torch.distributed as dist


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """A one-rank gloo group, for code that asks torch.distributed (megatron's blended indices, the engine)."""
    store = tmp_path_factory.mktemp("pg") / "store"
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@pytest.fixture(scope="session")
def gpt2_overrides(tmp_path_factory) -> list:
    """Overrides naming a tiny vocab.json + merges.txt in GPT-2's format (tests/gpt2_files.py) in place of GPT-2's
    own, which the paper configs name at data/gpt2/ for the user to supply."""
    from gpt2_files import gpt2_overrides as written
    return written(tmp_path_factory.mktemp("gpt2"))
