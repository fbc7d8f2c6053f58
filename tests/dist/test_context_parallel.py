"""Context parallelism (parallel.context): each sequence split over C ranks as 2C chunks trains as on one rank."""
import pytest
import torch

from gpt_harness import run_gpt_steps
from pretrain.data.batch import context_chunks
from ranks import run_ranks

STEPS = 5
SEQ = 512  # the sequence length: chunks of 128 tokens at C = 2, 64 at C = 4
FP32 = ["precision.dtype=\"fp32\"", "model.attention=\"sdpa\"", "model.make_vocab_size_divisible_by=64",
        f"model.seq_length={SEQ}"]  # one padded vocabulary at TP 1 and 2
LLAMA = ["model.position_embedding=\"rope\"", "model.mlp=\"swiglu\"", "model.norm=\"rmsnorm\"", "model.bias=false",
         "model.num_query_groups=2", "model.ffn_hidden_size=64", "model.tie_embeddings=false"]


def test_chunks_are_megatrons_load_balanced_split(monkeypatch):
    """Rank i holds chunks i and 2C − 1 − i, as megatron.core.utils.get_batch_on_this_cp_rank cuts them."""
    from megatron.core import parallel_state
    from megatron.core.utils import get_batch_on_this_cp_rank
    t = torch.arange(2 * 16).view(2, 16)
    for c in (2, 4):
        for rank in range(c):
            monkeypatch.setattr(parallel_state, "get_context_parallel_world_size", lambda c=c: c)
            monkeypatch.setattr(parallel_state, "get_context_parallel_rank", lambda rank=rank: rank)
            expected = get_batch_on_this_cp_rank({"tokens": t.clone()})["tokens"]
            assert torch.equal(context_chunks(t, c, rank), expected), (c, rank)
    by_hand = [[0, 1, 14, 15], [2, 3, 12, 13], [4, 5, 10, 11], [6, 7, 8, 9]]  # C = 4, 8 chunks of 2
    assert [context_chunks(t, 4, r)[0].tolist() for r in range(4)] == by_hand


@pytest.fixture(scope="module")
def one_rank():
    # every layout starts from the same weights (gpt_harness.init_by_global_name): TP slices of one global draw
    return {name: run_ranks(run_gpt_steps, 1, FP32 + extra, STEPS, None, True, timeout=300)
            for name, extra in (("gpt", []), ("llama", LLAMA))}


LAYOUTS = {"C2-stage2": (2, ["zero.stage=2"]), "C4-stage3": (4, ["zero.stage=3"]),
           "TP2xC2-SP-stage3": (4, ["parallel.tensor=2", "parallel.sequence_parallel=true", "zero.stage=3"]),
           "C2xDP2-stage1": (4, ["zero.stage=1"]),
           "TP2xC2-Pa-cpu-stage3": (4, ["parallel.tensor=2", "model.recompute=\"full\"", "zero.partition_activations=true",
                                        "zero.cpu_checkpointing=true", "zero.stage=3"]),
           "C2xPP2-stage1": (4, ["parallel.pipeline=2", "zero.stage=1"])}


@pytest.mark.parametrize("model,layout", [("gpt", "C2-stage2"), ("llama", "C4-stage3"), ("llama", "TP2xC2-SP-stage3"),
                                          ("llama", "C2xDP2-stage1"), ("gpt", "TP2xC2-Pa-cpu-stage3"),
                                          ("llama", "C2xPP2-stage1")])
def test_context_parallel_equals_one_rank(one_rank, model, layout):
    """C context ranks (with TP, SP, Pa+cpu, PP or data parallelism beside), ZeRO over data × context, at S = 512: the
    same losses as one rank within 1e-6 and gradient norms within 2e-6 (fp32; the sums run in another order), at TP 1 every rank the same parameters
    as one rank within 1e-4, a tenth of one step of lr = 1e-3 (a pipeline stage its own layers; the stages together
    all of them): a parameter whose gradient is zero in exact arithmetic (the key part of GPT-2's QKV bias: softmax
    ignores a constant added to every key) or nearly so gets rounding noise, which Adam's m / √v turns into steps
    of O(lr) whatever the layout (2.25e-5 on one QKV weight element of 2048, measured after 10 steps, Llama C 2 × DP 2)."""
    extra = LLAMA if model == "llama" else []
    world, layout_keys = LAYOUTS[layout]
    context = 2 if "C2" in layout else 4
    out = run_ranks(run_gpt_steps, world, FP32 + extra + [f"parallel.context={context}"] + layout_keys, STEPS, None,
                    True, timeout=300)
    (ref,) = one_rank[model]
    for rank in out:
        torch.testing.assert_close(torch.tensor(rank["loss"]), torch.tensor(ref["loss"]), rtol=1e-6, atol=0)
        # the norm: squares summed per shard over data × context ranks, then across them (another order than one
        # rank's): 1.14e-6 apart at C = 4, step 10 (Llama, S = 512)
        torch.testing.assert_close(torch.tensor(rank["grad_norm"]), torch.tensor(ref["grad_norm"]), rtol=2e-6, atol=0)
        for name, p in rank["params"].items() if "TP2" not in layout else ():  # TP-local slices at TP 2
            torch.testing.assert_close(p, ref["params"][global_name(name, rank["pp_rank"])], rtol=0, atol=1e-4, msg=name)
        if "Pa-cpu" in layout:  # each layer's input checkpoint, b × s/C × h fp32, 1/TP of it, on the host
            acts = rank["activations"]
            assert (acts["act/ckpt_device_bytes"], acts["act/ckpt_host_bytes"]) == (0, 2 * 2 * (SEQ // context) * 32 // 2 * 4)
    if "TP2" not in layout:  # the stages together hold every parameter
        assert {global_name(name, rank["pp_rank"]) for rank in out for name in rank["params"]} == set(ref["params"])
    assert ref["loss"][-1] < ref["loss"][0]  # it trained


def global_name(name: str, pp_rank: int, layers_per_stage: int = 1) -> str:
    """A pipeline stage's parameter name as one rank's model calls it: megatron numbers each stage's layers from 0
    (the tests' 2 layers at PP 2: one a stage)."""
    prefix = "decoder.layers."
    if not name.startswith(prefix):
        return name
    layer, rest = name[len(prefix):].split(".", 1)
    return f"{prefix}{int(layer) + pp_rank * layers_per_stage}.{rest}"


def test_checkpoint_at_context_2_resumes_at_context_1(tmp_path):
    """Saved after step 3 of 6 at C 2 × DP 2, stage 2; resumed at C 1 × DP 4, stage 3 (the any-layout path: the
    context ranks are data-parallel replicas to ZeRO): the last 3 losses equal the uninterrupted run's within 1e-6."""
    from checkpoint_harness import train_segment
    seq = ["model.seq_length=32", "precision.dtype=\"fp32\"", "model.attention=\"sdpa\"", "train.global_batch_size=16"]
    whole = run_ranks(train_segment, 4, seq + ["parallel.context=2", "zero.stage=2"], tmp_path, 0, 6, (3,),
                      timeout=300)[0]["loss"]
    resumed = run_ranks(train_segment, 4, seq + ["zero.stage=3"], tmp_path, 3, 6, (), True, timeout=300)[0]
    assert resumed["resumed"]["step"] == 3
    torch.testing.assert_close(torch.tensor(resumed["loss"]), torch.tensor(whole[3:]), rtol=1e-6, atol=0)
