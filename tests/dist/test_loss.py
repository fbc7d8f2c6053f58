"""The model's loss (pretrain/model/loss.py) through the real model path.

Over the real vocabulary: at vocabulary 300 megatron pads the output layer to 384 rows (TP 1) or 512 (TP 2 and 4: at
TP 4 rank 2 holds ids 256..383, 44 real, and rank 3 only padding); the loss of each path (megatron's, the fused
chunked one, the recomputed chunked one), in training and in evaluation, equals torch's cross-entropy over columns
[:300] of the model's own gathered logits, at TP 1, 2 (with SP), 4, the last pipeline stage and context parallelism;
the logits the model returns put −inf on every padded id.

The fused loss equals the recomputed chunked loss and megatron's — per-token loss, every parameter's gradient and the
output layer's input gradient within 1e-6 (fp32) — at TP 1 and 2, with and without SP, tied and untied, with a loss
mask, at chunks of 7 tokens (32 tokens: 4 chunks and 4 left); and with a bias (which GPTModel's output layer has not),
equals an independent reference at TP 2. Only megatron's loss saves a [tokens × vocab/TP] tensor for backward.
"""
import torch

from gpt_harness import BASE, SyntheticTokens
from ranks import run_ranks

VOCAB = 300
TOKENS = torch.randint(0, VOCAB, (2, 17), generator=torch.Generator().manual_seed(7))  # chosen here, ids up to 299
PATHS = {"megatron": ["model.loss_chunk_tokens=0"], "fused": ["model.loss_chunk_tokens=7"],
         "recomputed": ["model.loss_chunk_tokens=7", "model.loss_recompute=true"]}
LAYOUTS = {"tp1": ["parallel.tensor=1"], "tp2": ["parallel.tensor=2"],
           "tp2-sp": ["parallel.tensor=2", "parallel.sequence_parallel=true"], "tp4": ["parallel.tensor=4"],
           "tp4-bf16": ["parallel.tensor=4", 'precision.dtype="bf16"'],
           "tp2-fp16": ["parallel.tensor=2", 'precision.dtype="fp16"'],
           "pp2-tp2": ["parallel.tensor=2", "parallel.pipeline=2"], "cp2-tp2": ["parallel.tensor=2", "parallel.context=2"]}


def _real_vocab_rank(rank, world_size):
    """{(layout, path): (loss, reference, eval loss, padded logits all −inf, padded columns)} on the ranks that
    compute a loss."""
    import torch.distributed as dist
    from megatron.core import parallel_state, tensor_parallel

    from pretrain.config import load_config
    from pretrain.model.gpt import build_model, gpt_loss, local_inputs
    from pretrain.runtime.layout import destroy_model_parallel_groups, init_layout
    out = {}
    for layout, keys in LAYOUTS.items():
        for path, loss_keys in PATHS.items():
            cfg = load_config(None, BASE + [f"model.vocab_size={VOCAB}", "train.global_batch_size=8", *keys, *loss_keys])
            topo = init_layout(cfg)
            model = build_model(cfg, topo.device)
            context = (topo.cp, topo.cp_rank)
            inputs, positions, mask, labels, _ = local_inputs(TOKENS, context)
            if topo.pp > 1:  # stage 0 hands its hidden states to stage 1, which computes the loss
                with torch.no_grad():
                    if topo.pp_rank == 0:
                        dist.send(model(inputs, positions, mask), parallel_state.get_pipeline_model_parallel_next_rank())
                        destroy_model_parallel_groups()
                        continue
                    hidden = torch.empty(inputs.shape[1], inputs.shape[0], cfg.model.hidden_size)
                    dist.recv(hidden, parallel_state.get_pipeline_model_parallel_prev_rank())
                    model.set_input_tensor(hidden)
                    loss = model(inputs, positions, mask, labels=labels).mean()
                    model.set_input_tensor(hidden)
                    logits = model(inputs, positions, mask)
                    evaluated = loss
            else:
                loss = gpt_loss(model, TOKENS, None, context)
                loss.backward()  # every path's backward runs on the model
                model.eval()
                with torch.no_grad():
                    evaluated = gpt_loss(model, TOKENS, None, context)
                    logits = model(inputs, positions, mask)
            logits = tensor_parallel.gather_from_tensor_model_parallel_region(logits).float()  # [b, s, padded vocab]
            per_token = torch.nn.functional.cross_entropy(logits[..., :VOCAB].flatten(0, 1), labels.flatten(),
                                                          reduction="none")
            reference = per_token.mean() / topo.cp  # a context rank's share, as gpt_loss's
            out[layout, path] = (loss.item(), reference.item(), evaluated.item(),
                                 bool((logits[..., VOCAB:] == float("-inf")).all()), logits.shape[-1] - VOCAB)
            destroy_model_parallel_groups()
    return out


