"""Writes configs/paper/*.toml, one per job of the ZeRO paper's reproduction CSV (run with --check in CI)."""
import argparse
import csv
import json
import math
import sys
from dataclasses import dataclass
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
# "facts §N" cites section N of docs/zero-paper-facts.md, the paper facts this project is held to.
sys.path.insert(0, str(REPO_ROOT))
from pretrain.config import ConfigError, load_config, validate_layout  # noqa: E402
from analysis.paper_configs import FIGURE4, paper_expectation, zero_choices as paper_zero_choices  # noqa: E402
from analysis.planner import PAPER_CONFIGS  # noqa: E402

# The vendored copy when the repo has one, else the shared one beside the checkout; both are identical.
DEFAULT_CSV = REPO_ROOT / "configs/paper/reproduction-configs.csv"  # the paper appendix's configurations
DEFAULT_OUT = REPO_ROOT / "configs/paper"
GPT2_VOCAB = 50257
# The paper's data: OpenWebText (facts §4.2) in GPT-2's BPE, 50,257 tokens (§4.5's labels count 50257·h of
# embeddings). Its two files are the user's to supply (nothing is downloaded); every job names them here, relative
# to the repository root the job runs in (slurm/README.md, Data). Missing, slurm/submit.py refuses the job in one
# line before it queues.
GPT2_VOCAB_JSON = "data/gpt2/vocab.json"
GPT2_MERGES_TXT = "data/gpt2/merges.txt"
SEQ_LENGTH = 1024  # facts §4.3: the only sequence length in the paper
STEPS = 100  # a throughput run: enough steps for a median after warm-up
# CB: the paper gives no size. 50M elements is 100 MB per bucket in 16-bit (200 MB in fp32): messages
# that large already run NCCL at full bus bandwidth, while DeepSpeed's later 5e8 default would pin
# 1-2 GB per buffer on a 32 GB V100, the residual memory CB exists to bound. It is also the value
# analysis.estimate (DEFAULT_BUCKET_ELEMENTS) assumes, so the estimator's verdicts hold for these files.
BUCKET_ELEMENTS = 50_000_000
# Table III (docs/zero-paper-facts.md §4.4): (stage, Pa, Pa+cpu); CB + MD are on in all five.
ZERO_CONFIGS = {name: (z.stage, z.pa, z.pa_cpu) for name, z in PAPER_CONFIGS.items()}
ASSUMED_TFLOPS_PER_GPU = 10.0  # for time limits: a quarter of the paper's ZeRO rate covers slow baselines


class GeneratorError(ValueError):
    """A CSV row breaks a layout rule; the message names the row and the rule."""


@dataclass(frozen=True)
class Row:
    line: int  # 1-based line in the CSV file
    text: str
    figure: int
    model: str
    system: str
    gpus: list
    mp: int
    layers: int
    hidden: int
    heads: int
    batch: list
    total: list

    def where(self) -> str:
        return f"CSV line {self.line} (figure {self.figure}, {self.model} {self.system}: {self.text!r})"


def read_rows(path: Path) -> list:
    rows = []
    lines = Path(path).read_text().splitlines()
    data = [(n, line) for n, line in enumerate(lines, start=1) if line.strip() and not line.startswith("#")]
    header = next(csv.reader([data[0][1]]))
    for n, line in data[1:]:
        values = dict(zip(header, next(csv.reader([line]))))
        try:
            lists = {k: [int(v) for v in values[k].split(";")] for k in ("gpus", "batch_per_gpu", "total_batch")}
            rows.append(Row(n, line, int(values["figure"]), values["model"], values["system"], lists["gpus"],
                            int(values["mp"]), int(values["layers"]), int(values["hidden"]),
                            int(values["heads"]), lists["batch_per_gpu"], lists["total_batch"]))
        except (KeyError, ValueError) as err:
            raise GeneratorError(f"{path} line {n} ({line!r}) is malformed: {err!r}; expected columns "
                                 f"{', '.join(header)}") from None
    return rows


