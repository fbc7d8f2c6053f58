"""Document boundaries in the data and the config: megatron's per-sample fields from a hand-built .bin/.idx, the
EOD-masked loss of a micro-batch, and the one-line refusals (pretrain/data/batch.py, datasets.py, config.py)."""
from types import SimpleNamespace

import numpy
import pytest
import torch
from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

from pretrain.model import attention
from pretrain.model.attention import resolve
from pretrain.config import ConfigError, DataConfig, load_config
from pretrain.data.batch import loss_tokens, token_mean
from pretrain.errors import DataError
from pretrain.data.datasets import open_datasets, prepare_files
from pretrain.data.tokenizers import check_eod
from pretrain.data.loader import Batches

VOCAB, EOD, SEQ = 64, 1, 24
LENGTHS = [5, 17, 3, 40, 9, 26, 12, 7, 31, 4] * 6  # tokens of each document, its EOD included


@pytest.fixture(scope="module")
def documents(tmp_path_factory):
    """Document k: the token k % 60 + 2 repeated, then EOD; so a sample's documents are told apart by token."""
    prefix = tmp_path_factory.mktemp("docs") / "docs"
    builder = IndexedDatasetBuilder(f"{prefix}.bin", dtype=numpy.uint16)
    for k, length in enumerate(LENGTHS):
        document = [k % 60 + 2] * (length - 1) + [EOD]
        builder.add_document(torch.tensor(document), [length])
    builder.finalize(f"{prefix}.idx")
    return str(prefix)


def open_train(prefix: str, cache, **keys):
    config = DataConfig(tokenizer_kind="none", eod_id=EOD, blend=prefix, split="100,0,0", cache_dir=str(cache), **keys)
    train, _, _ = open_datasets(prepare_files(config, VOCAB), config, SEQ, 1234, VOCAB, 40, 0)
    return train, config


def by_hand(inputs: torch.Tensor) -> tuple:
    """(positions, megatron's mask: True = masked, loss mask) of one sample from its tokens alone: a token's
    document is the count of EODs before it; it sees the earlier tokens of its own document."""
    document = torch.cat([torch.zeros(1, dtype=torch.long), (inputs == EOD).long().cumsum(0)[:-1]])
    starts = {int(d): i for i, d in reversed(list(enumerate(document)))}
    positions = torch.tensor([i - starts[int(d)] for i, d in enumerate(document)])
    sees = (document[:, None] == document[None, :]) & torch.ones(SEQ, SEQ, dtype=torch.bool).tril()
    return positions, ~sees.unsqueeze(0), (inputs != EOD).float()


def test_samples_restart_positions_and_mask_attention_at_each_document(documents, tmp_path, world):
    keys = dict(reset_position_ids=True, reset_attention_mask=True, eod_mask_loss=True)
    train, config = open_train(documents, tmp_path, **keys)
    restarts = 0
    for i in range(40):
        sample = train.sample(i)
        assert set(sample) == {"tokens", "position_ids", "attention_mask", "loss_mask"}
        inputs = sample["tokens"][:-1]
        positions, mask, loss_mask = by_hand(inputs)
        ends = (inputs == EOD).nonzero()[:, 0] + 1
        texts = [set(piece.tolist()) - {EOD} for piece in torch.tensor_split(inputs, ends)]
        assert all(len(t) <= 1 for t in texts)  # between two EODs one document of the .bin: its EOD is its end
        assert all(a != b for a, b in zip(texts, texts[1:]) if a and b)
        assert torch.equal(sample["position_ids"], positions), i
        assert torch.equal(sample["attention_mask"], mask), i
        assert torch.equal(sample["loss_mask"], loss_mask), i
        restarts += int((positions[1:] == 0).sum())
    assert restarts > 40  # the samples cross many boundaries
    cfg = load_config(None, ["train.global_batch_size=4", "train.micro_batch_size=2", "train.steps=10"])
    rank = SimpleNamespace(dp_rank=0, grad_accum=2, device=torch.device("cpu"))
    batch = Batches(train, cfg.train, config, rank).get(1, 1)
    assert {k: tuple(v.shape) for k, v in batch.items()} == {
        "tokens": (2, SEQ + 1), "position_ids": (2, SEQ), "attention_mask": (2, 1, SEQ, SEQ), "loss_mask": (2, SEQ)}
    assert batch["attention_mask"].dtype == torch.bool and torch.equal(batch["tokens"][1], train.sample(7)["tokens"])
    loaded = Batches(train, cfg.train, DataConfig(num_workers=1), rank).get(1, 1)  # a DataLoader worker's batch
    assert batch.keys() == loaded.keys() and all(torch.equal(batch[k], loaded[k]) for k in batch)


