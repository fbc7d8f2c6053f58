"""`python -m pretrain.export`: the checkpoint's model, TP and PP merged, equals the trained parameters."""
import json

import torch
from safetensors.torch import load_file

from checkpoint_harness import train_segment
from pretrain.checkpoint.export import main
from ranks import run_ranks


def merged_parameters(ranks: list) -> dict:
    """The TP 1 × PP 1 parameters: TP slices concatenated along their split dim, stages' layers renumbered."""
    pieces = {}
    for r in ranks:
        for name, tensor in r["params"].items():
            pieces.setdefault(r["global_names"][name], {})[r["tp_rank"]] = (tensor, r["tp_dims"][name])
    merged = {}
    for name, by_tp in pieces.items():
        slices = [by_tp[t][0] for t in sorted(by_tp)]
        dim = by_tp[0][1]
        merged[name] = slices[0] if dim is None else torch.cat(slices, dim=dim)
    return merged


def test_export_equals_the_tp_and_pp_merged_parameters(tmp_path):
    save_dir = tmp_path / "ckpt"
    ranks = run_ranks(train_segment, 4, ["parallel.tensor=2", "parallel.pipeline=2", "zero.stage=1"],
                      save_dir, 0, 2, (2,), timeout=300)
    out = tmp_path / "export"
    assert main([str(save_dir), str(out)]) == 0
    exported = load_file(str(out / "model.safetensors"))
    expected = merged_parameters(ranks)
    assert sorted(exported) == sorted(expected)
    for name, tensor in expected.items():
        assert torch.equal(exported[name], tensor), name
    config = json.loads((out / "config.json").read_text())
    assert config["step"] == 2 and config["model"]["num_layers"] == 2 and config["padded_vocab_size"] == 128
    assert config["parameters"]["embedding.word_embeddings.weight"] == [128, 32]


def test_export_refuses_a_damaged_checkpoint(tmp_path, capsys):
    save_dir = tmp_path / "ckpt"
    run_ranks(train_segment, 1, [], save_dir, 0, 1, (1,), timeout=300)
    part = save_dir / "step_00000001" / "__0_0.distcp"
    part.write_bytes(part.read_bytes()[:-1])
    assert main([str(save_dir), str(tmp_path / "export")]) == 3  # input: the checkpoint (docs/exit-codes.md)
    assert f"export: {part} has" in capsys.readouterr().err
    assert not (tmp_path / "export").exists()
