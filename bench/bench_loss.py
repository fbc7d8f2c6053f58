"""The loss paths of pretrain/model/loss.py side by side, in one process: step time and peak memory.

    python bench/bench_loss.py [--vocab 32768 131072] [--tokens 2048] [--hidden 256] [--chunk 1024] [--steps 3]
                               [--device cpu|cuda] [--dtype fp32|bf16]

For each vocabulary, forward and backward of the output layer and the vocab-parallel cross-entropy of `tokens` hidden
states (one rank, TP 1, `--device` cpu or cuda, `--dtype` fp32 or bf16; the rest of the model left out: it is the
same on every path):

    megatron    model.loss_chunk_tokens = 0: the [tokens × vocab] logits, vocab_parallel_cross_entropy
    recomputed  model.loss_chunk_tokens = c, model.loss_recompute = true: chunks under torch's checkpoint
    fused       model.loss_chunk_tokens = c (the default): FusedLinearCrossEntropy, every gradient in forward
    compiled    the same with model.compile's softmax kernels (inductor; compiled in the counted run): bf16 only, as
                models use them (an fp32 model keeps the fused loss's in-place eager softmax)

Each path runs once counted, then `steps` times timed (the paths interleaved; the median; on CPU the process's CPU
seconds, all its threads: a shared machine's other work does not count, on CUDA wall seconds). Peak: the largest number
of bytes alive at once above the inputs (the weight's and hidden states' gradients included): on CPU every storage an
operator makes, counted until it is freed (a TorchDispatchMode; not for the compiled path, whose kernels allocate out of
its sight: "—"), on CUDA torch's allocator peak. Kept: the bytes
autograd holds for backward at the end of forward (saved_tensors_hooks; the inputs and weight excluded). dW err: the
largest difference of the path's weight gradient from megatron's path computed in fp32 on the same inputs, relative to
that gradient's largest element (the fused loss's sum over chunks: on CUDA the GEMM adds into it, `add_product`).
"""
import argparse
import statistics
import sys
import time
import weakref
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402
from torch.utils._pytree import tree_flatten  # noqa: E402

PATHS = ("megatron", "recomputed", "fused", "compiled")
KERNELS = []  # the compiled path's SoftmaxKernels, made once


class LiveBytes(TorchDispatchMode):
    """Bytes of the storages operators made while it is active and that are still alive; their peak."""

    def __init__(self):
        super().__init__()
        self.live, self.now, self.peak = set(), 0, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.device.type == "cpu":
                storage = t.untyped_storage()
                key = storage.data_ptr()
                if key and key not in self.live:
                    self.live.add(key)
                    self.now += storage.nbytes()
                    self.peak = max(self.peak, self.now)
                    weakref.finalize(storage, self._freed, key, storage.nbytes())
        return out

    def _freed(self, key, nbytes):
        self.live.discard(key)
        self.now -= nbytes


