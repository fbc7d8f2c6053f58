"""The model families (pretrain/families/), held to transformers 5.24 itself: published config.json files import as
their family's `[model]` section — whose parameters, names and shapes are those of transformers' own model of that
config, built on the meta device — or are refused in one line; each family's defaults are its config class's; every
key of its config class is read or named as not changing the function; GPT-2's activations and Llama-3.1's RoPE
frequencies are transformers' own; one family at most computes any `[model]` section, and an import exports as its
family again; docs/families.md holds the registry's table of the published models."""
import copy
import itertools
import json
from pathlib import Path

import pytest
import torch

from pretrain.checkpoint.hf import check_matches, expected_hf_shapes
from pretrain.config import load_config
from pretrain.errors import CheckpointError
from pretrain.families.family import MODEL_DEFAULTS
from pretrain.families.registry import FAMILIES, by_architecture, for_model, model_section
from pretrain.families.table import published_table, verdict
from published_configs import PUBLISHED

REPO = Path(__file__).resolve().parents[2]
CONFIG_CLASSES = {"GPT2LMHeadModel": "GPT2Config", "LlamaForCausalLM": "LlamaConfig",
                  "Qwen2ForCausalLM": "Qwen2Config", "Qwen3ForCausalLM": "Qwen3Config",
                  "MistralForCausalLM": "MistralConfig"}


def config_class(architecture: str):
    import transformers
    return getattr(transformers, CONFIG_CLASSES[architecture])


def meta_model(config: dict):
    """transformers' own model of a config.json, its tensors on the meta device (no memory, no download)."""
    from transformers import AutoModelForCausalLM
    hf_config = config_class(config["architectures"][0]).from_dict(copy.deepcopy(config))  # it edits nested dicts
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(hf_config)


IMPORTED = [name for name, (config, seq) in PUBLISHED.items() if verdict(config, seq)[0] is not None]


def test_the_docs_table_is_the_registrys():
    """docs/families.md's table is the registry's verdict on each published config.json (generated: on a
    difference, paste the table this test prints)."""
    table = published_table(PUBLISHED)
    assert table in (REPO / "docs" / "families.md").read_text(), "docs/families.md's table should read:\n" + table


def test_every_family_named_in_the_list_is_imported_and_the_rest_refused_in_one_line():
    """The issue's list (GPT-2 124M, Llama-3.2-1B, Qwen2.5-0.5B, Qwen3-0.6B and 1.7B, Mistral-7B, SmolLM2-135M) all
    import; what cannot is refused in one line naming the value."""
    for name in ("GPT-2 (124M)", "Llama-3.2-1B", "Qwen2.5-0.5B", "Qwen3-0.6B", "Qwen3-1.7B", "Mistral-7B-v0.1",
                 "Mistral-7B-v0.3", "SmolLM2-135M"):
        assert name in IMPORTED, verdict(*PUBLISHED[name])
    refusals = {name: verdict(*PUBLISHED[name])[1] for name in PUBLISHED if name not in IMPORTED}
    assert refusals == {
        "Mistral-7B-v0.1 at 8192 tokens": "refused: model.sliding_window = 4096 does not cover model.seq_length = "
        "8192: zero3d's attention is full causal, equal to a sliding window only where the window covers the "
        "sequence; set seq_length <= 4096",
        "Qwen2.5-7B-Instruct with YaRN": "refused: config.json (Qwen2ForCausalLM): RoPE type 'yarn' is not "
        "supported; supported: 'default'",
        "Phi-3-mini-4k-instruct": "refused: architecture 'Phi3ForCausalLM' is not supported; supported: "
        "GPT2LMHeadModel, LlamaForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM, MistralForCausalLM"}


@pytest.mark.parametrize("name", IMPORTED)
def test_a_published_model_is_transformers_own_tensor_for_tensor(name):
    """The `[model]` section of a published config.json builds transformers' model of it: the same parameter count
    (GPTShape, unpadded) and the same HF tensors, each named and shaped as the import demands of the files."""
    config, seq = PUBLISHED[name]
    section = model_section(config)
    model = meta_model(config)
    counted = {id(p): p.numel() for p in model.parameters()}  # a tied head once
    m = verdict(config, seq)[0]
    assert m.shape.params() == sum(counted.values())
    theirs = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    if config.get("tie_word_embeddings", config["architectures"][0] == "GPT2LMHeadModel"):
        theirs.pop("lm_head.weight")
    theirs = {k: v for k, v in theirs.items() if not k.endswith((".attn.bias", ".attn.masked_bias"))}
    assert expected_hf_shapes(section, config["vocab_size"], config["architectures"][0]) == theirs