def check_row(row: Row) -> None:
    """The paper's own layout rules (facts §4.3, §9.A.8); each failure names its rule."""
    def require(ok, rule):
        if not ok:
            raise GeneratorError(f"{row.where()} violates {rule}")
    require(row.system in ("zero", "baseline"), f"system in (zero, baseline) ({row.system!r})")
    require(row.figure != 4 or row.system == "baseline" or row.model in FIGURE4,
            f"figure 4 sizes map to C1..C5 as {FIGURE4} (facts §4.8)")
    require(row.hidden % row.heads == 0, f"hidden % heads == 0 ({row.hidden} % {row.heads})")
    require(row.heads % row.mp == 0, f"heads % mp == 0 ({row.heads} % {row.mp})")
    require(row.hidden % row.mp == 0, f"hidden % mp == 0 ({row.hidden} % {row.mp})")
    n = max(len(row.gpus), len(row.batch))
    require(all(len(x) in (1, n) for x in (row.gpus, row.batch, row.total)),
            "one value or the same number of ';'-separated values in gpus, batch_per_gpu, total_batch")
    require(row.figure not in (5, 6) or n == 1 or (row.figure == 6 and n <= len(ZERO_CONFIGS)),
            "figure 5 rows list one job (it runs C1..C5); figure 6 rows at most five, one per C1..C5")
    for gpus, batch, total in jobs_of(row):
        require(gpus % row.mp == 0, f"gpus % mp == 0 ({gpus} % {row.mp})")
        require(total == batch * gpus // row.mp,
                f"total_batch == batch_per_gpu × gpus / mp ({total} != {batch} × {gpus} / {row.mp})")


def jobs_of(row: Row) -> list:
    n = max(len(row.gpus), len(row.batch), len(row.total))
    widen = (lambda xs: xs * n if len(xs) == 1 else xs)
    return list(zip(widen(row.gpus), widen(row.batch), widen(row.total)))


def zero_choices(row: Row) -> list:
    """[(C-label or None, note)] per job: the ZeRO settings the paper used for this row
    (analysis.paper_configs, which `--plan csv` judges with too)."""
    return paper_zero_choices(row.figure, row.model, row.system, row.mp, len(jobs_of(row)))


def job_name(row: Row, label, gpus: int) -> str:
    name = f"fig{row.figure}_{row.model.replace('.', 'p')}_{row.system}"
    if len(row.gpus) > 1:
        name += f"_gpus{gpus}"
    if label and row.figure in (4, 5, 6):
        name += f"_{label.lower()}"
    return name


def time_limit(row: Row, total: int, gpus: int) -> str:
    """HH:MM:SS for STEPS steps at ASSUMED_TFLOPS_PER_GPU, plus 30 min of start-up, in 30 min units."""
    h, tokens = row.hidden, total * SEQ_LENGTH
    flops = 96 * tokens * row.layers * h * h * (1 + SEQ_LENGTH / (6 * h)) + 6 * tokens * h * GPT2_VOCAB
    minutes = STEPS * flops / (gpus * ASSUMED_TFLOPS_PER_GPU * 1e12) / 60 + 30
    minutes = 30 * math.ceil(minutes / 30)
    return f"{minutes // 60:02d}:{minutes % 60:02d}:00"


