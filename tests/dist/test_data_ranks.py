"""megatron-core's dataset build across gloo ranks: rank 0 builds the cached indices, the others load them."""
from pathlib import Path

import numpy
import pytest

from ranks import run_ranks

REPO = Path(__file__).resolve().parents[2]
SEQ = 32


@pytest.fixture(scope="module")
def blend_files(tmp_path_factory):
    """Two prefixes written with the shipped corpus's tokenizer (trained once here)."""
    from pretrain.data.indexed import IndexedWriter
    from pretrain.data.preprocess import train_tokenizer
    root = tmp_path_factory.mktemp("blend")
    model = train_tokenizer(REPO / "data/corpus.jsonl", root / "tok", 400)
    rng = numpy.random.default_rng(1)
    for name, (low, high) in {"low": (3, 100), "high": (100, 200)}.items():
        with IndexedWriter(root / name, 400) as writer:
            for _ in range(200):
                text = rng.integers(low, high, rng.integers(20, 200))
                writer.add_document(numpy.append(text, 2).astype(numpy.uint16))
            writer.finish()
    return root, str(model)


def _open(rank, world_size, root, model, cache, split):
    import torch.distributed as dist
    from pretrain.config import DataConfig
    from pretrain.data.datasets import open_datasets, prepare_files
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    config = DataConfig(blend=f"0.25 {root}/low 0.75 {root}/high", tokenizer_model=model, cache_dir=str(cache),
                        split=split)
    files = prepare_files(config, 400)
    saved, save = [], numpy.save  # megatron writes its indices with numpy.save: count who writes

    def counting_save(path, *args, **kwargs):
        saved.append(Path(path).name)
        return save(path, *args, **kwargs)
    numpy.save = counting_save
    train, valid, _ = open_datasets(files, config, SEQ, 1234, 400, train_samples=500, valid_samples=20)
    return {"saved": saved, "train": [train.sample(i) for i in range(100)],
            "valid": [valid.sample(i) for i in range(20)]}


def test_rank_zero_builds_the_indices_and_the_others_load_them(tmp_path, blend_files):
    root, model = blend_files
    results = run_ranks(_open, 3, root, model, tmp_path / "cache", "90,10,0", timeout=240)
    for other in results[1:]:
        assert all((a == b).all() for a, b in zip(results[0]["train"] + results[0]["valid"],
                                                 other["train"] + other["valid"]))
    written = sorted(tmp_path.joinpath("cache").glob("*.npy"))
    assert sorted(results[0]["saved"]) == [p.name for p in written] and results[1]["saved"] == results[2]["saved"] == []
    kinds = [p.name.split("-", 1)[1] for p in written]
    assert kinds.count("BlendedDataset-train-dataset_index.npy") == 1
    assert kinds.count("GPTDataset-train-shuffle_index.npy") == 2  # one per prefix
    again = run_ranks(_open, 2, root, model, tmp_path / "cache", "90,10,0", timeout=240)
    assert again[0]["saved"] == again[1]["saved"] == []  # loaded from the cache
    assert all((a == b).all() for a, b in zip(again[1]["train"], results[0]["train"]))


def test_a_split_error_reaches_every_rank_before_any_collective(tmp_path, blend_files):
    root, model = blend_files
    with pytest.raises(RuntimeError) as err:
        run_ranks(_open, 2, root, model, tmp_path / "cache", "99999,1,0", timeout=120)
    assert str(err.value).count("validation split of") == 2  # both ranks raised, neither waited
    assert not (tmp_path / "cache").exists()
