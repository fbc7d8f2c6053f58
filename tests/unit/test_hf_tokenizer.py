"""The sentencepiece tokenizer zero3d trains, exported for transformers: AutoTokenizer gives zero3d's ids on the
whole shipped corpus and on the texts where a near miss differs (leading, lone and repeated spaces, `▁` itself, a
literal `<s>`); a model whose settings the export does not replay is refused in one line."""
import io
import json

import pytest
import sentencepiece as spm

from pretrain.checkpoint.export import hf_tokenizer
from pretrain.data.corpus import read_documents
from pretrain.data.preprocess import train_tokenizer
from pretrain.data.tokenizers import Tokenizer, TokenizerSpec
from pretrain.errors import CheckpointError
from test_tokenizer_kinds import CORPUS

EDGES = ["  leading", "a  b   c", "\n\n  x", "tabs\t\tand", "123456 7", "ünïcödé 🙂 中文", " ", "", "end  ",
         "<s> literal </s>", "▁sym", "x ▁ y", "  ", "a\u3000b"]


@pytest.fixture(scope="module")
def corpus_model(tmp_path_factory):
    return train_tokenizer(CORPUS, tmp_path_factory.mktemp("sp") / "corpus", 1024)


def test_autotokenizer_gives_zero3ds_ids_on_the_corpus_and_the_edges(corpus_model, tmp_path):
    from transformers import AutoTokenizer
    hf_tokenizer(TokenizerSpec("sentencepiece", str(corpus_model)), 128).save_pretrained(tmp_path)
    ours, theirs = Tokenizer(corpus_model), AutoTokenizer.from_pretrained(tmp_path)
    texts = list(read_documents(CORPUS)) + EDGES
    assert [theirs(t).input_ids for t in texts] == ours.encode_batch(texts)
    assert [theirs.decode(ours.encode(t)) for t in EDGES if "▁" not in t] == [t for t in EDGES if "▁" not in t]
    assert (theirs.unk_token, theirs.bos_token, theirs.eos_token) == ("<unk>", "<s>", "</s>")
    assert json.loads((tmp_path / "tokenizer_config.json").read_text())["split_special_tokens"] is True


@pytest.mark.parametrize("setting,line", [
    (dict(model_type="unigram"), "model_type (BPE only) = 1 has no Hugging Face export here (supported: 2"),
    (dict(normalization_rule_name="nmt_nfkc"), "normalization_rule_name (identity only) = 'nmt_nfkc'"),
    (dict(user_defined_symbols=["<tool>"]), "user_defined_symbols = 1 has no Hugging Face export here"),
])
def test_a_setting_the_export_does_not_replay_is_refused(tmp_path, setting, line):
    model = io.BytesIO()
    options = {**dict(model_type="bpe", vocab_size=400, byte_fallback=True, normalization_rule_name="identity",
                      remove_extra_whitespaces=False, num_threads=1, minloglevel=2), **setting}
    spm.SentencePieceTrainer.train(sentence_iterator=iter(list(read_documents(CORPUS))[:200]), model_writer=model,
                                   **options)
    (tmp_path / "m.model").write_bytes(model.getvalue())
    with pytest.raises(CheckpointError) as err:
        hf_tokenizer(TokenizerSpec("sentencepiece", str(tmp_path / "m.model")), 128)
    assert line in str(err.value) and str(err.value).endswith("or pass --no-tokenizer")
