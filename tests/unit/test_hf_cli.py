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

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
LAUNCHER_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "SLURM_PROCID", "SLURM_NTASKS",
                 "SLURM_LOCALID", "SLURM_JOB_ID", "SLURM_NODELIST", "SLURM_STEP_NODELIST", "ZERO3D_DEBUG")


class Payload:
    """Unpickling this would create the file it names: the proof that nothing was unpickled."""

    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return (open, (str(self.path), "w"))


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
    "unsupported-architecture": (_edit(architectures=["MistralForCausalLM"]),
                                 "architecture 'MistralForCausalLM' is not supported (checkpoint): supported: GPT2LMHeadModel"),
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
