"""A readable start-up: megatron's warnings replaced by one `kernels:` line of facts (pretrain/runtime/kernels.py)."""
import warnings
from pathlib import Path

from pretrain.config import load_config
from pretrain.model.gpt import transformer_config
from pretrain.runtime.kernels import fallbacks_line

REPO = Path(__file__).resolve().parents[2]


def test_kernels_line_states_cuda_device_max_connections_only_where_megatron_would_warn():
    # megatron-core warns when TP > 1 and the variable is not "1" (tensor_parallel/layers.py)
    for tp, environ, stated in ((2, {}, "CUDA_DEVICE_MAX_CONNECTIONS unset"),
                                (4, {"CUDA_DEVICE_MAX_CONNECTIONS": "8"}, "CUDA_DEVICE_MAX_CONNECTIONS 8"),
                                (2, {"CUDA_DEVICE_MAX_CONNECTIONS": "1"}, None), (1, {}, None)):
        line = fallbacks_line(tp, environ) or ""
        assert ("CUDA_DEVICE_MAX_CONNECTIONS" in line) == (stated is not None), (tp, environ, line)
        if stated:
            assert line.startswith("kernels: ") and stated in line and line.count("\n") == 0


def test_the_transformer_config_we_pass_draws_no_megatron_warning():
    cfg = load_config(REPO / "configs/tiny.toml", ['model.recompute="full"'])
    transformer_config(cfg, on_cuda=False)  # megatron's (and torch's) import-time warnings are not ours
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        transformer_config(cfg, on_cuda=False)
        transformer_config(cfg, on_cuda=False, zero_recompute=True)
    assert [str(w.message) for w in caught] == []
