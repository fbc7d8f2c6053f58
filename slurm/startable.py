"""Can a job start? Checked on the submitting host before anything is queued (slurm/submit.py, also --dry-run and the
job's --preflight): its input files exist, the tokenizer agrees with the model, the layout fits the GPUs. Each
problem is one line; submit.py exits EXIT_INPUT (3) on any."""
import os
from pathlib import Path

from pretrain.config import Config
from pretrain.data.corpus import DataError, expand_inputs
from pretrain.data.tokenizer import Tokenizer, TokenizerError, check_vocab
from pretrain.errors import EXIT_INPUT
from pretrain.memory_check import device_estimate
from zero3d.analysis.estimate import GB

__all__ = ["EXIT_INPUT", "refusals"]


def _at(root: Path, path: str) -> str:
    """A config path as the job reads it: relative ones from the repository root it runs in."""
    return path if os.path.isabs(path) else str(root / path)


def input_refusals(cfg: Config, root: Path) -> list:
    """data.tokenizer_model must load and fit model.vocab_size; with a blend every prefix's .bin/.idx must be
    there, else data.corpus must name JSONL files (its tokenizer, unless given, is trained at start-up)."""
    data, out = cfg.data, []
    if data.tokenizer_model is not None:
        try:
            check_vocab(Tokenizer(_at(root, data.tokenizer_model)), cfg.model.vocab_size)
        except (TokenizerError, DataError) as err:
            out.append(f"data.tokenizer_model: {err}")
    if data.blends():
        from pretrain.data.indexed import check_indexed_dataset  # megatron-core: imported only when needed
        for key, (prefixes, _) in data.blends().items():
            for prefix in prefixes:
                try:
                    check_indexed_dataset(_at(root, prefix))
                except DataError as err:
                    out.append(f"data.{key}: {err}")
    else:
        try:
            expand_inputs([_at(root, data.corpus)])
        except DataError as err:
            out.append(f"data.corpus: {err}")
    return out


def memory_refusal(cfg: Config, world: int) -> list:
    """The layout's estimated device memory against cluster.gpu_memory_gb (what the start-up guard refuses on
    the GPUs), unless train.ignore_memory_estimate."""
    if cfg.train.ignore_memory_estimate:
        return []
    estimate, _ = device_estimate(cfg, world, cfg.cluster.gpu_memory_bytes)
    if estimate.fits:
        return []
    return [f"the memory estimate {estimate.total_bytes / GB:.2f} GB exceeds cluster.gpu_memory_gb = "
            f"{cfg.cluster.gpu_memory_gb:g} GiB ({cfg.cluster.gpu_memory_bytes / GB:.2f} GB) on {world} GPUs "
            f"({cfg.cluster.gpu}); python -m pretrain --estimate shows where it goes, train.ignore_memory_estimate"
            " = true runs anyway"]


def refusals(cfg: Config, world: int, root: Path, memory: bool = True) -> list:
    """Every reason the job cannot start, one line each (none: it can); `memory`: the GPU memory check too."""
    return input_refusals(cfg, root) + (memory_refusal(cfg, world) if memory else [])
