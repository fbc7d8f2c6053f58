"""model.attention's resolution (pretrain/model/attention.py): auto, and the refusals of te where it cannot run."""
import importlib.util

import pytest

from pretrain.model.attention import resolve

HAVE_TE = importlib.util.find_spec("transformer_engine") is not None


def test_auto_is_te_on_cuda_where_importable_else_sdpa():
    assert resolve("auto", on_cuda=True, zero_recompute=False) == ("te" if HAVE_TE else "sdpa")
    assert resolve("auto", on_cuda=False, zero_recompute=False) == "sdpa"
    assert resolve("auto", on_cuda=True, zero_recompute=True) == "sdpa"  # ZeRO-R layers are megatron's local ones
    assert resolve("local", on_cuda=True, zero_recompute=False) == "local"


@pytest.mark.parametrize("on_cuda,zero_recompute,why", [
    (False, False, "Transformer Engine is not importable" if not HAVE_TE else "it needs a CUDA device"),
    (True, True, "Transformer Engine is not importable" if not HAVE_TE else "ZeRO-R's recomputed layers"),
])
def test_te_is_refused_where_it_cannot_run(on_cuda, zero_recompute, why):
    with pytest.raises(ValueError, match=f"model.attention = 'te' cannot run here: {why}"):
        resolve("te", on_cuda=on_cuda, zero_recompute=zero_recompute)


def test_unknown_choice_names_the_valid_ones():
    with pytest.raises(ValueError, match="model.attention = 'flash' is invalid; valid values: 'auto', 'sdpa', 'local', 'te'"):
        resolve("flash", on_cuda=False, zero_recompute=False)