MINIMAL = {  # the keys a config.json must hold: everything else is the class's default
    "GPT2LMHeadModel": {"n_embd": 64, "n_head": 4, "n_layer": 2, "vocab_size": 100},
    "LlamaForCausalLM": {"hidden_size": 64, "num_attention_heads": 4, "num_hidden_layers": 2,
                         "intermediate_size": 96, "vocab_size": 100},
}
MINIMAL.update({arch: MINIMAL["LlamaForCausalLM"] for arch in ("Qwen2ForCausalLM", "Qwen3ForCausalLM",
                                                               "MistralForCausalLM")})
VARIANTS = [{}, {"num_key_value_heads": None}, {"head_dim": None}, {"sliding_window": None}, {"n_inner": None},
            {"use_sliding_window": True, "max_window_layers": 0}, {"use_sliding_window": True},
            {"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0}},
            {"rope_theta": 500000.0, "max_position_embeddings": 16384}]


@pytest.mark.parametrize("variant", VARIANTS, ids=lambda v: ",".join(v) or "minimal")
@pytest.mark.parametrize("architecture", list(CONFIG_CLASSES))
def test_a_key_config_json_leaves_out_is_its_config_class_default(architecture, variant):
    """What a config.json omits (or sets to null) is read as transformers' config class fills it in: the section of
    the file as written equals the section of the file the class writes back (to_dict, every key present)."""
    family = by_architecture(architecture)
    written = {"architectures": [architecture], **MINIMAL[architecture], **variant}
    if "rope_scaling" in variant and architecture != "LlamaForCausalLM":
        return  # a refusal (test_refusals)
    if set(variant) - set(config_class(architecture)().to_dict()) - {"rope_scaling", "rope_theta"}:
        return  # a key this class does not have
    try:
        filled = config_class(architecture).from_dict(copy.deepcopy(written)).to_dict()
    except Exception:  # noqa: BLE001 - null where the class holds an integer (Qwen3's head_dim): no model to match
        return
    filled["architectures"] = [architecture]
    assert family.model_section(written) == family.model_section(filled)


@pytest.mark.parametrize("architecture", list(CONFIG_CLASSES))
def test_every_key_of_the_config_class_is_read_or_named(architecture):
    """A key transformers' class has and the family neither reads nor names (with why it does not change the
    function) would be a value the import could silently drop."""
    from transformers import PretrainedConfig
    family = by_architecture(architecture)
    keys = set(config_class(architecture)().to_dict()) - set(PretrainedConfig().to_dict())
    assert keys - set(family.read_keys) - set(family.unread_keys) == set()
    assert not set(family.read_keys) & set(family.unread_keys)


def test_gpt2_activations_are_transformers():
    """Each activation_function the GPT-2 family maps is the nonlinearity zero3d's MLP applies (transformers' ACT2FN,
    within fp32 rounding), and exact and tanh GELU differ by far more than that."""
    from transformers.activations import ACT2FN

    from pretrain.families.gpt2 import ACTIVATIONS
    from pretrain.model.gpt import NONLINEARITY
    x = torch.linspace(-6, 6, 10001)
    for name, mlp in ACTIVATIONS.items():
        torch.testing.assert_close(NONLINEARITY[mlp](x), ACT2FN[name](x), rtol=0, atol=1e-6)
    assert (NONLINEARITY["gelu"](x) - NONLINEARITY["gelu_tanh"](x)).abs().max() > 1e-4


@pytest.mark.parametrize("values", [(8.0, 1.0, 4.0, 8192, 500000, 128), (32.0, 1.0, 4.0, 8192, 500000, 64),
                                    (4.0, 2.0, 8.0, 256, 10000, 16), (2.5, 0.5, 3.0, 100, 10000, 24)])
def test_llama3_frequencies_are_transformers(values):
    """The llama3-scaled inverse frequencies zero3d sets on megatron's rotary embedding (pretrain/model/rope.py) are
    transformers' `_compute_llama3_parameters`, bit for bit, whatever the four values."""
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from pretrain.model.rope import llama3_frequencies
    factor, low, high, original, base, head_dim = values
    config = LlamaConfig(hidden_size=head_dim * 4, num_attention_heads=4, max_position_embeddings=2 * original,
                         rope_parameters={"rope_type": "llama3", "rope_theta": float(base), "factor": factor,
                                          "low_freq_factor": low, "high_freq_factor": high,
                                          "original_max_position_embeddings": original})
    theirs, _ = ROPE_INIT_FUNCTIONS["llama3"](config, "cpu")
    megatron = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))  # RotaryEmbedding's
    assert torch.equal(llama3_frequencies(megatron, factor, low, high, original), theirs)


