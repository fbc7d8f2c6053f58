"""`python tools/families_gpu_check.py` on one GPU (docs/families.md): the published families imported on CUDA
(megatron's GPU config: its fusions, SDPA's kernels) against transformers on the same GPU in fp32; exact GELU under
the GPU fusions, beside the fusion main configured (megatron's tanh bias-GELU for any biased MLP); the issue's
published shapes at one layer with their real vocabulary and MLP; a Qwen3-0.6B-shaped import trained 3 bf16 steps at
ZeRO stage 3. One process, world 1; each part a line of the report ($OUT/report.json, else
runs/families-gpu-check/report.json), a part that fails a line too. Without CUDA it runs on CPU (DRY=1: the small
parts only, the real vocabularies left out) to catch mistakes before a GPU attempt; on a CPU of 2 loaded cores that
dry run took about 8 minutes."""
import copy
import json
import os
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO), str(REPO / "tests")]
os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                  MASTER_PORT="29533")
import torch  # noqa: E402

T0 = time.time()
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # cpu: a dry run of the script (DRY=1 skips the big parts)
DRY = os.environ.get("DRY") == "1"
OUT = Path(os.environ.get("OUT") or REPO / "runs" / "families-gpu-check")
REPORT = []


def say(line):
    print(f"[{time.time() - T0:6.1f}s] {line}", flush=True)
    REPORT.append(line)


def zero3d_logits(directory, tokens, extra=()):
    from pretrain.checkpoint.hf import ImportedModel, load_into, model_overrides
    from pretrain.config import load_config
    from pretrain.model.gpt import build_model, gpt_inputs
    from pretrain.runtime.layout import destroy_model_parallel_groups, init_layout
    imported = ImportedModel(Path(directory))
    rope = imported.model["position_embedding"] == "rope"
    cfg = load_config(None, ["logging.wandb=false", "model.loss_chunk_tokens=0", "train.micro_batch_size=1",
                             "train.global_batch_size=1", *model_overrides(imported.model),
                             *([f"model.seq_length={tokens.shape[1]}"] if rope else []), *extra])
    topo = init_layout(cfg)
    model = build_model(cfg, topo.device)
    load_into(model, imported)
    model.eval()
    inputs, positions, mask, _ = gpt_inputs(torch.cat([tokens, tokens[:, :1]], dim=1).to(topo.device))
    with torch.no_grad():
        out = model(inputs, positions, mask)[..., :cfg.model.vocab_size].float().cpu()
    fused = model.config.bias_activation_fusion
    del model
    destroy_model_parallel_groups()
    if DEVICE == "cuda":
        torch.cuda.empty_cache()
    return out, fused


def hf_logits(model, tokens):
    model = model.to(DEVICE).eval()
    with torch.no_grad():
        out = model(tokens.to(DEVICE)).logits.float().cpu()
    model.cpu()
    return out


def families():
    from hf_models import FAMILIES, FAMILY_SEQ, build_family, family_tokens
    for kind in FAMILIES:
        d = tempfile.mkdtemp()
        model = build_family(kind, 256)
        model.save_pretrained(d)
        tokens = family_tokens(256)[:, :FAMILY_SEQ]
        ref = hf_logits(model, tokens)
        got, fused = zero3d_logits(d, tokens)
        say(f"family {kind}: max |logit diff| {float((got - ref).abs().max()):.3g} (logits up to "
            f"{float(ref.abs().max()):.3g}; bias_activation_fusion {fused})")


def exact_gelu():
    """GPT-2 with exact GELU (activation_function "gelu"), weights scaled so GELU's curve matters: this branch's
    config, then megatron's fused bias-GELU as main configured it (bias_activation_fusion on for any biased MLP)."""
    import pretrain.model.gpt as gpt
    from transformers import GPT2Config, GPT2LMHeadModel

    from hf_models import randomise_vectors
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=256, n_positions=64, n_embd=64, n_layer=2, n_head=4,
                                       activation_function="gelu", initializer_range=0.3)).eval()
    randomise_vectors(model)
    d = tempfile.mkdtemp()
    model.save_pretrained(d)
    tokens = torch.randint(0, 256, (2, 64), generator=torch.Generator().manual_seed(1))
    ref = hf_logits(model, tokens)
    got, fused = zero3d_logits(d, tokens)
    say(f"exact GELU, this branch (fusion {fused}): max |logit diff| {float((got - ref).abs().max()):.3g}")
    original = gpt.transformer_config

    def mains(cfg, on_cuda, zero_recompute=False):
        config = original(cfg, on_cuda, zero_recompute)
        config.bias_activation_fusion = on_cuda and (cfg.model.bias or cfg.model.mlp == "swiglu")
        return config
    gpt.transformer_config = mains
    try:
        got, fused = zero3d_logits(d, tokens)
    finally:
        gpt.transformer_config = original
    say(f"exact GELU, main's fusion (fusion {fused}): max |logit diff| {float((got - ref).abs().max()):.3g}")


