"""The Hugging Face paths as the commands users run: a bad `train.init_from` directory is one line and exit 3
before any data work, the run directory untouched and nothing unpickled; `export --format hf` into an existing
directory is exit 2 before the checkpoint is read."""
import json
import os
import pickle

import pytest

from cli_fork import run_pretrain_cli
from hf_models import save
from pretrain.checkpoint.export import main as export_main
from pretrain.errors import EXIT_CONFIG, EXIT_INPUT
from pretrain.runtime.status import write_status
from test_hf_import import Payload  # unpickling it would create a file: the proof nothing was unpickled

pytestmark = pytest.mark.one_core  # one process, tens of seconds: the side lane (tools/run_suite.py)

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
LAUNCHER_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "SLURM_PROCID", "SLURM_NTASKS",
                 "SLURM_LOCALID", "SLURM_JOB_ID", "SLURM_NODELIST", "SLURM_STEP_NODELIST", "ZERO3D_DEBUG")


def _pickled(d, tmp):
    (d / "model.safetensors").unlink()
    (d / "pytorch_model.bin").write_bytes(pickle.dumps(Payload(tmp / "pwned")))


def _edit(**keys):
    def edit(d, tmp):
        config = json.loads((d / "config.json").read_text())
        config.update(keys)
        (d / "config.json").write_text(json.dumps(config))
    return edit


def _shard_missing(d, tmp):
    (d / "model.safetensors").rename(d / "model-00001-of-00002.safetensors")
    (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {
        "model.norm.weight": "model-00001-of-00002.safetensors", "lm_head.weight": "model-00002-of-00002.safetensors"}}))


CASES = {  # (how the saved Llama is damaged, what the one line says)
    "pickle": (_pickled, "are pickles, which zero3d never loads"),
    "config-disagrees-with-tensors": (_edit(intermediate_size=96), "config.json describes [48, 96]"),
    "missing-shard": (_shard_missing, "names shard 'model-00002-of-00002.safetensors', which is missing"),
    "unsupported-architecture": (_edit(architectures=["Phi3ForCausalLM"]),
                                 "architecture 'Phi3ForCausalLM' is not supported (checkpoint): supported: GPT2LMHeadModel"),
    "window-shorter-than-the-run": (_edit(architectures=["MistralForCausalLM"], sliding_window=16),
                                    "model.sliding_window = None (it has 16)"),
    "auto_map": (_edit(auto_map={"AutoModelForCausalLM": "x.Model"}), "names remote code (auto_map)"),
    "another-model": (lambda d, tmp: None, "holds another model: model.num_layers = 1 (it has 2)"),
}


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("llama")
    save("llama", directory)
    return directory


@pytest.mark.parametrize("case", list(CASES))
def test_a_bad_init_from_is_one_line_and_exit_3_before_any_data_work(tmp_path, llama_dir, case):
    damage, line = CASES[case]
    hf = tmp_path / "hf"
    hf.mkdir()
    for f in llama_dir.iterdir():
        (hf / f.name).write_bytes(f.read_bytes())
    damage(hf, tmp_path)
    run_dir = tmp_path / "run"
    write_status(run_dir, "ok", "", 4, 10, 0)  # a previous run's: a refused start keeps its bytes
    before = {p.name: p.read_bytes() for p in run_dir.iterdir()}
    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_VARS}
    llama = ['model.position_embedding="rope"', 'model.mlp="swiglu"', 'model.norm="rmsnorm"', "model.bias=false",
             "model.hidden_size=48", "model.num_attention_heads=6", "model.num_query_groups=2", "model.num_layers=1",
             "model.ffn_hidden_size=80", "model.vocab_size=250", "model.rope_base=500000"]
    out = run_pretrain_cli(["--config", "configs/tiny.toml", *llama, "logging.wandb=false", "train.steps=2", "parallel.tensor=1",
                            f"logging.run_dir={json.dumps(str(run_dir))}", f"train.init_from={json.dumps(str(hf))}",
                            f"data.cache_dir={json.dumps(str(tmp_path / 'cache'))}"], env, REPO, timeout=120)
    assert out.returncode == EXIT_INPUT, out.stderr
    assert out.stderr.count("\n") == 1 and out.stderr.startswith("error: ") and line in out.stderr, out.stderr
    assert {p.name: p.read_bytes() for p in run_dir.iterdir()} == before
    assert not (tmp_path / "cache").exists()  # refused before the tokenizer was trained or the corpus tokenized
    assert not (tmp_path / "pwned").exists()



