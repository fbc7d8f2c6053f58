"""Can a job start? Checked on the submitting host before anything is queued (slurm/submit.py, also --dry-run and the
job's --preflight): its input files exist, the tokenizer agrees with the model, the layout fits the GPUs. Each
problem is one line; submit.py exits EXIT_INPUT (3) on any."""
import contextlib
from pathlib import Path

from analysis.estimate import GB
from pretrain.config import Config
from pretrain.data.tokenizers import check_vocab, load_tokenizer, spec_of
from pretrain.errors import EXIT_INPUT, ConfigError, DataError, InputError, TokenizerError
from pretrain.memory_check import device_estimate, gpu_budget_bytes
from pretrain.runtime.preflight import check_paths

__all__ = ["EXIT_INPUT", "refusals"]


def input_refusals(cfg: Config, root: Path) -> list:
    """From `root`, the directory the job runs in: the paths every rank checks at start-up (pretrain's
    check_paths: the tokenizer model, every blend prefix's .bin/.idx or the corpus, the directories it writes),
    then the tokenizer against model.vocab_size. The first problem of each, one line."""
    with contextlib.chdir(root):
        try:
            check_paths(cfg)
        except (InputError, ConfigError) as err:
            return [str(err)]
        spec = spec_of(cfg.data, cfg.model.vocab_size)
        if spec.model is not None or spec.kind == "none":  # a tokenizer to load (not one trained at start-up)
            try:
                check_vocab(load_tokenizer(spec), cfg.model.vocab_size)
            except (TokenizerError, DataError) as err:
                return [f"data.tokenizer_model: {err}"]
    return []


def memory_refusal(cfg: Config, world: int) -> list:
    """The layout's estimated device memory against cluster.gpu_memory_gb (what the start-up guard refuses on
    the GPUs), unless train.ignore_memory_estimate."""
    if cfg.train.ignore_memory_estimate:
        return []
    estimate, _ = device_estimate(cfg, world, gpu_budget_bytes(cfg.cluster))
    if estimate.fits:
        return []
    return [f"the memory estimate {estimate.total_bytes / GB:.2f} GB exceeds cluster.gpu_memory_gb = "
            f"{cfg.cluster.gpu_memory_gb:g} GiB ({gpu_budget_bytes(cfg.cluster) / GB:.2f} GB) on {world} GPUs "
            f"({cfg.cluster.gpu}); python -m pretrain --estimate shows where it goes, train.ignore_memory_estimate"
            " = true runs anyway"]


def refusals(cfg: Config, world: int, root: Path, memory: bool = True) -> list:
    """Every reason the job cannot start, one line each (none: it can); `memory`: the GPU memory check too."""
    return input_refusals(cfg, root) + (memory_refusal(cfg, world) if memory else [])