def _sections():
    """Every combination of the architecture keys over a small shape."""
    choices = {"position_embedding": ("learned", "rope"), "mlp": ("gelu", "gelu_tanh", "swiglu"),
               "norm": ("layernorm", "rmsnorm"), "bias": (True, False), "qkv_bias": (False, True),
               "qk_layernorm": (False, True), "num_query_groups": (None, 2), "head_dim": (None, 24),
               "rope_scaling_factor": (None, 8.0), "sliding_window": (None, 64)}
    for values in itertools.product(*choices.values()):
        model = {**MODEL_DEFAULTS, "num_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "seq_length": 64,
                 "vocab_size": 100, **dict(zip(choices, values))}
        if not (model["qkv_bias"] and model["bias"]):  # refused by ModelConfig (redundant)
            yield model


def test_at_most_one_family_computes_a_model_and_an_import_exports_as_itself():
    """Over every combination of the architecture keys: no two families claim a `[model]` section; each one a
    family claims, written as its config.json and read back, is the same section of the same family (Mistral
    without a window is Llama's function, written as LlamaForCausalLM)."""
    claimed = 0
    for model in _sections():
        families = [f for f in FAMILIES if f.computes(model)]
        assert len(families) <= 1, (families, model)
        if not families:
            with pytest.raises(CheckpointError, match=r"^no Hugging Face architecture computes this model \(pos"):
                for_model(model)
            continue
        claimed += 1
        config = families[0].hf_config(model, model["vocab_size"])
        again = model_section(config)
        assert for_model(again) is families[0]
        sizes = {"head_dim": 16, "ffn_hidden_size": 256, "num_query_groups": 4}  # None: h / heads, 4h, heads
        assert {k: again[k] or sizes.get(k, again[k]) for k in again} == {k: model[k] or sizes.get(k, model[k])
                                                                          for k in again}
    # counted by hand: GPT-2 2 MLPs × 2 (the RoPE factor it does not read); Llama 2 bias × 2 groups × 2 head sizes ×
    # 2 scalings; Qwen2 and Qwen3 2 groups × 2 head sizes × 2 windows each; Mistral 2 groups × 2 head sizes
    assert claimed == 4 + 16 + 8 + 8 + 4


def _edit(config: dict, **keys) -> dict:
    return {**config, **keys}


REFUSALS = [
    (_edit(PUBLISHED["GPT-2 (124M)"][0], activation_function="relu"),
     "config.json (GPT2LMHeadModel): activation_function = 'relu' is not supported; supported: 'gelu', 'gelu_new', "
     "'gelu_pytorch_tanh'"),
    (_edit(PUBLISHED["GPT-2 (124M)"][0], scale_attn_by_inverse_layer_idx=True),
     "config.json (GPT2LMHeadModel): scale_attn_by_inverse_layer_idx = True is not supported; supported: False"),
    (_edit(PUBLISHED["GPT-2 (124M)"][0], scale_attn_weights=False),
     "config.json (GPT2LMHeadModel): scale_attn_weights = False is not supported; supported: True"),
    (_edit(PUBLISHED["Llama-3.2-1B"][0], rope_scaling={"rope_type": "linear", "factor": 2.0}),
     "config.json (LlamaForCausalLM): RoPE type 'linear' is not supported; supported: 'default', 'llama3'"),
    (_edit(PUBLISHED["Llama-3.2-1B"][0], rope_scaling={"rope_type": "llama3", "factor": 2.0}),
     "config.json (LlamaForCausalLM): RoPE type 'llama3' lacks low_freq_factor, high_freq_factor"),
    (_edit(PUBLISHED["Llama-3.2-1B"][0], rope_theta=10000.5),
     "config.json (LlamaForCausalLM): rope_theta = 10000.5 is not supported: model.rope_base (megatron's "
     "rotary_base) is a positive integer"),
    (_edit(PUBLISHED["Llama-3.2-1B"][0], partial_rotary_factor=0.5),
     "config.json (LlamaForCausalLM): partial_rotary_factor = 0.5 is not supported: RoPE rotates every head "
     "dimension"),
    (_edit(PUBLISHED["Llama-3.2-1B"][0], attention_bias=True),
     "config.json (LlamaForCausalLM): attention_bias = True with mlp_bias = False is not supported; supported: both "
     "or neither (megatron's bias is on every linear layer)"),
    (_edit(PUBLISHED["Llama-3.2-1B"][0], hidden_act="gelu"),
     "config.json (LlamaForCausalLM): hidden_act = 'gelu' is not supported; supported: 'silu' (SwiGLU)"),
    (_edit(PUBLISHED["Qwen2.5-0.5B"][0], use_sliding_window=True, max_window_layers=21),
     "config.json (Qwen2ForCausalLM): a sliding window of 32768 in layers 21-23 only is not supported; supported: "
     "the window in every layer or in none"),
    (_edit(PUBLISHED["Qwen3-0.6B"][0], attention_bias=True),
     "config.json (Qwen3ForCausalLM): attention_bias = true is not supported: biases on Q, K, V and the output "
     "projection but not the MLP have no megatron layer (supported: no biases)"),
    (_edit(PUBLISHED["Qwen3-0.6B"][0], num_hidden_layers=2.5),
     "config.json (Qwen3ForCausalLM): num_hidden_layers = 2.5 is not a positive integer"),
    ({k: v for k, v in PUBLISHED["Qwen3-0.6B"][0].items() if k != "vocab_size"},
     "config.json (Qwen3ForCausalLM) lacks 'vocab_size'"),
]


