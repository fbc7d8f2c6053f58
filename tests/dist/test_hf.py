"""Hugging Face models into zero3d (train.init_from's loader) at TP 1, TP 2 and PP 2: logits equal transformers'
within 1e-5 on the real vocabulary; and back out (to_hf) bitwise."""
from pathlib import Path

import pytest
import torch

from hf_models import TOKENS, VOCAB, save
from ranks import run_ranks

LAYOUTS = {"tp1": ["parallel.tensor=1"], "tp2": ["parallel.tensor=2"], "pp2": ["parallel.pipeline=2"]}


def _logits(rank, world_size, directory, layouts):
    """For each layout: the model built from the HF directory's [model] keys and loaded from its tensors; its
    logits on TOKENS (PP: stage 0 sends its hidden states to stage 1), the TP-1 names' tensors at TP 1 × PP 1
    (there DP 2: each rank holds the whole model)."""
    import torch.distributed as dist
    from megatron.core import tensor_parallel

    from pretrain.checkpoint.hf import ImportedModel, load_into, model_overrides
    from pretrain.config import load_config
    from pretrain.model.gpt import build_model
    from pretrain.runtime.layout import destroy_model_parallel_groups, init_layout
    imported = ImportedModel(Path(directory))
    out = {}
    for name, layout in layouts.items():
        cfg = load_config(None, ["logging.wandb=false", "model.loss_chunk_tokens=0", "train.micro_batch_size=2",
                                 f"train.global_batch_size={2 * world_size}", *model_overrides(imported.model), *layout])
        topo = init_layout(cfg)
        model = build_model(cfg, topo.device)
        load_into(model, imported)
        model.eval()
        b, s = TOKENS.shape
        mask = torch.ones(s, s, dtype=torch.bool).triu(1).view(1, 1, s, s)
        with torch.no_grad():
            if topo.pp > 1 and topo.pp_rank > 0:
                hidden = torch.empty(s, b, cfg.model.hidden_size)
                dist.recv(hidden, src=rank - 1)
                model.set_input_tensor(hidden)
            logits = model(TOKENS, torch.arange(s).expand(b, s), mask)
            if topo.pp > 1 and topo.pp_rank == 0:
                dist.send(logits, dst=rank + 1)
                logits = None
            else:
                logits = tensor_parallel.gather_from_tensor_model_parallel_region(logits)[..., :VOCAB]
        out[name] = {"logits": logits, "params": {n: p.detach().clone() for n, p in model.named_parameters()}
                     if topo.tp == topo.pp == 1 else None}
        destroy_model_parallel_groups()
    return out


@pytest.fixture(scope="module", params=["llama", "qwen3", "gpt2"])
def imported(request, tmp_path_factory):
    directory = tmp_path_factory.mktemp(request.param)
    reference = save(request.param, directory)
    two = run_ranks(_logits, 2, str(directory), LAYOUTS, timeout=300)  # one launch: TP 1 (× DP 2), TP 2, PP 2
    return request.param, directory, reference, two


def test_logits_equal_transformers_at_tp1_tp2_and_pp2(imported):
    kind, _, reference, two = imported
    for rank in two:
        torch.testing.assert_close(rank["tp1"]["logits"], reference["logits"], rtol=0, atol=1e-5)
        torch.testing.assert_close(rank["tp2"]["logits"], reference["logits"], rtol=0, atol=1e-5)
    torch.testing.assert_close(two[1]["pp2"]["logits"], reference["logits"], rtol=0, atol=1e-5)


