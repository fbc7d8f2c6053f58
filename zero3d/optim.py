"""The engine's optimizer as a policy (`OptimizerSpec`): its states, how it is built and stepped; `ADAMW` the default."""
# Nothing else in zero3d or pretrain names an optimizer's states or their bytes: the placements (device, host,
# NVMe), the checkpoint's tensors and manifest, the byte accounting and the estimator ask the spec. torch is
# imported inside the functions: the planner and the estimator read `ADAMW.state_bytes` without it.
from dataclasses import dataclass
from typing import Callable, Optional


@dataclass(frozen=True)
class OptimizerSpec:
    """An elementwise optimizer over flat fp32 master tensors (flat or sharded updates agree)."""

    name: str
    """Written into the checkpoint's manifest (`optimizer`); a checkpoint of another optimizer is refused."""

    states: tuple
    """Names of its per-element fp32 states, keys of `optimizer.state[master piece]` (AdamW: exp_avg,
    exp_avg_sq); each is a checkpoint tensor "optim/<state>/<key>" and, under NVMe offload, a file."""

    build: Callable
    """([(flat fp32 tensor, weight decay)], lr, betas, eps) -> the torch optimizer on the device."""

    build_host: Callable
    """The same arguments -> the optimizer over host masters (cpu/NVMe offload) in its fastest CPU mode."""

    host_step: Callable
    """(master, grad, {state: tensor}, step count before this step (0-dim tensor), param group) -> None:
    one in-place update of a piece of a group, the arithmetic `build_host`'s optimizer runs (NVMe chunks;
    before a group's first step its state files hold zeros, which must be `initial_state`'s values)."""

    keep_host_mode: Callable
    """optimizer -> None: after a load, the host optimizer's mode flags and step counters back to its own."""

    initial_state: Callable
    """(optimizer, master piece) -> {key: tensor}: the state its first step creates (states and any step
    counter), made explicitly for a piece that has not been stepped (a save or load before the first step)."""

    step_count: Callable
    """(optimizer, master pieces) -> steps taken (skipped fp16 overflow steps excluded); where it lives is
    the optimizer's own business (torch: a 0-dim tensor per piece; apex: per param group)."""

    set_step_count: Callable
    """(optimizer, master pieces, count) -> None: the count a checkpoint restores (each piece has its state)."""

    state_bytes: int
    """Bytes of state per element of the master (the master's own 4 bytes not included)."""

    legacy_step_key: Optional[str] = None
    """The manifest key its step count had before the spec-neutral `optimizer_step` (AdamW: "adam_step"):
    read from checkpoints that lack `optimizer_step`, and still written beside it, so code of before the
    change resumes new checkpoints."""


def _groups(tensors_and_decay: list) -> list:
    return [{"params": [t], "weight_decay": wd} for t, wd in tensors_and_decay]


def fused_adamw(tensors_and_decay: list, lr: float, betas: tuple, eps: float):
    """torch's fused AdamW (one kernel, no full-size scratch): what a GPU without apex runs. The one
    place it is built: make_optimizer's fallback, and the rank-local probe standing in for a GPU."""
    import torch
    return torch.optim.AdamW(_groups(tensors_and_decay), lr=lr, betas=betas, eps=eps, fused=True)


def make_optimizer(tensors_and_decay: list, lr: float, betas: tuple, eps: float):
    """AdamW over [(flat fp32 tensor, weight_decay)]: apex FusedAdam on CUDA when importable, torch AdamW otherwise."""
    import torch
    if all(t.is_cuda for t, _ in tensors_and_decay):
        try:
            from apex.optimizers import FusedAdam
            return FusedAdam(_groups(tensors_and_decay), lr=lr, betas=betas, eps=eps, adam_w_mode=True)
        except ImportError:
            return fused_adamw(tensors_and_decay, lr, betas, eps)
    return torch.optim.AdamW(_groups(tensors_and_decay), lr=lr, betas=betas, eps=eps, foreach=False)


CPU_ADAM_MODE = {"fused": True}  # the fastest CPU mode, measured by bench/bench_offload.py


def cpu_adamw(tensors_and_decay: list, lr: float, betas: tuple, eps: float):
    """torch's AdamW over host masters in its fast CPU mode: its `state` is what checkpoints read."""
    import torch
    return torch.optim.AdamW(_groups(tensors_and_decay), lr=lr, betas=betas, eps=eps, **CPU_ADAM_MODE)


def adamw_step(master, grad, states: dict, step, group: dict) -> None:
    """torch's own AdamW math on one (piece of a) group, in the mode `CPU_ADAM_MODE` picks."""
    from torch.optim.adamw import adamw
    adamw([master], [grad], [states["exp_avg"]], [states["exp_avg_sq"]], [], [step], amsgrad=False,
          beta1=group["betas"][0], beta2=group["betas"][1], lr=group["lr"], weight_decay=group["weight_decay"],
          eps=group["eps"], maximize=False, foreach=False, **CPU_ADAM_MODE)


def keep_cpu_mode(optimizer) -> None:
    """A loaded optimizer state may carry another run's mode flags and device step counters."""
    import torch
    for param_group in optimizer.param_groups:
        param_group.update(foreach=False, **CPU_ADAM_MODE)
    for state in optimizer.state.values():
        if "step" in state:
            state["step"] = torch.as_tensor(state["step"], dtype=torch.float32, device="cpu").reshape(())


def _step_tensor(optimizer, piece, count: int):
    import torch
    fused = optimizer.defaults.get("fused")  # torch's fused AdamW keeps the count on the device
    return torch.tensor(float(count), dtype=torch.float32, device=piece.device if fused else "cpu")


def adamw_initial_state(optimizer, piece) -> dict:
    """What torch's AdamW (and apex's) creates at the first step: zero moments and a step count of 0."""
    import torch
    return {"step": _step_tensor(optimizer, piece, 0),
            **{key: torch.zeros_like(piece, memory_format=torch.preserve_format) for key in ADAMW_STATES}}


def adamw_step_count(optimizer, pieces: list) -> int:
    group = optimizer.param_groups[0]
    if "step" in group:  # apex FusedAdam counts per group
        return int(group["step"])
    return int(optimizer.state.get(pieces[0], {}).get("step", 0)) if pieces else 0


def set_adamw_step_count(optimizer, pieces: list, count: int) -> None:
    for param_group in optimizer.param_groups:
        if "step" in param_group:
            param_group["step"] = count
    for piece in pieces:
        optimizer.state[piece]["step"] = _step_tensor(optimizer, piece, count)


ADAMW_STATES = ("exp_avg", "exp_avg_sq")
ADAMW = OptimizerSpec(name="adamw", states=ADAMW_STATES, build=make_optimizer, build_host=cpu_adamw,
                      host_step=adamw_step, keep_host_mode=keep_cpu_mode, initial_state=adamw_initial_state,
                      step_count=adamw_step_count, set_step_count=set_adamw_step_count,
                      state_bytes=4 * len(ADAMW_STATES),  # two fp32 moments; with the fp32 master, 12 bytes
                      legacy_step_key="adam_step")