def test_only_the_fields_of_the_keys_set_are_carried(documents, tmp_path, world):
    plain, _ = open_train(documents, tmp_path)
    assert torch.is_tensor(plain.sample(0)) and plain.sample(0).shape == (SEQ + 1,)  # no keys: the token block
    positions, _ = open_train(documents, tmp_path, reset_position_ids=True)
    assert set(positions.sample(0)) == {"tokens", "position_ids"}
    assert torch.equal(positions.sample(0)["tokens"], plain.sample(0))


def test_eod_positions_carry_no_loss_and_the_mean_is_over_the_others():
    g = torch.Generator().manual_seed(0)
    per_token = torch.rand(2, 8, generator=g) * 5
    inputs = torch.tensor([[4, EOD, 5, 5, EOD, 6, 6, 6], [7, 7, 7, 7, 7, 7, EOD, 8]])
    mask = (inputs != EOD).float()
    kept = [float(per_token[b, s]) for b in range(2) for s in range(8) if inputs[b, s] != EOD]
    assert float(token_mean(per_token, mask)) == pytest.approx(sum(kept) / 13, rel=1e-6)
    louder = per_token.clone()
    louder[inputs == EOD] += 100.0  # what an EOD position would lose does not count
    assert float(token_mean(louder, mask)) == float(token_mean(per_token, mask))
    # across micro-batches: each one's masked sum over the step's mean count (13 + 16 tokens over 2 micro-batches)
    normaliser = loss_tokens([{"loss_mask": mask}, {"loss_mask": torch.ones(2, 8)}], dp_group=None)
    assert float(normaliser) == pytest.approx(14.5)
    assert loss_tokens([torch.zeros(2, 9, dtype=torch.long)], dp_group=None) is None  # no loss masks


@pytest.mark.parametrize("overrides,message", [
    (["data.reset_attention_mask=true", "model.attention=te"],
     "data.reset_attention_mask = true with model.attention = 'te' is refused: Transformer Engine's layers apply "
     "only their causal mask, not the per-sample document mask; use model.attention = 'auto', 'sdpa' or 'local'"),
    (["data.eod_mask_loss=1"], "data.eod_mask_loss = 1 is invalid; expected true or false"),
    (["data.reset_position_ids=\"yes\""], "data.reset_position_ids = 'yes' is invalid; expected true or false"),
])
def test_invalid_combinations_are_one_line(overrides, message):
    with pytest.raises(ConfigError) as err:
        load_config("configs/tiny.toml", overrides)
    assert str(err.value) == message


def test_document_keys_need_an_end_of_document_id():
    no_eos = SimpleNamespace(kind="sentencepiece", model_path="m.model", eod_id=-1, vocab_size=VOCAB)
    with pytest.raises(DataError) as err:
        check_eod(no_eos, DataConfig(reset_attention_mask=True, eod_mask_loss=True))
    assert str(err.value) == ("data.reset_attention_mask = true, data.eod_mask_loss = true needs an end-of-document "
                              "id, but the sentencepiece tokenizer m.model has none (eod id -1); use a tokenizer "
                              "with one (sentencepiece: an eos piece)")
    check_eod(no_eos, DataConfig())  # without the keys, no EOD is needed


def test_auto_attention_takes_sdpa_where_the_document_mask_applies(monkeypatch):
    monkeypatch.setattr(attention, "_te_importable", lambda: True)  # a GPU node with Transformer Engine
    assert resolve("auto", on_cuda=True, zero_recompute=False) == "te"
    assert resolve("auto", on_cuda=True, zero_recompute=False, document_mask=True) == "sdpa"
    assert resolve("local", on_cuda=True, zero_recompute=False, document_mask=True) == "local"