class Kept:
    """Bytes of distinct storages autograd holds for backward (parameters and inputs excluded)."""

    def __init__(self, exclude):
        self.exclude, self.seen, self.bytes = {t.untyped_storage().data_ptr() for t in exclude}, set(), 0

    def pack(self, t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in self.exclude | self.seen:
            self.seen.add(storage.data_ptr())
            self.bytes += storage.nbytes()
        return t


def loss_of(path, hidden, weight, labels, chunk, vocab):
    """Per-token loss [s, 1] on `path`, as LossOutputLayer computes it."""
    from megatron.core import tensor_parallel

    from pretrain.model.loss import chunked_loss, compiled_softmax, mask_padded_columns
    if path == "megatron":
        logits = mask_padded_columns(torch.matmul(hidden, weight.t()), vocab)
        return tensor_parallel.vocab_parallel_cross_entropy(logits, labels)
    if path == "compiled" and not KERNELS:
        KERNELS.append(compiled_softmax("inductor"))
    return chunked_loss(hidden, weight, None, labels, chunk, False, None, vocab, recompute=path == "recomputed",
                        kernels=KERNELS[0] if path == "compiled" else None)


def weight_gradient_fp32(hidden, weight, labels, args, vocab):
    """The output weight's gradient on megatron's path in fp32 (the inputs upcast): the `dW err` column's reference."""
    hidden, weight = (t.detach().float().requires_grad_() for t in (hidden, weight))
    loss_of("megatron", hidden, weight, labels, args.chunk, vocab).mean().backward()
    return weight.grad


def run_once(path, hidden, weight, labels, args, vocab, census=None):
    hidden.grad = weight.grad = None
    hooks = (census.pack, lambda t: t) if census else (lambda t: t, lambda t: t)
    with torch.autograd.graph.saved_tensors_hooks(*hooks):
        loss = loss_of(path, hidden, weight, labels, args.chunk, vocab).mean()
    loss.backward()
    return loss


def measure(vocab, args, device):
    """{path: (median step s, peak bytes, kept bytes, loss, weight gradient's error)} at one vocabulary."""
    g = torch.Generator().manual_seed(0)
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[args.dtype]
    hidden = torch.randn(args.tokens, 1, args.hidden, generator=g).to(device, dtype).requires_grad_()
    weight = (0.02 * torch.randn(vocab, args.hidden, generator=g)).to(device, dtype).requires_grad_()
    labels = torch.randint(0, vocab, (args.tokens, 1), generator=g).to(device)
    reference = weight_gradient_fp32(hidden, weight, labels, args, vocab)
    out = {}
    paths = PATHS if dtype != torch.float32 else PATHS[:-1]
    for path in paths:  # an untimed run, counted: its peak and what it keeps for backward
        census, live = Kept([hidden, weight]), LiveBytes()
        if device.type == "cuda":
            torch.cuda.synchronize()
            base = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            loss = run_once(path, hidden, weight, labels, args, vocab, census)
            torch.cuda.synchronize()
            peak = torch.cuda.max_memory_allocated() - base
        else:
            with live:
                loss = run_once(path, hidden, weight, labels, args, vocab, census)
            peak = None if path == "compiled" else live.peak  # inductor's kernels allocate out of the mode's sight
        error = ((weight.grad.float() - reference).abs().max() / reference.abs().max()).item()
        out[path] = [[], peak, census.bytes, loss.item(), error]
    clock = time.perf_counter if device.type == "cuda" else time.process_time  # CPU: this process's CPU seconds
    for _ in range(args.steps):  # timed, the paths interleaved
        for path in paths:
            if device.type == "cuda":
                torch.cuda.synchronize()
            t0 = clock()
            run_once(path, hidden, weight, labels, args, vocab)
            if device.type == "cuda":
                torch.cuda.synchronize()
            out[path][0].append(clock() - t0)
    return {path: (statistics.median(times), *counted) for path, (times, *counted) in out.items()}


def bench(args):
    """One rank (TP 1) on args.device: rows of the table."""
    from pretrain.config import load_config
    from pretrain.runtime.layout import init_layout
    init_layout(load_config(None, ["parallel.tensor=1", "train.global_batch_size=1", "train.micro_batch_size=1",
                                   "logging.wandb=false"]))
    device = torch.device(args.device)
    rows = []
    for vocab in args.vocab:
        for path, (step, peak, kept, loss, error) in measure(vocab, args, device).items():
            rows.append(dict(vocab=vocab, path=path, time=step, peak=peak, kept=kept, loss=loss, dw_error=error))
    return rows


def print_table(rows, args):
    where = f"one CPU rank ({torch.get_num_threads()} threads)" if args.device == "cpu" else args.device
    print(f"output layer + cross-entropy, {args.tokens} tokens, hidden {args.hidden}, chunks of {args.chunk}, "
          f"{args.dtype}, {where}; median of {args.steps} steps after a counted one")
    clock = "cpu s" if args.device == "cpu" else "step s"
    print(f"{'vocab':>7} {'path':<10} {clock:>7} {'x fused':>7} {'peak MB':>8} {'kept MB':>8} {'loss':>9} "
          f"{'dW err':>8}")
    fused = {r["vocab"]: r for r in rows if r["path"] == "fused"}
    for r in rows:
        peak = "—" if r["peak"] is None else f"{r['peak'] / 1e6:.1f}"
        print(f"{r['vocab']:7d} {r['path']:<10} {r['time']:7.3f} {r['time'] / fused[r['vocab']]['time']:7.2f} "
              f"{peak:>8} {r['kept'] / 1e6:8.1f} {r['loss']:9.6f} {r['dw_error']:8.1e}")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--vocab", type=int, nargs="+", default=[32768, 131072])
    for flag, default in [("tokens", 2048), ("hidden", 256), ("chunk", 1024), ("steps", 3)]:
        ap.add_argument(f"--{flag}", type=int, default=default)
    ap.add_argument("--device", default="cpu", help="cpu, or cuda (one GPU; peak from torch.cuda's allocator)")
    ap.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"])
    args = ap.parse_args()
    import os
    os.environ.update({k: v for k, v in dict(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1",
                                             MASTER_ADDR="127.0.0.1").items() if k not in os.environ})
    if "MASTER_PORT" not in os.environ:
        from pretrain.runtime.rendezvous import free_port
        os.environ["MASTER_PORT"] = str(free_port())
    print_table(bench(args), args)


if __name__ == "__main__":
    main()
