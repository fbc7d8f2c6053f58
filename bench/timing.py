"""The benches' clock for a repeated GPU (or CPU) step: mean wall seconds after warm-up calls, the device synced."""
import time

import torch


def mean_seconds(step, repeats: int, warmup: int, device) -> float:
    """Mean seconds per `step()` over `repeats` calls after `warmup` untimed ones (compilation, allocator, optimizer
    states), CUDA synchronized before and after the timed calls."""
    for _ in range(warmup):
        step()
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    sync()
    t0 = time.perf_counter()
    for _ in range(repeats):
        step()
    sync()
    return (time.perf_counter() - t0) / repeats