def render(row: Row, label, note: str, gpus: int, batch: int, total: int,
           gpus_per_node: int, dtype: str, gpu: str, gpu_memory_gb: float, name: str) -> str:
    nodes = math.ceil(gpus / gpus_per_node)
    if nodes * gpus_per_node != gpus:
        if gpus % nodes:
            raise GeneratorError(f"{row.where()}: {gpus} GPUs cannot be spread evenly over nodes of "
                                 f"{gpus_per_node} GPUs; choose another --gpus-per-node")
        gpus_per_node = gpus // nodes  # fewer GPUs on each node, same world size as the paper
    stage, pa, cpu = ZERO_CONFIGS[label] if label else (0, False, False)
    if pa and row.mp == 1:
        raise GeneratorError(f"{row.where()}: {label} partitions activations over tensor parallelism, "
                             "which this row does not use (mp = 1)")
    b = lambda v: "true" if v else "false"  # noqa: E731
    return "\n".join([
        "# GENERATED by configs/generate_paper.py from reproduction-configs.csv (the paper's artifact "
        "appendix); do not edit, re-run the generator.",
        f"# CSV line {row.line}: {row.text}",
        f"# Figure {row.figure} (appendix numbering, facts §8.1), {row.model} {row.system}, {gpus} GPUs"
        + (f", ZeRO configuration {label}" if label else "") + ".",
        f"# ZeRO settings: {note}.",
        f"# Data: GPT-2's BPE, its vocab.json and merges.txt supplied at {GPT2_VOCAB_JSON} and {GPT2_MERGES_TXT};",
        "# the demo corpus, named, until ~data.corpus data.blend=... names OpenWebText .bin/.idx made with them "
        "(slurm/README.md).",
        "",
        "[model]",
        f"num_layers = {row.layers}", f"hidden_size = {row.hidden}", f"num_attention_heads = {row.heads}",
        f"seq_length = {SEQ_LENGTH}", f"vocab_size = {GPT2_VOCAB}",
        'recompute = "full"  # the paper always checkpoints activations (facts §7)',
        'attention = "local"  # the paper\'s Megatron: attention scores materialized (the estimator models them)',
        "loss_chunk_tokens = 0  # the paper's Megatron: the loss over all tokens' logits at once",
        "", "[parallel]", f"tensor = {row.mp}",
        "", "[zero]", f"stage = {stage}",
        f"partition_activations = {b(pa)}", f"cpu_checkpointing = {b(cpu)}",
        f"contiguous_checkpointing = {b(stage > 0)}  # MD: on in every ZeRO configuration",
        f"bucket_elements = {BUCKET_ELEMENTS:_}  # CB (see configs/generate_paper.py)",
        "", "[optimizer]", "lr = 1.5e-4", "min_lr = 1.5e-5", "warmup_steps = 10",
        "", "[precision]", f'dtype = "{dtype}"' + (
            "  # the paper's fp16 mixed precision with dynamic loss scaling (precision.* defaults; facts §7)"
            if dtype == "fp16" else ""),
        "", "[data]", 'tokenizer_kind = "gpt2_bpe"  # the paper\'s GPT-2 vocabulary (vocab_size 50257)',
        f'tokenizer_model = "{GPT2_VOCAB_JSON}"  # GPT-2\'s vocab.json, supplied by you (slurm/README.md, Data)',
        f'tokenizer_merges = "{GPT2_MERGES_TXT}"  # GPT-2\'s merges.txt, beside it',
        'corpus = "data/corpus.jsonl"  # the demo corpus (throughput runs); OpenWebText: ~data.corpus data.blend=...',
        'cache_dir = "runs/data"',
        "", "[train]", f"steps = {STEPS}", f"micro_batch_size = {batch}", f"global_batch_size = {total}",
        "eval_interval = 0  # a throughput run",
        "save_final = false  # no multi-TB checkpoint at the end (a stop signal still saves one)",
        "", "[logging]", f'name = "{name}"', f'wandb_group = "fig{row.figure}"',
        "", "[cluster]", f"nodes = {nodes}", f"gpus_per_node = {gpus_per_node}", f'gpu = "{gpu}"',
        f"gpu_memory_gb = {gpu_memory_gb:g}  # GiB", f'time_limit = "{time_limit(row, total, gpus)}"',
        *paper_section(row, label), ""])


def paper_section(row: Row, label) -> list:
    """[paper] expected = "oom" for a job the paper reports out of memory (slurm/sweep.py skips it)."""
    expected, reason = paper_expectation(row.figure, row.model, label)
    if expected == "run":
        return []
    return ["", "[paper]", f'expected = "{expected}"', f"reason = {json.dumps(reason, ensure_ascii=False)}"]


NO_BF16 = ("V100", "P100", "T4")  # GPUs without bf16 arithmetic


