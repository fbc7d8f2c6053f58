"""The bucket-sharded flat layout: even pieces per bucket, one range per (parameter, rank), bucket order."""
import pytest
import torch
import torch.nn as nn

from zero3d.flat import FlatLayout, bucket_members

SIZES = [7, 300, 64, 5, 1000, 33, 12, 257]


def named(sizes):
    return [(f"p{i}", nn.Parameter(torch.zeros(n))) for i, n in enumerate(sizes)]


@pytest.mark.parametrize("dp", [1, 2, 3, 4, 25])
@pytest.mark.parametrize("bucket_elements", [1, 100, 400, 10_000])
def test_buckets_divide_evenly_and_shards_concatenate_pieces(dp, bucket_elements):
    layout = FlatLayout(named(SIZES), dp, bucket_elements)
    assert layout.numel == sum(SIZES)
    assert layout.padded_numel == dp * layout.shard_numel
    by_start = sorted(layout.buckets, key=lambda b: b.start)
    assert by_start[0].start == 0 and by_start[-1].end == layout.padded_numel
    for before, after in zip(by_start, by_start[1:]):
        assert before.end == after.start  # buckets tile the buffer
    raws = [sum(SIZES[i] for i in bucket.slot_indices) for bucket in layout.buckets]
    for bucket, raw in zip(layout.buckets, raws):
        assert bucket.numel == -(-raw // dp) * dp  # padded up to the next multiple of N_d
        assert bucket.start % dp == 0 and bucket.shard_start == bucket.start // dp
    assert sum(raws) == sum(SIZES)
    assert layout.padding == layout.padded_numel - sum(SIZES) == sum(-(-raw // dp) * dp - raw for raw in raws)
    flat = torch.arange(layout.padded_numel)
    shards = [layout.shard_of(flat, rank) for rank in range(dp)]
    assert all(shard.numel() == layout.shard_numel for shard in shards)
    for bucket in layout.buckets:  # a reduce-scatter / all-gather of the bucket: piece r on rank r
        pieces = flat[bucket.start:bucket.end].chunk(dp)
        for rank, piece in enumerate(pieces):
            start = bucket.shard_start
            assert torch.equal(shards[rank][start:start + bucket.piece_numel], piece)


@pytest.mark.parametrize("dp", [1, 2, 3, 8])
def test_each_parameter_rank_pair_owns_one_contiguous_range(dp):
    """The contract checkpoints rely on: slots_in_shard gives, per parameter, the one range of the
    flattened parameter this rank owns; over the ranks the ranges cover each parameter once."""
    layout = FlatLayout(named(SIZES), dp, bucket_elements=150)
    flat = torch.arange(layout.padded_numel)
    covered = {slot.name: torch.zeros(slot.numel, dtype=torch.int64) for slot in layout.slots}
    for rank in range(dp):
        shard = layout.shard_of(flat, rank)
        owned = layout.owned_slot_ranges(rank)
        assert len({slot.name for slot, *_ in owned}) == len(owned)  # one range per parameter
        for (slot, lo, hi), (same, flat_lo, flat_hi, shard_lo) in zip(layout.slots_in_shard(rank), owned):
            assert slot is same and hi - lo == flat_hi - flat_lo and lo == shard_lo
            assert torch.equal(shard[lo:hi], flat[flat_lo:flat_hi])
            assert slot.start <= flat_lo < flat_hi <= slot.end
            covered[slot.name][flat_lo - slot.start:flat_hi - slot.start] += 1
    assert all(bool((count == 1).all()) for count in covered.values())


def test_bucket_order_follows_backward():
    """Bucket 0 holds the last parameters; a bucket closes at >= bucket_elements; a parameter larger
    than that is a bucket of its own."""
    members = bucket_members(SIZES, 400)
    assert members == [[7, 6, 5, 4], [3, 2, 1, 0]]
    assert bucket_members([10, 500, 10], 100) == [[2, 1], [0]]
    layout = FlatLayout(named(SIZES), 4, 400)
    assert layout.slots[-1].end <= layout.buckets[0].end and layout.buckets[0].start > layout.buckets[1].start
    assert [slot.start for slot in layout.slots] == sorted(slot.start for slot in layout.slots)


def test_layout_rejects_nothing_to_lay_out():
    with pytest.raises(ValueError, match="at least one parameter"):
        FlatLayout([], 2, 10)
    with pytest.raises(ValueError, match="dp_size = 0 and bucket_elements = 10 must be >= 1"):
        FlatLayout(named([3]), 0, 10)