def test_loss_is_over_the_real_vocabulary_on_every_layout_and_path():
    ranks = run_ranks(_real_vocab_rank, 4, timeout=240)
    seen = set()
    for rank_out in ranks:
        for (layout, path), (loss, reference, evaluated, padded_at_minus_inf, padded) in rank_out.items():
            where = f"{layout} {path}"
            half = layout.endswith(("bf16", "fp16"))
            # fp32: the same logits' cross-entropy to float rounding; bf16 / fp16: the chunks' logits GEMMs round
            # apart from the whole batch's by an ulp of a logit (removing the padding mask moves the loss by 0.5)
            tolerance = 1e-2 if half else 1e-6
            assert abs(loss - reference) <= tolerance, (where, loss, reference)
            assert abs(evaluated - reference) <= tolerance, (where, evaluated, reference)
            assert padded_at_minus_inf and padded == (84 if layout == "tp1" else 212), (where, padded)
            seen.add(layout)
    assert seen == set(LAYOUTS)


def _hidden_gradient_hook(model, grads):
    def keep(module, args):
        args[0].register_hook(lambda grad: grads.__setitem__("output_layer input", grad.clone()))
    return model.output_layer.register_forward_pre_hook(keep)


CASES = [(1, []), (2, []), (2, ["parallel.sequence_parallel=true"]), (2, ["model.tie_embeddings=true"]),
         (2, ["model.tie_embeddings=true", "parallel.sequence_parallel=true"])]


def _paths_rank(rank, world_size):
    from pretrain.config import load_config
    from pretrain.model.gpt import build_model, gpt_inputs
    from pretrain.runtime.layout import destroy_model_parallel_groups, init_layout
    out = []
    for tp, extra in CASES:
        runs = {}
        for path, loss_keys in PATHS.items():
            cfg = load_config(None, BASE + [f"model.vocab_size={VOCAB}", f"parallel.tensor={tp}", *loss_keys, *extra])
            init_layout(cfg)  # seeds every generator identically
            model = build_model(cfg, torch.device("cpu"))
            tokens = torch.stack([SyntheticTokens(VOCAB, cfg.model.seq_length).sample(i) for i in range(2)])
            inputs, positions, mask, labels = gpt_inputs(tokens)
            weights = torch.linspace(0.0, 1.5, labels.numel()).view_as(labels)  # a loss mask: one 0, unequal weights
            grads, saved = {}, []
            hook = _hidden_gradient_hook(model, grads)
            with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.shape) or t, lambda t: t):
                per_token = model(inputs, positions, mask, labels=labels, loss_mask=weights)
            ((per_token * weights).sum() / weights.sum()).backward()
            hook.remove()
            vocab_slice = cfg.model.padded_vocab_size(tp) // tp  # logits-shaped: [..., vocab/TP]
            grads.update({n: p.grad.clone() for n, p in model.named_parameters()})
            runs[path] = dict(loss=per_token.detach(), grads=grads,
                              largest_saved=max([s.numel() for s in saved if s[-1] == vocab_slice] or [0]))
            destroy_model_parallel_groups()
        out.append(dict(tp=tp, extra=extra, runs=runs, full_logits=labels.numel() * vocab_slice))
    out.append(_bias_case())
    return out