def generate(csv_path=DEFAULT_CSV, gpus_per_node: int = 16, dtype: str = "fp16", gpu: str = "V100",
             gpu_memory_gb: float = 32.0) -> dict:
    """{file name: TOML text} for every job; raises GeneratorError naming the first bad row."""
    if dtype == "bf16" and gpu in NO_BF16:
        raise GeneratorError(f"--dtype bf16 with --gpu {gpu}: the {gpu} has no bf16; use --dtype fp16 (the "
                             "paper's mixed precision) or name a GPU with bf16 (A100, H100, H200)")
    files = {}
    for row in read_rows(Path(csv_path)):
        check_row(row)
        jobs, choices = jobs_of(row), zero_choices(row)
        if len(jobs) == 1:  # Figure 5: one shape, run once per configuration
            jobs = jobs * len(choices)
        for (gpus, batch, total), (label, note) in zip(jobs, choices, strict=True):
            name = job_name(row, label, gpus)
            if f"{name}.toml" in files:
                raise GeneratorError(f"{row.where()} gives a second job named {name}")
            text = render(row, label, note, gpus, batch, total, gpus_per_node, dtype, gpu,
                          gpu_memory_gb, name)
            files[f"{name}.toml"] = text
    return files


def validate_text(name: str, text: str, scratch: Path) -> None:
    """The generated file must load and its layout divide at world = nodes × gpus_per_node."""
    path = scratch / name
    path.write_text(text)
    try:
        cfg = load_config(path)
        validate_layout(cfg, cfg.cluster.nodes * cfg.cluster.gpus_per_node)
    except ConfigError as err:
        raise GeneratorError(f"generated {name} is invalid: {err}") from None


def _shown(path: Path) -> str:
    """A path as the user would type it from the repository root."""
    return str(path.relative_to(REPO_ROOT)) if path.is_relative_to(REPO_ROOT) else str(path)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--csv", default=str(DEFAULT_CSV), help="reproduction-configs.csv")
    parser.add_argument("--out", help="directory for the .toml files (required to write; --check compares "
                        f"against {_shown(DEFAULT_OUT)} unless given)")
    parser.add_argument("--gpus-per-node", type=int, default=16, help="16 = DGX-2 as in the paper")
    parser.add_argument("--dtype", default="fp16", choices=["bf16", "fp16"],
                        help="fp16 (default): the paper's mixed precision, the only one V100s have")
    parser.add_argument("--gpu", default="V100", help="cluster.gpu")
    parser.add_argument("--gpu-memory-gb", type=float, default=32.0, help="cluster.gpu_memory_gb, in GiB")
    parser.add_argument("--check", action="store_true", help="exit 1 if --out differs from what would be written")
    args = parser.parse_args(argv)
    if args.out is None and not args.check:
        parser.error(f"--out is required to write: a new directory, e.g. --out configs/paper{args.gpus_per_node}gpn "
                     f"({_shown(DEFAULT_OUT)} is the committed set; --check compares against it)")
    import tempfile
    try:
        files = generate(args.csv, args.gpus_per_node, args.dtype, args.gpu, args.gpu_memory_gb)
        with tempfile.TemporaryDirectory() as scratch:
            for name, text in files.items():
                validate_text(name, text, Path(scratch))
    except (GeneratorError, OSError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    out = Path(args.out) if args.out is not None else DEFAULT_OUT
    existing = {p.name: p.read_text() for p in out.glob("*.toml")} if out.is_dir() else {}
    if args.check:
        stale = sorted(n for n in files if existing.get(n) != files[n])
        extra = sorted(set(existing) - set(files))
        for n in stale:
            print(f"{out / n}: differs from the generated file" if n in existing else f"{out / n}: missing")
        for n in extra:
            print(f"{out / n}: not produced by the generator")
        if stale or extra:
            print(f"run: python configs/generate_paper.py --out {out}", file=sys.stderr)
            return 1
        print(f"{len(files)} files in {out} match the generator")
        return 0
    out.mkdir(parents=True, exist_ok=True)
    for name, text in files.items():
        if existing.get(name) != text:
            (out / name).write_text(text)
    print(f"wrote {len(files)} configs to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