def test_init_from_a_learned_position_model_at_a_longer_sequence_is_refused(tmp_path):
    """GPT-2's position table holds n_positions = 32 rows: a run at model.seq_length = 64 would need rows it does not
    have (RoPE's sequence length is free: test_hf_import.py). One line naming the key, exit 3, before any data work."""
    from pretrain.checkpoint.hf import ImportedModel, model_overrides
    hf = tmp_path / "gpt2"
    save("gpt2", hf)
    overrides = model_overrides(ImportedModel(hf).model)  # what `python -m pretrain.hf_config` prints, as overrides
    assert "model.seq_length=32" in overrides
    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_VARS}
    out = run_pretrain_cli(["--config", "configs/tiny.toml", *overrides, "model.seq_length=64", "logging.wandb=false",
                            "train.steps=2", "parallel.tensor=1", f"logging.run_dir={json.dumps(str(tmp_path / 'run'))}",
                            f"train.init_from={json.dumps(str(hf))}",
                            f"data.cache_dir={json.dumps(str(tmp_path / 'cache'))}"], env, REPO, timeout=120)
    assert out.returncode == EXIT_INPUT, out.stderr
    assert out.stderr.count("\n") == 1, out.stderr
    assert out.stderr.startswith(f"error: train.init_from = {str(hf)!r} holds another model: model.seq_length = 64 "
                                 "(it has 32) (python -m pretrain.hf_config"), out.stderr
    assert not (tmp_path / "run").exists() and not (tmp_path / "cache").exists()

def test_export_into_an_existing_directory_is_exit_2_before_the_checkpoint_is_read(tmp_path, capsys):
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("mine\n")
    assert export_main([str(tmp_path / "no-such-checkpoint"), str(out), "--format", "hf"]) == EXIT_CONFIG
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "already exists and holds notes.txt; pass --overwrite" in err
    assert [p.name for p in out.iterdir()] == ["notes.txt"]
    assert export_main([str(tmp_path / "ckpt"), str(tmp_path / "new"), "--tokenizer", "x.model"]) == EXIT_CONFIG
    assert capsys.readouterr().err == "export: --tokenizer and --no-tokenizer apply to --format hf only\n"
    assert not (tmp_path / "new").exists()


TINY = ["--config", "configs/tiny.toml", "parallel.tensor=1", "model.num_layers=1", "model.hidden_size=32",
        "model.num_attention_heads=4", "model.seq_length=16", "model.vocab_size=384", "train.micro_batch_size=2",
        "train.global_batch_size=2", "train.eval_interval=0", "train.steps=2", "optimizer.warmup_steps=0",
        "zero.bucket_elements=1000", "logging.wandb=false", "logging.console=plain"]


def run_tiny(tmp_path, *overrides):
    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_VARS} | {"OMP_NUM_THREADS": "1"}
    return run_pretrain_cli([*TINY, f"logging.run_dir={json.dumps(str(tmp_path / 'run'))}",
                             f"data.cache_dir={json.dumps(str(tmp_path / 'cache'))}", *overrides], env, REPO, timeout=300)


