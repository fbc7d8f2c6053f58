"""Document boundaries through the training model (fp32, CPU): a packed sample's per-token losses equal each
document's alone; with eod_mask_loss the loss is the mean over the non-EOD inputs of the whole global batch,
whatever the split into micro-batches, DP ranks or pipeline stages, and so is its gradient."""
import pytest
import torch

from ranks import run_ranks

EOD = 0
DOCUMENTS = ["data.reset_attention_mask=true", "data.reset_position_ids=true"]


def fields(block: torch.Tensor, eod_mask_loss: bool = True) -> dict:
    """One sample as megatron-core's GPTDataset gives it for these keys (its own mask/position function)."""
    from megatron.core.datasets.gpt_dataset import _get_ltor_masks_and_position_ids
    mask, loss_mask, positions = _get_ltor_masks_and_position_ids(block[:-1], EOD, True, True, eod_mask_loss, True)
    return {"tokens": block, "position_ids": positions, "attention_mask": mask, "loss_mask": loss_mask}


def packed_rank(rank, world_size, attention, keys):
    """Per-token losses of [docA EOD docB EOD] (+ the label after it) packed, and of each document alone
    (plain causal token blocks), through build_model with `keys`."""
    from gpt_harness import BASE
    from pretrain.config import load_config
    from pretrain.model.gpt import build_model, gpt_inputs
    from pretrain.runtime.layout import init_layout
    cfg = load_config(None, BASE + [f"model.attention={attention}", "train.global_batch_size=2", *keys])
    init_layout(cfg)
    model = build_model(cfg, torch.device("cpu"))
    g = torch.Generator().manual_seed(3)
    a, b = torch.randint(1, 128, (6,), generator=g), torch.randint(1, 128, (8,), generator=g)
    eod, after = torch.tensor([EOD]), torch.tensor([5])

    def per_token(batch):
        inputs, positions, mask, labels = gpt_inputs(torch.utils.data.default_collate([batch]))
        return model(inputs, positions, mask, labels=labels).detach()[0]
    packed = per_token(fields(torch.cat([a, eod, b, eod, after])))
    return packed, torch.cat([per_token(torch.cat([a, eod, b[:1]])), per_token(torch.cat([b, eod, after]))])


@pytest.mark.parametrize("attention", ["sdpa", "local"])
def test_packed_documents_lose_what_each_document_loses_alone(attention):
    packed, alone = run_ranks(packed_rank, 1, attention, DOCUMENTS, timeout=60)[0]
    assert packed.shape == alone.shape == (16,)
    torch.testing.assert_close(packed, alone, rtol=1e-6, atol=1e-6)


def test_without_the_keys_sdpa_attends_across_documents():
    """The control: the model built without data.reset_attention_mask applies is_causal, and docB's losses differ."""
    packed, alone = run_ranks(packed_rank, 1, "sdpa", [], timeout=60)[0]
    torch.testing.assert_close(packed[:7], alone[:7], rtol=1e-6, atol=1e-6)  # docA sees nothing before it anyway
    assert (packed[7:] - alone[7:]).abs().max() > 1e-3


def micro_batches(count: int) -> list[dict]:
    """`count` micro-batches of 2 samples, seq 16, with 0 to 12 end-of-document tokens each (unequal counts)."""
    g = torch.Generator().manual_seed(7)
    out = []
    for k in range(count):
        samples = []
        for j in range(2):
            block = torch.randint(1, 128, (17,), generator=g)
            block[torch.randperm(16, generator=g)[:4 * ((k + j) % 4)]] = EOD
            samples.append(fields(block))
        out.append(torch.utils.data.default_collate(samples))
    return out


def init_weights(model) -> None:
    """Weights from their global names (any pipeline split starts alike), logits sharpened so that per-token
    losses differ from one token to another (a mean of micro-batch means then differs from the token mean)."""
    from gpt_harness import init_by_global_name
    init_by_global_name(model)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name in ("embedding.word_embeddings.weight", "output_layer.weight"):
                p.mul_(20.0)


def forward(model, inputs, loss_mask):
    """Per-token losses; `loss_mask`: the weights of their gradient (the fused loss's, pretrain/model/loss.py)."""
    inputs, positions, mask, labels = inputs
    return model(inputs, positions, mask, labels=labels, loss_mask=loss_mask)


def normalised_rank(rank, world_size):
    """PP 1 × DP 2 (2 micro-batches a rank) and PP 2 × DP 1 (4 micro-batches) on the same 4 micro-batches and
    weights: the step's loss, and at DP 2 its gradient, against the mean over non-EOD inputs computed by hand."""
    import torch.distributed as dist
    from pretrain.runtime.layout import destroy_model_parallel_groups

    import zero3d
    from gpt_harness import BASE
    from pretrain.config import load_config
    from pretrain.model.gpt import build_model, gpt_inputs, parallel_groups
    from pretrain.runtime.layout import init_layout
    from pretrain.step import mean_loss, run_micro_batches
    from pretrain.train import engine_settings
    batches = micro_batches(4)
    keys = DOCUMENTS + ["data.eod_mask_loss=true", "zero.stage=0", "train.global_batch_size=8"]
    cfg = load_config(None, BASE + keys)
    topo = init_layout(cfg)
    model = build_model(cfg, topo.device)
    init_weights(model)
    masks = [(b["tokens"][:, :-1] != EOD).float() for b in batches]  # by hand: every input but the EODs
    per_token = [forward(model, gpt_inputs(b), m) for b, m in zip(batches, masks)]
    expected = sum((t * m).sum() for t, m in zip(per_token, masks)) / sum(m.sum() for m in masks)
    expected.backward()
    expected_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    mine = batches[2 * topo.dp_rank:2 * topo.dp_rank + 2]

    class Plain:  # run_micro_batches' view of an engine, without ZeRO: backward into .grad
        def __call__(self, *args, **kwargs):
            return model(*args, **kwargs)

        def backward(self, loss):
            loss.backward()
    dp_loss = mean_loss(run_micro_batches(Plain(), mine, cfg, topo), topo)
    for p in model.parameters():  # the engine's DP mean of the gradients
        dist.all_reduce(p.grad, group=topo.dp_group)
        p.grad /= topo.dp
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    mean_of_means = sum(float((t * m).sum() / m.sum()) for t, m in zip(per_token, masks)) / len(masks)
    destroy_model_parallel_groups()

    cfg = load_config(None, BASE + keys + ["parallel.pipeline=2"])
    topo = init_layout(cfg)
    model = build_model(cfg, topo.device)
    init_weights(model)
    engine = zero3d.wrap_model(model, engine_settings(cfg), parallel_groups(model, topo))
    engine.eval()
    pp_loss = mean_loss(run_micro_batches(engine, batches, cfg, topo, forward_only=True), topo)
    return dict(expected=expected.item(), mean_of_means=mean_of_means, dp=dp_loss, pp=pp_loss, grads=grads,
                expected_grads=expected_grads)


def test_eod_masked_loss_is_the_global_mean_over_the_other_tokens_at_dp_and_pp():
    for out in run_ranks(normalised_rank, 2, timeout=120):
        assert abs(out["expected"] - out["mean_of_means"]) > 1e-4  # unequal counts: the normalisation matters
        assert out["dp"] == pytest.approx(out["expected"], rel=1e-6, abs=1e-6)
        assert out["pp"] == pytest.approx(out["expected"], rel=1e-6, abs=1e-6)
        assert out["grads"].keys() == out["expected_grads"].keys()
        for name, g in out["expected_grads"].items():
            torch.testing.assert_close(out["grads"][name], g, rtol=1e-5, atol=1e-7, msg=name)
