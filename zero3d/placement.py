"""Where the fp32 master and optimizer states live — device, host memory or NVMe files — behind one interface."""
import contextlib

import torch

from zero3d.accounting import moved_off_device


class Placement:
    """What the engine asks of its optimizer placement; the defaults are what the device does.

    The engine always holds one: `DevicePlacement` here, `HostOffload` (zero3d/offload.py) or
    `NvmeOffload` (zero3d/nvme.py); it never asks which. `optimizer` is the torch optimizer whose
    `state` checkpoints read (inside `materialized()`)."""

    name = "none"  # the zero.offload_optimizer value it implements
    optimizer: torch.optim.Optimizer

    def accumulate_grad(self, group, lo: int, piece: torch.Tensor, alpha: float) -> None:
        """A reduced bucket piece for the group's shard elements [lo, lo + n), added × `alpha`."""
        group.grads[lo:lo + piece.numel()].add_(piece, alpha=alpha)

    def finish_grads(self) -> None:
        """Before the step: every gradient piece handed over has arrived."""

    def master_grad(self, name: str, pieces: list) -> torch.Tensor:
        """The group's reduced gradient in master coordinates for the step, in its own dtype: its `pieces` (in order)
        themselves when they are one tensor, else joined (stage 1's pieces of the whole gradient). The step casts a
        compute-dtype gradient to fp32 a chunk at a time (optim/spec.py: STEP_CHUNK), never whole: an fp32 copy of
        the shard would sit beside it at the step's peak."""
        return pieces[0] if len(pieces) == 1 else torch.cat(pieces)

    def step(self, master_grads: dict, coef: float, lr: float, unscale: float = 1.0) -> None:
        """Clip by `coef`, the optimizer step at `lr`; {group name: gradient in master coordinates, as `master_grad`
        gave it}: fp32 ones unscaled, compute-dtype ones still to be multiplied by `unscale` (in fp32, before
        `coef`)."""
        raise NotImplementedError

    @property
    def writes_params(self) -> bool:
        """Whether `step` already wrote the updated values into the device parameter pieces."""
        return False

    def zero_grad(self) -> None:
        """After the step: gradients kept here are cleared."""

    def materialized(self):
        """Context: inside it every master and `optimizer.state` is an ordinary tensor."""
        return contextlib.nullcontext()

    def after_load(self) -> None:
        """The masters were overwritten (a checkpoint load): what derives from them follows."""

    def held_grad_bytes(self) -> int:
        """Bytes of gradient shards that live here instead of on the device."""
        return 0

    def host_tensors(self) -> dict:
        """{model-state category ("optimizer", "grads", "temporaries"): [host tensors this placement holds]}."""
        return {}

    def state_bytes(self, stage_bytes: dict) -> dict:
        """The stage's per-category accounting, with what lives here moved to its own keys."""
        return stage_bytes

    def close(self) -> None:
        """Release files and threads (also done when the process ends)."""


class DevicePlacement(Placement):
    """offload_optimizer = "none": the masters are the engine's device tensors (`master_pieces`),
    updated in place by `optimizer` (the spec's `build`, over exactly those pieces)."""

    def __init__(self, groups: dict, optimizer: torch.optim.Optimizer):
        self.groups, self.optimizer = groups, optimizer

    def step(self, master_grads: dict, coef: float, lr: float, unscale: float = 1.0) -> None:
        """fp32 gradients clipped in place; compute-dtype ones handed to the optimizer with their scales (`unscale`,
        then `coef`), which it applies a chunk at a time as it casts them (optim/flat_optimizer.py)."""
        grads = {}
        for name, group in self.groups.items():
            grad, scales = master_grads[name], ()
            if grad.dtype == torch.float32:
                if coef < 1.0:
                    grad.mul_(coef)
            else:
                scales = tuple(s for s, needed in ((unscale, unscale != 1.0), (coef, coef < 1.0)) if needed)
            for offset, piece in group.master_pieces:
                grads[piece] = (grad[offset:offset + piece.numel()], scales)
        for param_group in self.optimizer.param_groups:
            param_group["lr"] = lr
        self.optimizer.step(grads=grads)


class OffDevicePlacement(Placement):
    """The offloaded placements: the step writes the parameters back itself; the accounting moves the
    master and optimizer bytes to host_*/nvme_* keys (`off_device_bytes`)."""

    @property
    def writes_params(self) -> bool:
        return True

    def off_device_bytes(self) -> dict:
        raise NotImplementedError

    def state_bytes(self, stage_bytes: dict) -> dict:
        return moved_off_device(stage_bytes, self.held_grad_bytes(), self.off_device_bytes())
