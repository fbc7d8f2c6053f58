"""model.compile's rule (pretrain/model/gpt.py: compiles): true and false as said; "auto", the default, compiles only on
CUDA with megatron's local layers — eager on CPU and with Transformer Engine's layers (never measured compiled)."""
import pytest

from pretrain.config import load_config
from pretrain.model.gpt import compiles


@pytest.mark.parametrize("choice, on_cuda, te_layers, expected", [
    ("auto", True, False, True), ("auto", True, True, False), ("auto", False, False, False),
    (True, False, False, True), (True, True, True, True), (False, True, False, False)])
def test_which_layers_compile(choice, on_cuda, te_layers, expected):
    assert compiles(choice, on_cuda, te_layers) is expected


def test_auto_is_the_default():
    assert load_config(None, []).model.compile == "auto"
