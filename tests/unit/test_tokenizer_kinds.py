"""Tests the tokenizer kinds (hf, gpt2_bpe, tiktoken) against their reference libraries called directly, the
token files they preprocess, the identity hash over their files, and a byte-level BPE trained here."""
import base64
import hashlib
import json
import shutil
from pathlib import Path

import numpy
import pytest
import tiktoken
from megatron.core.datasets.indexed_dataset import IndexedDataset
from tiktoken.load import data_gym_to_mergeable_bpe_ranks
from tokenizers import ByteLevelBPETokenizer
from tokenizers import Tokenizer as HF

from pretrain.config import ConfigError, DataConfig, load_config
from pretrain.data.corpus import read_documents
from pretrain.data.datasets import prepare_files
from pretrain.data.preprocess import tokenize_corpus
from pretrain.errors import TokenizerError
from pretrain.data.tokenizers import GPT2_PATTERN, TokenizerSpec, load_tokenizer

CORPUS = Path(__file__).resolve().parents[2] / "data" / "corpus.jsonl"
VOCAB, EOD, DOCUMENTS = 400, "<|endoftext|>", 150


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """A byte-level BPE trained with `tokenizers` itself on part of the shipped corpus, saved as a
    tokenizer.json, as GPT-2's vocab.json + merges.txt, and as a tiktoken BPE file (tiktoken's converter)."""
    root = tmp_path_factory.mktemp("kinds")
    documents = list(read_documents(CORPUS))[:DOCUMENTS]
    (root / "part.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in documents))
    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator(documents, vocab_size=VOCAB - 1, show_progress=False)
    bpe.add_special_tokens([EOD])  # id VOCAB - 1, after the merges (as GPT-2's 50256)
    bpe.save(str(root / "tokenizer.json"))
    bpe.save_model(str(root))  # vocab.json, merges.txt
    vocab = json.loads((root / "vocab.json").read_text())
    (root / "vocab.json").write_text(json.dumps({**vocab, EOD: VOCAB - 1}))  # GPT-2's encoder.json holds it too
    ranks = data_gym_to_mergeable_bpe_ranks(str(root / "merges.txt"), str(root / "vocab.json"))
    # tiktoken's file format, as its dump_tiktoken_bpe writes it (that one needs blobfile): base64 token, rank
    (root / "bpe.tiktoken").write_text("".join(f"{base64.b64encode(token).decode()} {rank}\n"
                                               for token, rank in sorted(ranks.items(), key=lambda kv: kv[1])))
    return root, documents


def specs(root: Path) -> dict[str, TokenizerSpec]:
    return {"hf": TokenizerSpec("hf", str(root / "tokenizer.json")),
            "gpt2_bpe": TokenizerSpec("gpt2_bpe", str(root / "vocab.json"), str(root / "merges.txt")),
            "tiktoken": TokenizerSpec("tiktoken", str(root / "bpe.tiktoken"))}


def reference_ids(kind: str, root: Path, documents: list[str]) -> list[list[int]]:
    """The reference library's own ids for each kind's files."""
    if kind == "hf":
        return [e.ids for e in HF.from_file(str(root / "tokenizer.json")).encode_batch(documents)]
    if kind == "gpt2_bpe":
        bpe = ByteLevelBPETokenizer(str(root / "vocab.json"), str(root / "merges.txt"))
        return [e.ids for e in bpe.encode_batch(documents)]
    ranks = tiktoken.load.load_tiktoken_bpe(str(root / "bpe.tiktoken"))
    encoding = tiktoken.Encoding("reference", pat_str=GPT2_PATTERN, mergeable_ranks=ranks,
                                 special_tokens={EOD: len(ranks)})
    return encoding.encode_ordinary_batch(documents)


@pytest.mark.parametrize("kind", ["hf", "gpt2_bpe", "tiktoken"])
def test_each_kind_encodes_the_corpus_to_the_reference_ids(files, kind):
    root, documents = files
    tokenizer = load_tokenizer(specs(root)[kind])
    expected = reference_ids(kind, root, documents)
    assert tokenizer.encode_batch(documents) == expected
    assert [tokenizer.encode(d) for d in documents[:20]] == expected[:20]
    assert tokenizer.vocab_size == VOCAB and tokenizer.eod_id == VOCAB - 1 and tokenizer.bos_id is None
    assert [tokenizer.decode(ids) for ids in expected[:20]] == documents[:20]
    # the three libraries agree: GPT-2's scheme from the same merges gives the same ids in each
    assert expected == [e.ids for e in HF.from_file(str(root / "tokenizer.json")).encode_batch(documents)]


@pytest.mark.parametrize("kind", ["hf", "gpt2_bpe", "tiktoken"])
def test_each_kind_exported_for_transformers_gives_the_reference_ids(tmp_path, files, kind):
    """export --format hf's tokenizer files: AutoTokenizer, loaded with no custom code, encodes to the reference
    library's ids; the end-of-document text inside a document is what the reference makes of it (tokenizers
    matches an added token in text, GPT-2's files and tiktoken's ordinary encoding read it as plain text)."""
    from transformers import AutoTokenizer

    from pretrain.checkpoint.export import hf_tokenizer
    root, documents = files
    texts = documents[:40] + [f"one{EOD}two", f" {EOD} "]
    hf_tokenizer(specs(root)[kind], 64).save_pretrained(tmp_path)
    exported = AutoTokenizer.from_pretrained(tmp_path)
    assert [exported(t).input_ids for t in texts] == reference_ids(kind, root, texts)
    assert exported.eos_token == EOD and exported.eos_token_id == VOCAB - 1


@pytest.mark.parametrize("kind", ["hf", "gpt2_bpe", "tiktoken"])
def test_preprocess_writes_the_reference_ids(tmp_path, files, kind):
    root, documents = files
    tokenize_corpus([root / "part.jsonl"], specs(root)[kind], tmp_path / "tokens", workers=2)
    written = IndexedDataset(str(tmp_path / "tokens"))
    expected = reference_ids(kind, root, documents)
    assert len(written) == len(expected)
    for stored, ids in zip(written, expected):
        assert stored.tolist() == ids + [VOCAB - 1]  # each document, then the end-of-document id
    assert written[0].dtype == numpy.uint16


def test_the_identity_hash_covers_every_file(tmp_path, files):
    root, _ = files
    for kind, spec in specs(root).items():
        copies = {}
        for field in ("model", "merges"):
            if getattr(spec, field):
                copies[field] = tmp_path / f"{kind}-{Path(getattr(spec, field)).name}"
                shutil.copy(getattr(spec, field), copies[field])
        copied = TokenizerSpec(kind, str(copies["model"]), copies.get("merges") and str(copies["merges"]))
        before = load_tokenizer(copied).files_sha256()
        assert before == load_tokenizer(spec).files_sha256()  # the bytes, not the paths
        for path in copies.values():
            original = path.read_bytes()
            # still loads, its bytes differ: JSON laid out anew, a text file without its last line
            path.write_text(json.dumps(json.loads(original), indent=1) if path.suffix == ".json" else
                            "".join(original.decode().splitlines(keepends=True)[:-1]))
            assert load_tokenizer(copied).files_sha256() != before, (kind, path.name)
            path.write_bytes(original)
    hf = specs(root)["hf"]
    assert load_tokenizer(TokenizerSpec("hf", hf.model, eod="Ġthe")).files_sha256() != (
        load_tokenizer(hf).files_sha256())


def test_the_run_identity_file_changes_with_the_merges(tmp_path, files):
    """What a checkpoint hashes (DataFiles.tokenizer_path, as run_identity reads it) follows merges.txt too."""
    root, _ = files
    merges = tmp_path / "merges.txt"
    shutil.copy(root / "merges.txt", merges)
    config = dict(corpus=str(root / "part.jsonl"), cache_dir=str(tmp_path / "cache"), tokenizer_kind="gpt2_bpe",
                  tokenizer_model=str(root / "vocab.json"), tokenizer_merges=str(merges))
    first = prepare_files(DataConfig(**config), VOCAB)
    digest = hashlib.sha256(Path(first.tokenizer_path).read_bytes()).hexdigest()
    lines = merges.read_text().splitlines(keepends=True)
    merges.write_text("".join(lines[:-1]))  # one merge fewer
    second = prepare_files(DataConfig(**config), VOCAB)
    assert hashlib.sha256(Path(second.tokenizer_path).read_bytes()).hexdigest() != digest
    assert second.blend != first.blend  # and the tokens are rebuilt for it


def test_hf_tokenizer_trained_from_the_corpus_is_deterministic(tmp_path, files):
    root, documents = files
    made = [prepare_files(DataConfig(corpus=str(root / "part.jsonl"), cache_dir=str(tmp_path / name),
                                     tokenizer_kind="hf"), VOCAB) for name in ("a", "b")]
    paths = [Path(m.tokenizer.model) for m in made]
    assert paths[0].name.endswith(".json") and paths[0].read_bytes() == paths[1].read_bytes()
    reference = HF.from_file(str(paths[0]))
    assert reference.get_vocab_size() == VOCAB and reference.token_to_id(EOD) == VOCAB - 1
    written = IndexedDataset(made[0].blend[0][0])
    for stored, text in zip(written, documents[:30]):
        assert stored.tolist() == reference.encode(text).ids + [VOCAB - 1]


def test_tokenizer_kind_errors(tmp_path, files):
    root, _ = files
    with pytest.raises(TokenizerError, match=r"merges\.txt '.*absent\.txt' does not exist"):
        load_tokenizer(TokenizerSpec("gpt2_bpe", str(root / "vocab.json"), str(tmp_path / "absent.txt")))
    with pytest.raises(TokenizerError, match=r"tokenizer '.*tokenizer\.json' has no token '<eos>' to end "
                                             r"documents with; set data\.tokenizer_eod"):
        load_tokenizer(TokenizerSpec("hf", str(root / "tokenizer.json"), eod="<eos>"))
    (tmp_path / "junk.json").write_text("{}")
    with pytest.raises(TokenizerError, match=r"tokenizer\.json '.*junk\.json' is not a Hugging Face tokenizer"):
        load_tokenizer(TokenizerSpec("hf", str(tmp_path / "junk.json")))
    (tmp_path / "junk.tiktoken").write_text("not base64 and no rank\n")
    with pytest.raises(TokenizerError, match=r"tiktoken BPE file '.*junk\.tiktoken' does not parse"):
        load_tokenizer(TokenizerSpec("tiktoken", str(tmp_path / "junk.tiktoken")))


@pytest.mark.parametrize("overrides, message", [
    (["data.tokenizer_kind='gpt2_bpe'", "data.tokenizer_model='vocab.json'"],
     r"data.tokenizer_kind = 'gpt2_bpe' needs data.tokenizer_merges \(merges.txt\) beside data.tokenizer_model"),
    (["data.tokenizer_merges='m.txt'", "data.tokenizer_model='t.model'"],
     r"data.tokenizer_merges = 'm.txt' applies only to data.tokenizer_kind = 'gpt2_bpe' \(here 'sentencepiece'\)"),
    (["data.tokenizer_kind='tiktoken'"], r"data.tokenizer_kind = 'tiktoken' needs data.tokenizer_model"),
    (["data.tokenizer_kind='bpe'"], r"data.tokenizer_kind = 'bpe'"),
    (["data.tokenizer_eod='</s>'"], r"data.tokenizer_eod = '</s>' is invalid for data.tokenizer_kind = 'sentencepiece'"),
    (["data.tokenizer_kind='hf'", "data.tokenizer_eod=''"], r"data.tokenizer_eod = '' is invalid"),
    (["data.tokenizer_kind='none'", "data.eod_id=0"], r"data.tokenizer_kind = 'none' needs data.blend"),
    (["data.tokenizer_kind='none'", "data.blend='a'"], r"data.tokenizer_kind = 'none' needs data.eod_id"),
    (["data.tokenizer_kind='none'", "data.blend='a'", "data.eod_id=-1"], r"data.eod_id = -1 must be >= 0"),
    (["data.eod_id=2"], r"data.eod_id = 2 applies only to data.tokenizer_kind = 'none'"),
    (["data.tokenizer_kind='none'", "data.blend='a'", "data.eod_id=0", "data.tokenizer_model='t.model'"],
     r"data.tokenizer_model = 't.model' is set but data.tokenizer_kind = 'none' reads no tokenizer file"),
])
def test_tokenizer_config_errors(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, overrides)


def test_preflight_names_each_kinds_missing_file(tmp_path, files):
    from pretrain.errors import InputError
    from pretrain.runtime.preflight import check_paths
    root, _ = files
    base = [f"data.corpus={root / 'part.jsonl'}", f"data.cache_dir={tmp_path / 'cache'}",
            f"logging.run_dir={tmp_path / 'run'}"]
    gpt2 = base + ["data.tokenizer_kind=gpt2_bpe", f"data.tokenizer_model={root / 'vocab.json'}"]
    check_paths(load_config(None, gpt2 + [f"data.tokenizer_merges={root / 'merges.txt'}"]))
    with pytest.raises(InputError, match=r"data.tokenizer_merges = '.*absent\.txt' does not exist; put GPT-2's "
                                         r"merges\.txt there \(slurm/README\.md, Data\), or point "
                                         r"data.tokenizer_merges at your copy$"):
        check_paths(load_config(None, gpt2 + [f"data.tokenizer_merges={tmp_path / 'absent.txt'}"]))
    with pytest.raises(InputError, match=r"data.tokenizer_model = '.*absent\.tiktoken' does not exist; point it at "
                                         r"a tiktoken BPE file$"):
        check_paths(load_config(None, base + ["data.tokenizer_kind=tiktoken",
                                              f"data.tokenizer_model={tmp_path / 'absent.tiktoken'}"]))


@pytest.mark.parametrize("argv, message", [
    (["--tokenizer-kind", "gpt2_bpe"], "--tokenizer-merges (merges.txt) goes with --tokenizer-kind gpt2_bpe"),
    (["--tokenizer-merges", "m.txt"], "--tokenizer-merges (merges.txt) goes with --tokenizer-kind gpt2_bpe"),
    (["--tokenizer-kind", "tiktoken", "--train-tokenizer", "--vocab-size", "300"],
     "--train-tokenizer trains kinds sentencepiece and hf, not tiktoken"),
    (["--tokenizer-kind", "hf", "--train-tokenizer", "--vocab-size", "300"], "must end in .json"),
    (["--tokenizer-eod", "</s>"], "--tokenizer-eod applies to kinds hf, gpt2_bpe and tiktoken"),
    (["--tokenizer-kind", "none"], "invalid choice: 'none'"),
])
def test_preprocess_tokenizer_flag_errors(argv, message, capsys):
    from pretrain.data.preprocess import parse_args
    with pytest.raises(SystemExit) as stop:
        parse_args(["--input", "c.jsonl", "--tokenizer-model", "t.model", "--output-prefix", "o", *argv])
    assert stop.value.code == 2 and message in capsys.readouterr().err


def documents_holding_special_text(documents: list[str]) -> list[str]:
    """Corpus documents with the end-of-document text (and sentencepiece's own control texts) inside them: at the
    middle, at the start, at the end, twice, glued to words and alone."""
    out = []
    for i, d in enumerate(documents[:24]):
        k = len(d) // 2
        special = (EOD, "</s>", f"{EOD}{EOD}", " <s> ")[i % 4]
        out.append((d[:k] + special + d[k:], special + d, d + special)[i % 3])
    return out + [EOD, f"one{EOD}two", f" {EOD} ", "x</s>y", f"{EOD}\n{EOD}"]


@pytest.fixture(scope="module")
def sentencepiece_model(files):
    """A sentencepiece model zero3d trains on the same part of the corpus (its end-of-document text is "</s>")."""
    from pretrain.data.preprocess import train_tokenizer
    root, _ = files
    return train_tokenizer(root / "part.jsonl", root / "sp", 512)


@pytest.mark.parametrize("kind", ["sentencepiece", "hf", "gpt2_bpe", "tiktoken"])
def test_end_of_document_text_in_a_document_gets_the_same_ids_on_every_path(tmp_path, files, sentencepiece_model, kind):
    """A document holding the end-of-document text: the run's corpus build (one process, the loaded tokenizer), the
    preprocess command's workers (each loading its own), encode() of the document alone and the exported
    AutoTokenizer all give the reference library's ids of that document, called one document at a time (tiktoken's
    ordinary encoding and sentencepiece read the text as text; `tokenizers` matches its added token), then the
    end-of-document id."""
    import sentencepiece as spm
    from transformers import AutoTokenizer

    from pretrain.checkpoint.export import hf_tokenizer
    root, documents = files
    texts = documents_holding_special_text(documents)
    corpus = tmp_path / "special.jsonl"
    corpus.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    spec = specs(root).get(kind) or TokenizerSpec("sentencepiece", str(sentencepiece_model))
    if kind == "sentencepiece":
        reference = spm.SentencePieceProcessor(model_file=str(sentencepiece_model))
        expected = [reference.encode(t) for t in texts]
    elif kind == "tiktoken":
        ranks = tiktoken.load.load_tiktoken_bpe(str(root / "bpe.tiktoken"))
        encoding = tiktoken.Encoding("reference", pat_str=GPT2_PATTERN, mergeable_ranks=ranks,
                                     special_tokens={EOD: len(ranks)})
        expected = [encoding.encode_ordinary(t) for t in texts]
    else:
        expected = [ids for t in texts for ids in reference_ids(kind, root, [t])]
    tokenizer = load_tokenizer(spec)
    eod = tokenizer.eod_id
    assert [tokenizer.encode(t) for t in texts] == expected
    assert tokenizer.encode_batch(texts) == expected
    if kind in ("sentencepiece", "tiktoken"):  # the text is text to these: the end-of-document id is never made from it
        assert all(eod not in ids for ids in expected)
    hf_tokenizer(spec, 64).save_pretrained(tmp_path / "hf")
    exported = AutoTokenizer.from_pretrained(tmp_path / "hf")
    assert [exported(t).input_ids for t in texts] == expected
    # the corpus built for a run (one process) and by the preprocess command (2 workers, each loading the tokenizer)
    built = prepare_files(DataConfig(corpus=str(corpus), cache_dir=str(tmp_path / "cache"), tokenizer_kind=kind,
                                     tokenizer_model=spec.model, tokenizer_merges=spec.merges), 512)
    tokenize_corpus([corpus], spec, tmp_path / "tokens", workers=2)
    for prefix in (built.blend[0][0], str(tmp_path / "tokens")):
        assert [stored.tolist() for stored in IndexedDataset(prefix)] == [ids + [eod] for ids in expected], prefix