def _bias_case():
    """chunked_loss with a bias at TP 2 (GPTModel's output layer has none), fused and recomputed, against torch's
    cross-entropy over the real columns of the whole weight and bias: loss, hidden, weight-slice, bias-slice grads."""
    from megatron.core import parallel_state

    from pretrain.config import load_config
    from pretrain.model.loss import chunked_loss
    from pretrain.runtime.layout import destroy_model_parallel_groups, init_layout
    init_layout(load_config(None, BASE + ["parallel.tensor=2"]))
    group, rank = parallel_state.get_tensor_model_parallel_group(), parallel_state.get_tensor_model_parallel_rank()
    g = torch.Generator().manual_seed(3)
    hidden, weight, bias = torch.randn(16, 2, 32, generator=g), torch.randn(512, 32, generator=g), torch.randn(512, generator=g)
    labels, mask = torch.randint(0, VOCAB, (16, 2), generator=g), torch.rand(16, 2, generator=g).round()
    out = {}
    for path in ("fused", "recomputed", "reference"):
        h, w, b = (t.clone().requires_grad_() for t in (hidden, weight, bias))
        mine = slice(256 * rank, 256 * (rank + 1))  # this TP rank's rows
        if path == "reference":
            per_token = torch.nn.functional.cross_entropy((h @ w.t() + b)[..., :VOCAB].flatten(0, 1), labels.flatten(),
                                                          reduction="none").view(16, 2)
        else:
            per_token = chunked_loss(h, w[mine], b[mine], labels, 7, False, group, VOCAB, loss_mask=mask,
                                     recompute=path == "recomputed")
        ((per_token * mask).sum() / mask.sum()).backward()
        out[path] = {"loss": per_token.detach(), "hidden": h.grad, "weight": w.grad[mine], "bias": b.grad[mine]}
    destroy_model_parallel_groups()
    return out


def test_fused_loss_equals_the_recomputed_and_megatron_losses():
    for rank_out in run_ranks(_paths_rank, 2, timeout=240):
        *cases, bias_case = rank_out
        for case in cases:
            ref = case["runs"]["megatron"]
            assert ref["largest_saved"] == case["full_logits"]  # megatron saves the softmax over all tokens
            for path in ("recomputed", "fused"):
                got, where = case["runs"][path], f"TP {case['tp']} {case['extra']} {path}"
                torch.testing.assert_close(got["loss"], ref["loss"], rtol=1e-6, atol=1e-6, msg=where)
                assert got["grads"].keys() == ref["grads"].keys() and "output_layer input" in got["grads"]
                for name, grad in ref["grads"].items():
                    torch.testing.assert_close(got["grads"][name], grad, rtol=1e-6, atol=1e-6, msg=f"{where} {name}")
                assert got["largest_saved"] == 0, where  # no [tokens × vocab/TP] tensor kept for backward
        for path in ("fused", "recomputed"):
            for name, expected in bias_case["reference"].items():
                torch.testing.assert_close(bias_case[path][name], expected, rtol=1e-6, atol=1e-6, msg=f"{path} {name}")


def test_fused_chunks_at_stage3_train_as_megatron_loss_at_stage0(gpt_run):
    """ZeRO stage 3 gathers the output layer for the forward that now also makes its weight gradient, which reaches the
    stage's hooks once, in backward: with the fused loss in chunks of 7 (each micro-batch's 32 tokens: 5 chunks) at
    TP 2 × DP 2 with SP, untied and tied, 4 steps train as stage 0 with megatron's loss (fp32, 1e-5 as test_stage3)."""
    from gpt_harness import assert_close_runs
    for extra in ([], ["model.tie_embeddings=true"]):
        common = ["parallel.tensor=2", "parallel.sequence_parallel=true", f"model.vocab_size={VOCAB}",
                  "train.global_batch_size=4", *extra]
        ref = gpt_run(4, common + ["zero.stage=0", "model.loss_chunk_tokens=0"], 4)
        out = gpt_run(4, common + ["zero.stage=3", "model.loss_chunk_tokens=7"], 4)
        assert_close_runs(ref, out, rtol=1e-5)
        weight = "embedding.word_embeddings.weight" if extra else "output_layer.weight"  # the loss's weight
        moved = (out[0]["params"][weight] - out[0]["params_init"][weight]).abs().max()
        assert moved > 100 * 1e-5, moved  # 4 Adam steps of lr 1e-3: far beyond the tolerance