def test_exporting_the_imported_model_gives_back_the_originals_bitwise(imported, tmp_path):
    """to_hf of the TP-1 model's own parameters (the padded vocabulary rows dropped) is the HF state dict; with
    hf_config's config.json, transformers loads it as the original class and computes the original logits."""
    import json

    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    from pretrain.checkpoint.hf import ImportedModel, hf_config, to_hf
    kind, directory, reference, two = imported
    model = ImportedModel(directory).model
    exported = to_hf(two[0]["tp1"]["params"], model, VOCAB)
    original = {k: v for k, v in reference["state"].items() if not k.endswith((".attn.bias", ".attn.masked_bias"))}
    if model["tie_embeddings"]:
        original.pop("lm_head.weight", None)
    assert exported.keys() == original.keys()
    for name, tensor in original.items():
        assert torch.equal(exported[name], tensor), name
    save_file(exported, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    (tmp_path / "config.json").write_text(json.dumps(hf_config(model, VOCAB)))
    hf = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert type(hf).__name__ == json.loads((directory / "config.json").read_text())["architectures"][0]
    with torch.no_grad():
        assert torch.equal(hf(TOKENS).logits, reference["logits"])


def test_continued_pretraining_at_tp2_dp2_stage3_starts_at_transformers_loss(tmp_path):
    """A Llama (vocabulary 256: megatron pads nothing at TP 2, so its loss is over the real vocabulary) imported
    with train.init_from at TP 2 × DP 2, stage 3: the first step's loss is transformers' on the same 8 samples."""
    from gpt_harness import SyntheticTokens, run_gpt_steps
    from hf_models import build
    from pretrain.checkpoint.hf import ImportedModel, model_overrides
    hf = build("llama", vocab=256)
    hf.save_pretrained(tmp_path)
    model = ImportedModel(tmp_path).model
    overrides = model_overrides(model) + ["model.seq_length=16", "parallel.tensor=2", "zero.stage=3",
                                          "train.global_batch_size=8", f'train.init_from="{tmp_path}"']
    ranks = run_ranks(run_gpt_steps, 4, overrides, 2, timeout=300)
    samples = torch.stack([SyntheticTokens(256, 16).sample(i) for i in range(8)])
    with torch.no_grad():
        logits = hf(samples[:, :-1]).logits
    expected = torch.nn.functional.cross_entropy(logits.flatten(0, 1), samples[:, 1:].flatten()).item()
    assert ranks[0]["loss"][0] == pytest.approx(expected, rel=1e-5, abs=0)


class UniformTokens:
    """The test's own samples (not the data path's): ids uniform over the whole vocabulary, the last real ones too."""

    def __init__(self, vocab: int, seq_length: int):
        self.vocab, self.seq_length = vocab, seq_length

    def sample(self, i: int) -> torch.Tensor:
        return torch.randint(0, self.vocab, (self.seq_length + 1,), generator=torch.Generator().manual_seed(5000 + i))


@pytest.mark.parametrize("kind, ranks, layout, seq", [("llama", 4, ["parallel.tensor=2", "zero.stage=3"], 16),
                                                      ("gpt2", 2, ["parallel.tensor=1", "zero.stage=1"], 32)],
                         ids=["llama-tp2-dp2-stage3", "gpt2-tied-tp1-dp2-stage1"])  # GPT-2: its 32 learned positions
def test_an_import_at_a_padded_vocabulary_starts_at_transformers_loss(kind, ranks, layout, seq, tmp_path):
    """Vocabulary 300: megatron pads the output layer to 512 rows at TP 2 (rank 1 holds ids 256..511, 44 real) and
    to 384 at TP 1; the imported padded rows are zero, so a softmax over them would start log(512/300) = 0.53 (TP 2)
    or log(384/300) = 0.25 (TP 1) above transformers. The first step's loss is transformers' on the same 8 samples."""
    from gpt_harness import run_gpt_steps
    from hf_models import build
    from pretrain.checkpoint.hf import ImportedModel, model_overrides
    hf = build(kind, vocab=300)
    hf.save_pretrained(tmp_path)
    overrides = model_overrides(ImportedModel(tmp_path).model) + [
        f"model.seq_length={seq}", "train.global_batch_size=8", f'train.init_from="{tmp_path}"', *layout]
    tokens = UniformTokens(300, seq)
    out = run_ranks(run_gpt_steps, ranks, overrides, 1, None, False, tokens, timeout=300)
    samples = torch.stack([tokens.sample(i) for i in range(8)])
    with torch.no_grad():
        logits = hf(samples[:, :-1]).logits
    expected = torch.nn.functional.cross_entropy(logits.flatten(0, 1), samples[:, 1:].flatten()).item()
    assert out[0]["loss"][0] == pytest.approx(expected, rel=1e-5, abs=0)


LLAMA_KEYS = ['model.position_embedding="rope"', 'model.mlp="swiglu"', 'model.norm="rmsnorm"', "model.num_query_groups=2",
              "model.bias=false", "model.ffn_hidden_size=48"]


def _zero3d_logits(rank, world_size, overrides, params_file):
    """The TP-1 model of these overrides, its parameters from a megatron-format export, on held-out tokens."""
    from safetensors.torch import load_file

    from checkpoint_harness import CKPT_BASE
    from pretrain.config import load_config
    from pretrain.model.gpt import build_model, gpt_inputs
    from pretrain.runtime.layout import init_layout
    cfg = load_config(None, CKPT_BASE + list(overrides) + ["parallel.tensor=1", "model.loss_chunk_tokens=0"])
    topo = init_layout(cfg)
    model = build_model(cfg, topo.device)
    model.load_state_dict(load_file(params_file), strict=False)
    model.eval()
    tokens = torch.randint(0, cfg.model.vocab_size, (2, cfg.model.seq_length + 1),
                           generator=torch.Generator().manual_seed(99))
    inputs, positions, mask, _ = gpt_inputs(tokens)
    with torch.no_grad():
        return {"tokens": inputs, "logits": model(inputs, positions, mask)[..., :cfg.model.vocab_size]}


@pytest.fixture(scope="module")
def corpus_tokenizer(tmp_path_factory):
    """A sentencepiece model zero3d trains on the shipped corpus (vocabulary 384: no padding at TP 1 or 2), and the corpus's documents."""
    from pretrain.data.corpus import read_documents
    from pretrain.data.preprocess import train_tokenizer
    corpus = Path(__file__).resolve().parents[2] / "data" / "corpus.jsonl"
    path = train_tokenizer(corpus, tmp_path_factory.mktemp("sp") / "corpus", 384)
    return path, list(read_documents(corpus))


@pytest.mark.parametrize("kind", ["llama", "gpt2"])
def test_a_run_trained_at_tp2_dp2_stage3_exports_to_transformers(kind, tmp_path, corpus_tokenizer):
    """20 steps at TP 2 × DP 2, stage 3; `export --format hf` with the run's sentencepiece tokenizer:
    AutoModelForCausalLM loads it with no custom code, its logits on held-out tokens equal zero3d's own forward
    within 1e-5, generate() continues a prompt, and AutoTokenizer gives zero3d's ids for every shipped document."""
    import hashlib

    from transformers import AutoModelForCausalLM, AutoTokenizer

    from checkpoint_harness import train_segment
    from pretrain.checkpoint.export import main as export_main
    from pretrain.data.tokenizers import Tokenizer
    sp_model, documents = corpus_tokenizer
    overrides = (LLAMA_KEYS if kind == "llama" else []) + ["parallel.tensor=2", "zero.stage=3", "model.vocab_size=384"]
    # the synthetic-token run records no tokenizer: name the one it stands for, as `--tokenizer` does for a moved file
    identity = {"tokenizer_sha256": hashlib.sha256(sp_model.read_bytes()).hexdigest()}
    run_ranks(train_segment, 4, overrides, tmp_path / "ckpt", 0, 20, (20,), False, 0, True, identity, timeout=300)
    assert export_main([str(tmp_path / "ckpt"), str(tmp_path / "hf"), "--format", "hf", "--tokenizer", str(sp_model)]) == 0
    assert export_main([str(tmp_path / "ckpt"), str(tmp_path / "megatron")]) == 0
    ours, theirs = Tokenizer(sp_model), AutoTokenizer.from_pretrained(tmp_path / "hf")
    assert [theirs(d).input_ids for d in documents] == ours.encode_batch(documents)
    assert theirs.decode(ours.encode(documents[0])) == documents[0]
    (ours,) = run_ranks(_zero3d_logits, 1, overrides, str(tmp_path / "megatron" / "model.safetensors"), timeout=300)
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    assert type(hf).__name__ == ("LlamaForCausalLM" if kind == "llama" else "GPT2LMHeadModel")
    with torch.no_grad():
        logits = hf(ours["tokens"]).logits
    torch.testing.assert_close(logits, ours["logits"], rtol=0, atol=1e-5)
    generated = hf.generate(ours["tokens"][:, :4], max_new_tokens=4, min_new_tokens=4, do_sample=False)
    assert generated.shape == (2, 8) and torch.equal(generated[:, :4], ours["tokens"][:, :4])


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
def test_a_tied_llama_or_qwen3_run_exports_to_transformers_with_its_output_layer(kind, tmp_path, monkeypatch):
    """A Llama-shaped run with model.tie_embeddings = true (Qwen3: its q/k norms too), 2 steps at TP 2, stage 3,
    `export --format hf`: the weights hold no lm_head (it is the embedding), so config.json must say
    tie_word_embeddings, or transformers would give the model a freshly initialised output layer; loaded with no
    custom code, transformers' logits on held-out tokens equal zero3d's own forward within 1e-5. Exported in shards
    (a model above the shard size: here 20 kB), with the index transformers reads, it computes the same logits."""
    import json

    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    from checkpoint_harness import train_segment
    from pretrain.checkpoint.export import main as export_main
    overrides = LLAMA_KEYS + (["model.qk_layernorm=true"] if kind == "qwen3" else []) + [
        "model.tie_embeddings=true", "parallel.tensor=2", "zero.stage=3", "model.vocab_size=384"]
    run_ranks(train_segment, 2, overrides, tmp_path / "ckpt", 0, 2, (2,), timeout=300)
    assert export_main([str(tmp_path / "ckpt"), str(tmp_path / "hf"), "--format", "hf", "--no-tokenizer"]) == 0
    assert export_main([str(tmp_path / "ckpt"), str(tmp_path / "megatron")]) == 0
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert config["tie_word_embeddings"] is True
    with safe_open(str(tmp_path / "hf" / "model.safetensors"), framework="pt") as f:
        assert "lm_head.weight" not in f.keys() and "model.embed_tokens.weight" in f.keys()
    (ours,) = run_ranks(_zero3d_logits, 1, overrides, str(tmp_path / "megatron" / "model.safetensors"), timeout=300)
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    assert type(hf).__name__ == {"llama": "LlamaForCausalLM", "qwen3": "Qwen3ForCausalLM"}[kind]
    assert hf.lm_head.weight.data_ptr() == hf.model.embed_tokens.weight.data_ptr()  # tied, as the run was
    with torch.no_grad():
        logits = hf(ours["tokens"]).logits
    torch.testing.assert_close(logits, ours["logits"], rtol=0, atol=1e-5)
    import pretrain.checkpoint.export as export_module
    monkeypatch.setattr(export_module, "SHARD_BYTES", 20_000)  # the embedding alone, the layers together
    assert export_main([str(tmp_path / "ckpt"), str(tmp_path / "shards"), "--format", "hf", "--no-tokenizer"]) == 0
    index = json.loads((tmp_path / "shards" / "model.safetensors.index.json").read_text())
    shards = sorted(p.name for p in (tmp_path / "shards").glob("model-*.safetensors"))
    assert len(shards) >= 2 and sorted(set(index["weight_map"].values())) == shards
    with torch.no_grad():
        sharded = AutoModelForCausalLM.from_pretrained(tmp_path / "shards").eval()(ours["tokens"]).logits
    assert torch.equal(sharded, logits)