def real_shapes():
    from transformers import AutoConfig, AutoModelForCausalLM

    from hf_models import randomise_vectors
    from published_configs import PUBLISHED
    tokens = torch.randint(0, 30000, (2, 64), generator=torch.Generator().manual_seed(2))
    for name in ("GPT-2 (124M)", "SmolLM2-135M", "Qwen2.5-0.5B", "Qwen3-0.6B", "Llama-3.2-1B", "Qwen3-1.7B",
                 "Mistral-7B-v0.1"):
        config = copy.deepcopy(PUBLISHED[name][0])
        config.pop("torch_dtype", None)
        layers = "n_layer" if "n_layer" in config else "num_hidden_layers"
        config[layers] = 1
        hf_config = AutoConfig.for_model(config.pop("model_type"), **config)
        torch.manual_seed(0)
        with torch.device(DEVICE):
            model = AutoModelForCausalLM.from_config(hf_config, dtype=torch.float32)
        randomise_vectors(model)
        d = tempfile.mkdtemp()
        model.save_pretrained(d)
        ref = hf_logits(model, tokens)
        del model
        got, _ = zero3d_logits(d, tokens)
        say(f"{name} at 1 layer, real vocabulary and MLP: max |logit diff| {float((got - ref).abs().max()):.3g} "
            f"(logits up to {float(ref.abs().max()):.3g})")


def train_qwen3_bf16():
    """Qwen3-0.6B's shape at 2 layers imported, 3 bf16 steps at ZeRO stage 3 (DP 1) on fixed tokens."""
    import zero3d
    from transformers import AutoConfig, AutoModelForCausalLM

    from hf_models import randomise_vectors
    from pretrain.checkpoint.hf import ImportedModel, load_into, model_overrides
    from pretrain.config import load_config
    from pretrain.model.gpt import build_model, parallel_groups
    from pretrain.runtime.layout import destroy_model_parallel_groups, init_layout
    from pretrain.step import mean_loss, run_micro_batches
    from pretrain.train import engine_settings
    from published_configs import PUBLISHED
    config = copy.deepcopy(PUBLISHED["Qwen3-0.6B"][0])
    config.pop("torch_dtype")
    config["num_hidden_layers"] = 1 if DRY else 2
    if DRY:
        config["vocab_size"] = 512
    hf_config = AutoConfig.for_model(config.pop("model_type"), **config)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(hf_config, dtype=torch.float32)
    d = tempfile.mkdtemp()
    model.save_pretrained(d)
    seq = 32 if DRY else 256
    tokens = torch.randint(0, config["vocab_size"], (4, seq + 1), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        logits = model.to(DEVICE)(tokens[:, :-1].to(DEVICE)).logits.float()
        expected = torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].to(DEVICE).flatten()).item()
    del model, logits
    imported = ImportedModel(Path(d))
    cfg = load_config(None, ["logging.wandb=false", "train.micro_batch_size=2", "train.global_batch_size=4",
                             "zero.stage=3", 'precision.dtype="bf16"', "optimizer.lr=1e-4", "optimizer.warmup_steps=0",
                             *model_overrides(imported.model), f"model.seq_length={seq}"])
    topo = init_layout(cfg)
    gpu = build_model(cfg, topo.device)
    load_into(gpu, imported)
    engine = zero3d.wrap_model(gpu, engine_settings(cfg), parallel_groups(gpu, topo))
    losses = []
    for _ in range(3):
        batches = [tokens[:2].to(DEVICE), tokens[2:].to(DEVICE)]
        losses.append(mean_loss(run_micro_batches(engine, batches, cfg, topo), topo))
        engine.step(cfg.optimizer.lr)
    say(f"Qwen3-0.6B shape, 2 layers, bf16 stage 3: losses {', '.join(f'{x:.4f}' for x in losses)}; transformers "
        f"fp32 on the same tokens {expected:.4f}"
        + (f"; peak {torch.cuda.max_memory_allocated() / 2**30:.2f} GiB" if DEVICE == "cuda" else ""))
    destroy_model_parallel_groups()


if __name__ == "__main__":
    import transformers
    say(f"{torch.cuda.get_device_name() if DEVICE == 'cuda' else 'cpu'} torch {torch.__version__} transformers "
        f"{transformers.__version__}")
    for part in (families, exact_gelu) + (() if DRY else (real_shapes,)) + (train_qwen3_bf16,):
        try:
            part()
        except Exception as err:  # noqa: BLE001 - a part that fails is a row of the report
            import traceback
            traceback.print_exc()
            say(f"{part.__name__} FAILED: {type(err).__name__}: {err}")
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "report.json").write_text(json.dumps(REPORT, indent=1))
