"""CPU mode: the five patches megatron-core 0.16 needs to build, run, pipeline and context-split GPTModel on gloo ranks.

Applied only by `megatron_patches.apply("cpu")`, never on a CUDA run, and undone by `undo_cpu_patches()`.
Everything else CPU mode once patched goes through megatron's public seams (pretrain/model/gpt.py): an explicit causal
mask to `GPTModel.forward`, the norm in the layer spec, `batch_p2p_sync=False`, ZeRO-R recompute as a layer class.
"""
import contextlib

import torch

_originals: dict = {}  # (owner, attribute name) -> the value before patching


class CpuRNGStatesTracker:
    """megatron's RNG-state tracker kept on the CPU generator (same contract as CudaRNGStatesTracker:
    named states; `fork(name)` swaps one in for the duration of a tensor-parallel dropout region)."""

    def __init__(self):
        self.reset()

    def is_initialized(self):
        return self._is_initialized

    def reset(self):
        self._is_initialized = False
        self.states_ = {}
        self.seeds_ = set()

    def get_states(self):
        return dict(self.states_)

    def set_states(self, states):
        self._is_initialized = True
        self.states_ = dict(states)

    def add(self, name, seed):
        self._is_initialized = True
        if seed in self.seeds_:
            raise RuntimeError(f"RNG seed {seed} already exists")
        if name in self.states_:
            raise RuntimeError(f"RNG state {name!r} already exists")
        self.seeds_.add(seed)
        self.states_[name] = torch.Generator().manual_seed(seed).get_state()

    @contextlib.contextmanager
    def fork(self, name="model-parallel-rng"):
        if name not in self.states_:
            raise RuntimeError(f"RNG state {name!r} is not added")
        outer = torch.get_rng_state()
        torch.set_rng_state(self.states_[name])
        try:
            yield
        finally:
            self.states_[name] = torch.get_rng_state()
            torch.set_rng_state(outer)


class _TorchWithCpuFactories:
    """The `torch` module as the pipeline schedules see it: `zeros(device="cuda")` lands on the CPU."""

    def __getattr__(self, name):
        return getattr(torch, name)

    @staticmethod
    def zeros(*args, device=None, **kwargs):
        return torch.zeros(*args, device="cpu" if device == "cuda" else device, **kwargs)


def _pos_emb_on_this_cp_rank(pos_emb, seq_dim, cp_group):  # rope_utils' own without its pinned (CUDA) index
    cp, rank, chunks = cp_group.size(), cp_group.rank(), pos_emb.chunk(2 * cp_group.size(), dim=seq_dim)
    return torch.cat((chunks[rank], chunks[2 * cp - 1 - rank]), dim=seq_dim)  # chunks rank and 2·cp − 1 − rank


def _patch(owner, name, value) -> None:
    _originals.setdefault((owner, name), getattr(owner, name))
    setattr(owner, name, value)


def apply_cpu_patches() -> None:
    """Idempotent. Each patch names the public API that would let it go (none exists in megatron-core 0.16)."""
    if _originals:
        return
    import megatron.core.fusions.fused_bias_swiglu as fused_swiglu
    import megatron.core.models.common.embeddings.rotary_pos_embedding as rotary
    import megatron.core.pipeline_parallel.schedules as schedules
    import megatron.core.tensor_parallel.random as mrandom

    # 1. ~175 megatron call sites allocate on torch.cuda.current_device(); no device argument exists.
    _patch(torch.cuda, "current_device", lambda: "cpu")
    # 2. The tensor-parallel dropout RNG tracker is CUDA-only (initialize_rng_tracker has no CPU kind).
    _patch(mrandom, "_CUDA_RNG_STATE_TRACKER", CpuRNGStatesTracker())
    _patch(mrandom, "_CUDA_RNG_STATE_TRACKER_INITIALIZED", True)
    # 3. megatron's own recompute (without ZeRO-R) saves and restores the CUDA RNG state; there is none on CPU.
    _patch(mrandom, "_get_cuda_rng_state", lambda *args, **kwargs: torch.empty(0, dtype=torch.uint8))
    _patch(mrandom, "_set_cuda_rng_state", lambda *args, **kwargs: None)
    # 4. The pipeline schedules count tokens in torch.zeros(..., device="cuda").
    _patch(schedules, "torch", _TorchWithCpuFactories())
    # 5. RoPE under context parallelism picks this rank's chunks of the frequencies with a pinned host index.
    _patch(rotary, "get_pos_emb_on_this_cp_rank", _pos_emb_on_this_cp_rank)
    # 6. A rank standing in for CUDA (gpt.py's cuda_kernels) runs the fused SwiGLU's torch.compile'd kernels eagerly.
    for name in ("swiglu", "swiglu_back", "bias_swiglu", "bias_swiglu_back"):
        _patch(fused_swiglu, name, getattr(fused_swiglu, name).__wrapped__)


def undo_cpu_patches() -> None:
    """Give megatron and torch back exactly what they had (tests; a process switching to CUDA)."""
    for (owner, name), value in _originals.items():
        setattr(owner, name, value)
    _originals.clear()


def cpu_patches_applied() -> bool:
    return bool(_originals)


@contextlib.contextmanager
def tied_embeddings_stay_on_cpu():
    """Model construction only: with pipeline stages sharing the word embedding, megatron moves it with
    `Tensor.cuda()` before all-reducing it (LanguageModule.setup_embeddings_and_output_layer)."""
    original = torch.Tensor.cuda
    torch.Tensor.cuda = lambda self, *args, **kwargs: self
    try:
        yield
    finally:
        torch.Tensor.cuda = original
