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