@pytest.mark.parametrize("config,line", REFUSALS, ids=lambda v: "" if isinstance(v, dict) else v[20:60])
def test_refusals_are_one_line_naming_the_value(config, line):
    with pytest.raises(CheckpointError) as err:
        model_section(config)
    assert str(err.value) == line


def test_a_window_covering_the_sequence_imports_and_one_that_does_not_is_refused():
    """Qwen2 with a window in every layer (max_window_layers 0), Mistral's: model.sliding_window, which a run's
    seq_length may not exceed (the section's own check, one line); the imported section runs at the window."""
    qwen = model_section(_edit(PUBLISHED["Qwen2.5-0.5B"][0], use_sliding_window=True, max_window_layers=0,
                               sliding_window=4096))
    assert (qwen["sliding_window"], qwen["seq_length"]) == (4096, 4096)
    mistral = model_section(PUBLISHED["Mistral-7B-v0.1"][0])
    base = [f"model.{k}={json.dumps(v) if isinstance(v, str) else str(v).lower() if isinstance(v, bool) else v}"
            for k, v in mistral.items() if v is not None]
    cfg = load_config(None, base + ["model.seq_length=2048"])
    check_matches(mistral, cfg.model, "mistral")  # RoPE leaves the length free below the window
    with pytest.raises(Exception, match=r"^model\.sliding_window = 4096 does not cover model\.seq_length = 8192"):
        load_config(None, base + ["model.seq_length=8192"])
    with pytest.raises(CheckpointError, match=r"holds another model: model\.sliding_window = None \(it has 4096\)"):
        check_matches(mistral, load_config(None, base + ["~model.sliding_window"]).model, "mistral")


def test_init_from_compares_the_head_size_as_a_size():
    """A run that leaves model.head_dim unset matches an import whose head size is hidden / heads (Llama-3.2's
    config.json states it); one of another head size is named."""
    section = model_section(PUBLISHED["Qwen3-0.6B"][0])
    keys = [f"model.{k}={json.dumps(v) if isinstance(v, str) else str(v).lower() if isinstance(v, bool) else v}"
            for k, v in section.items() if v is not None and k != "seq_length"]
    check_matches(section, load_config(None, keys + ["model.seq_length=64"]).model, "qwen3")
    with pytest.raises(CheckpointError, match=r"model\.head_dim = 64 \(it has 128\)"):
        check_matches(section, load_config(None, keys + ["model.seq_length=64", "model.head_dim=64"]).model, "qwen3")
    llama = model_section(PUBLISHED["Llama-3.2-1B"][0])
    assert llama["head_dim"] is None  # 64 = 2048 / 32: the heads say it


@pytest.mark.parametrize("scaled", [False, True])
def test_the_exported_rope_reads_alike_in_either_transformers_form(scaled):
    """An export's config.json carries RoPE twice, equal: transformers 5's rope_parameters, and 4.x's top-level
    rope_theta with (scaled) rope_scaling; each form alone reads back as the same rotary embedding (5's own reading
    of the 4.x keys), all four llama3 values included."""
    from transformers import LlamaConfig
    section = model_section(PUBLISHED["Llama-3.2-1B"][0] if scaled else PUBLISHED["SmolLM2-135M"][0])
    config = for_model(section).hf_config(section, section["vocab_size"])
    both = LlamaConfig.from_dict(copy.deepcopy(config)).rope_parameters
    five = LlamaConfig.from_dict({k: v for k, v in copy.deepcopy(config).items()
                                  if k not in ("rope_theta", "rope_scaling")}).rope_parameters
    four = LlamaConfig.from_dict({k: v for k, v in copy.deepcopy(config).items() if k != "rope_parameters"})
    assert both == five == four.rope_parameters
    expected = {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192} if scaled else {"rope_type": "default"}
    assert both == {**expected, "rope_theta": 500000.0 if scaled else 100000.0}