def test_save_final_hf_writes_what_export_writes_after_the_last_step(tmp_path):
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, AutoTokenizer
    out = run_tiny(tmp_path, f"train.save_final_hf={json.dumps(str(tmp_path / 'final'))}")
    assert out.returncode == 0, out.stderr[-3000:]
    assert f"train.save_final_hf: wrote 17 tensors and the tokenizer to {tmp_path / 'final'}" in out.stdout
    assert json.loads((tmp_path / "run" / "status.json").read_text())["status"] == "ok"
    assert export_main([str(tmp_path / "run" / "checkpoints"), str(tmp_path / "export"), "--format", "hf"]) == 0
    final, export = load_file(tmp_path / "final" / "model.safetensors"), load_file(tmp_path / "export" / "model.safetensors")
    assert final.keys() == export.keys() and all(final[k].equal(export[k]) for k in final)
    for name in ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json"):
        assert (tmp_path / "final" / name).read_bytes() == (tmp_path / "export" / name).read_bytes(), name
    assert type(AutoModelForCausalLM.from_pretrained(tmp_path / "final")).__name__ == "GPT2LMHeadModel"
    assert AutoTokenizer.from_pretrained(tmp_path / "final").eos_token == "</s>"
    # generate() stops at the id the run ended its documents with: the run's tokenizer's end-of-document id
    from pretrain.data.tokenizers import Tokenizer
    (model,) = (tmp_path / "cache").glob("tokenizer-*.model")
    ours = Tokenizer(model)
    for name in ("config.json", "generation_config.json"):
        config = json.loads((tmp_path / "final" / name).read_text())
        assert (config["eos_token_id"], config["bos_token_id"]) == (ours.eod_id, ours.bos_id) == (2, 1), name


@pytest.mark.parametrize("case", ["holds-a-file", "save-final-off", "no-hf-class"])
def test_save_final_hf_is_refused_at_the_start(tmp_path, case):
    target = tmp_path / "final"
    overrides = [f"train.save_final_hf={json.dumps(str(target))}"]
    if case == "holds-a-file":
        target.mkdir()
        (target / "notes.txt").write_text("mine\n")
        line = (f"error: train.save_final_hf = {str(target)!r} is invalid (config): it holds notes.txt: give a new or "
                "empty directory (an export is never written over)")
    elif case == "save-final-off":
        overrides.append("train.save_final=false")
        line = f"error: train.save_final_hf = {str(target)!r} is invalid with train.save_final = false (config): "
    else:
        overrides.append('model.position_embedding="rope"')  # RoPE with GPT-2's GELU MLP: no HF class
        line = (f"error: train.save_final_hf = {str(target)!r} is invalid for this model (config): no Hugging Face "
                "architecture computes this model (position_embedding = 'rope', mlp = 'gelu'")
    out = run_tiny(tmp_path, *overrides)
    assert out.returncode == EXIT_CONFIG, out.stderr[-3000:]
    assert out.stderr.count("\n") == 1 and out.stderr.startswith(line), out.stderr
    assert not (tmp_path / "run").exists() and not (tmp_path / "cache").exists()
    assert ([p.name for p in target.iterdir()] == ["notes.txt"]) if case == "holds-a-file" else not target.exists()


def test_export_without_transformers_names_the_extra(monkeypatch):
    """transformers is a test dependency and the `hf` extra, not the runtime's: its absence is one line."""
    import sys

    from pretrain.checkpoint.export import hf_tokenizer
    from pretrain.errors import CheckpointError
    from pretrain.data.tokenizers import TokenizerSpec
    monkeypatch.setitem(sys.modules, "transformers", None)  # import transformers raises ImportError
    with pytest.raises(CheckpointError, match=r"transformers, which is not installed: pip install 'transformers==5\.24\.0' "
                                              r"\(the `hf` extra\), or pass --no-tokenizer"):
        hf_tokenizer(TokenizerSpec("sentencepiece", "unused.model"), 16)
    # train.save_final_hf says so at the start, not after the run
    import importlib.util

    from pretrain.checkpoint.export import check_save_final_hf
    from pretrain.config import load_config
    from pretrain.errors import ConfigError
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "transformers" else find_spec(name, *a))
    with pytest.raises(ConfigError, match=r"train.save_final_hf = 'out' is invalid here; transformers is not installed"):
        check_save_final_hf(load_config(None, ['train.save_final_hf="out"']))
