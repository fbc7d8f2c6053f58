"""CPU mode: lets megatron-core's GPTModel build, run and recompute on CPU ranks under gloo."""
import contextlib
import copy

import torch

_applied = False


class CpuRNGStatesTracker:
    """megatron's RNG-state tracker, kept on the CPU generator instead of the CUDA one.

    Same contract as tensor_parallel.random.CudaRNGStatesTracker: named states, `fork(name)`
    swaps a named state in for the duration of a block (tensor-parallel dropout regions).
    """

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
    """The `torch` module as pipeline schedules see it: factories asking for "cuda" get the CPU."""

    def __getattr__(self, name):
        return getattr(torch, name)

    @staticmethod
    def zeros(*args, device=None, **kwargs):
        return torch.zeros(*args, device="cpu" if device == "cuda" else device, **kwargs)


def _norm_allowing_sequence_parallel(original_new):
    """megatron's torch-norm fallback, tagging its weights `sequence_parallel` like apex's FusedLayerNorm."""
    def __new__(cls, config, hidden_size, eps=1e-5, **kwargs):
        if not config.sequence_parallel:
            return original_new(cls, config, hidden_size, eps, **kwargs)
        plain = copy.copy(config)
        plain.sequence_parallel = False
        norm = original_new(cls, plain, hidden_size, eps, **kwargs)
        for p in norm.parameters():
            p.sequence_parallel = True  # each TP rank saw a sequence slice: grads summed over TP
        return norm
    return __new__


def _cpu_causal_mask(sq: int) -> torch.Tensor:
    return torch.triu(torch.ones(sq, sq, dtype=torch.bool), diagonal=1)


def apply_cpu_patches() -> None:
    """Idempotent. Only ever called in CPU mode (megatron_patches.apply("cpu"))."""
    global _applied
    if _applied:
        return
    import megatron.core.fusions.fused_softmax as fused_softmax
    import megatron.core.pipeline_parallel.schedules as schedules
    import megatron.core.tensor_parallel.random as mrandom
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    # ~175 megatron call sites allocate on torch.cuda.current_device() (global memory buffer too).
    torch.cuda.current_device = lambda: "cpu"
    # The default causal mask is built with device="cuda"; build it on the CPU instead.
    fused_softmax.get_default_causal_mask = _cpu_causal_mask
    # Tensor-parallel dropout RNG states live on the CPU generator (no CUDA generator exists).
    mrandom._CUDA_RNG_STATE_TRACKER = CpuRNGStatesTracker()
    mrandom._CUDA_RNG_STATE_TRACKER_INITIALIZED = True
    # Checkpointing saves/restores the CUDA RNG state besides the CPU one: nothing to do on CPU.
    mrandom._get_cuda_rng_state = lambda *args, **kwargs: torch.empty(0, dtype=torch.uint8)
    mrandom._set_cuda_rng_state = lambda *args, **kwargs: None
    # model_parallel_cuda_manual_seed seeds the CUDA generator; on CPU that is the CPU one.
    torch.cuda.manual_seed = torch.manual_seed
    # Pipeline p2p synchronises the CUDA device after each exchange: nothing to wait for on CPU.
    torch.cuda.synchronize = lambda *args, **kwargs: None
    # Tied embeddings across pipeline stages move the weight with .cuda() before all-reducing it.
    torch.Tensor.cuda = lambda self, *args, **kwargs: self
    # The schedules count tokens in torch.zeros(..., device="cuda").
    schedules.torch = _TorchWithCpuFactories()
    # Sequence parallelism: the torch LayerNorm fallback (no apex on CPU) refuses it only for want
    # of the `sequence_parallel` tag on its weights, which the fused norms set.
    WrappedTorchNorm.__new__ = staticmethod(_norm_allowing_sequence_parallel(WrappedTorchNorm.__new__))
    _applied = True


def cpu_patches_applied() -> bool:
    return _applied
