"""The chunked loss (pretrain/model/loss.py) equals megatron's GPTModel loss (ColumnParallelLinear + vocab_parallel_cross_entropy)
within 1e-6, per token and in every parameter gradient, at TP 1 and TP 2 (with and without SP, tied embeddings),
and saves no [tokens × vocab/TP] tensor for backward where megatron's saves one. One 2-rank run."""
import torch

from gpt_harness import BASE, SyntheticTokens
from ranks import run_ranks

CASES = [(1, []), (2, []), (2, ["parallel.sequence_parallel=true"]), (2, ["model.tie_embeddings=true"])]
CHUNKS = (0, 5, 1024)  # 0: megatron's loss; 5: 7 uneven chunks of the 32 tokens; 1024: one chunk


def loss_rank(rank, world_size):
    from pretrain.runtime.layout import destroy_model_parallel_groups

    from pretrain.config import load_config
    from pretrain.model.gpt import build_model, gpt_inputs
    from pretrain.runtime.layout import init_layout
    out = []
    for tp, extra in CASES:
        runs = {}
        for chunk in CHUNKS:
            # vocab 200 (padded: 256): no other activation is [..., vocab/TP]-shaped
            cfg = load_config(None, BASE + ["model.vocab_size=200", f"parallel.tensor={tp}",
                                            f"model.loss_chunk_tokens={chunk}", *extra])
            init_layout(cfg)  # seeds every generator identically
            model = build_model(cfg, torch.device("cpu"))
            tokens = torch.stack([SyntheticTokens(cfg.model.vocab_size, cfg.model.seq_length).sample(i)
                                  for i in range(2)])
            inputs, positions, mask, labels = gpt_inputs(tokens)
            saved = []
            with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.shape) or t, lambda t: t):
                per_token = model(inputs, positions, mask, labels=labels)
            weights = torch.linspace(0.5, 1.5, per_token.numel()).view_as(per_token)  # distinct token weights
            (per_token * weights).sum().backward()
            vocab_slice = cfg.model.padded_vocab_size(tp) // tp  # logits-shaped: [..., vocab/TP]
            runs[chunk] = dict(loss=per_token.detach(),
                               largest_saved=max([s.numel() for s in saved if s[-1] == vocab_slice] or [0]),
                               grads={n: p.grad.clone() for n, p in model.named_parameters()})
            destroy_model_parallel_groups()
        out.append(dict(tp=tp, extra=extra, runs=runs, vocab_slice=vocab_slice,
                        tokens=labels.numel()))
    return out


def test_chunked_loss_equals_megatron_at_tp1_and_tp2():
    for rank_out in run_ranks(loss_rank, 2, timeout=120):
        for case in rank_out:
            ref = case["runs"][0]
            full_logits = case["tokens"] * case["vocab_slice"]
            assert ref["largest_saved"] == full_logits  # megatron saves the softmax over all tokens
            for chunk in CHUNKS[1:]:
                got, where = case["runs"][chunk], f"TP {case['tp']} {case['extra']} chunk {chunk}"
                torch.testing.assert_close(got["loss"], ref["loss"], rtol=1e-6, atol=1e-6, msg=where)
                assert got["grads"].keys() == ref["grads"].keys()
                for name, g in ref["grads"].items():
                    torch.testing.assert_close(got["grads"][name], g, rtol=1e-6, atol=1e-6, msg=f"{where} {name}")
            assert case["runs"][5]["largest_saved"] == 0, case["tp"]  # chunks: recomputed in backward, none saved
