"""Stage 3's peak moment (analysis/stage3_peak.py) by hand: which of the loss, the last layer's backward and the end of
the first layer's holds the most, and what the estimate's breakdown then holds."""
from analysis import estimate as est
from model_shape.gpt import GPTShape

B, S, E = 2, 32, 2  # micro-batch, tokens, bf16 bytes


def breakdown(shape: GPTShape, gpus: int, **step) -> est.MemoryBreakdown:
    return est.estimate(shape, *est.job_of(gpus=gpus, stage=3, micro_batch=B, precision="bf16", recompute="full",
                                           grad_shard_per_step=True, **step))


def test_a_large_vocabulary_peaks_at_the_loss():
    """A 50,000-word vocabulary (padded 50,048) at h 64 and 512 tokens: the logits (b·s·V_pad, 2 + 4 bytes each)
    outweigh the shards and a layer; at the loss no gradient shard exists yet, every checkpoint (L·b·s·h·e) is held
    with the final norm's input and output (2·b·s·h·e) and the gathered output layer (V_pad·h·2)."""
    s = 512
    shape = GPTShape(layers=4, hidden=64, heads=4, seq=s, vocab=50_000)
    m = breakdown(shape, 1)
    assert m.peak_moment == "the loss"
    assert m.grads_not_at_peak == m.grad_bytes
    assert (m.checkpoint_bytes, m.working_set_bytes) == (4 * B * s * 64 * E, 2 * B * s * 64 * E)
    assert (m.logits_bytes, m.buffer_bytes) == (B * s * 50_048 * (2 + 4), 50_048 * 64 * 2)


def test_tied_embeddings_gather_the_embedding_unit_for_the_loss():
    """Tied word embeddings: the output layer is the embedding's weight, so the loss gathers the embedding's unit,
    word and position embeddings ((V_pad + s)·h·2)."""
    s = 512
    m = breakdown(GPTShape(layers=4, hidden=64, heads=4, seq=s, vocab=50_000, tied=True), 1)
    assert m.peak_moment == "the loss" and m.buffer_bytes == (50_048 + s) * 64 * 2


def test_one_rank_with_a_small_vocabulary_peaks_at_the_end_of_the_first_layers_backward():
    """One rank, h 256, 1,000 words: a layer's gradient shard (2·(12h² + 13h) bytes) outweighs a checkpoint, so the
    end of backward holds the most: every unit's shard but the embedding's and the first layer's, G·(1 − (embedding
    + layer)/Ψ), one checkpoint and the layer's working set, the buffers as at the last layer."""
    h = 256
    shape = GPTShape(layers=4, hidden=h, heads=4, seq=S, vocab=1000)
    m = breakdown(shape, 1, loss_chunk_tokens=16)
    psi, layer, embedding = shape.params(), 12 * h * h + 13 * h, 1024 * h + S * h
    assert m.peak_moment == "the end of the first layer's backward"
    assert m.grads_not_at_peak == 2 * (embedding + layer)  # of G = 2Ψ bf16 bytes, the shards not yet allocated
    assert m.checkpoint_bytes == B * S * h * E and m.logits_bytes == 0
    assert m.working_set_bytes == est.layer_activation_bytes(S, B, h, 4, 1, E)


def test_many_ranks_peak_at_the_last_layers_backward():
    """The same model over 64 ranks: the shards are small, so the last layer's backward — every checkpoint, the
    layer's working set, the four buffers, the output layer's and the last layer's shards — holds the most."""
    h = 256
    shape = GPTShape(layers=4, hidden=h, heads=4, seq=S, vocab=1000)
    m = breakdown(shape, 64, loss_chunk_tokens=16)
    psi, layer = shape.params(), 12 * h * h + 13 * h
    terms = est.buffer_terms(shape, stage=3, psi=psi, micro_batch=B, tp=1, bucket_elements=est.DEFAULT_BUCKET_ELEMENTS,
                             precision="bf16", prefetch_units=1)
    assert m.peak_moment == "the last layer's backward"
    assert m.grad_bytes == 2 * psi / 64 and m.grad_bytes - m.grads_not_at_peak == 2 * (1024 * h + layer) / 64
    assert (m.checkpoint_bytes, m.logits_bytes, m.buffer_bytes) == (4 * B * S * h * E, 0, sum(terms.values()))


def test_without_the_late_shard_the_loss_and_the_last_layer_hold_it_whole():
    """Two micro-batches a step (no late shard): every moment holds the whole shard, none leaves any of it out."""
    shape = GPTShape(layers=4, hidden=64, heads=4, seq=512, vocab=50_000)
    m = est.estimate(shape, *est.job_of(gpus=1, stage=3, micro_batch=B, precision="bf16", recompute="full"))
    assert m.peak_moment == "the loss" and m.grads_not_at_peak == 0
