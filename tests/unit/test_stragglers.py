"""The slow-rank record at 3+ ranks, where a median and a mean no longer coincide (#40): the slowest rank's compute
seconds against the median rank's, its host the one gathered at its index."""
import pytest

from pretrain.runtime.stragglers import straggler_record, straggler_text

HOSTS = ["node-a", "node-a", "node-b", "node-c", "node-c"]


def times(compute):
    """[step, compute, comm] per rank: every rank's step lasts as long as the slowest one's."""
    step = max(compute)
    return [[step, c, step - c] for c in compute]


def test_the_ratio_is_to_the_median_not_the_mean():
    compute = [1.0, 1.1, 0.9, 3.0, 1.05]  # median 1.05, mean 1.41: ratio 2.857 against 2.128
    record = straggler_record(times(compute), HOSTS, factor=2.5)
    assert record["perf/slowest_rank"] == 3 and record["perf/slowest_ratio"] == pytest.approx(3.0 / 1.05, rel=1e-12)
    assert record["perf/straggler_rank"] == 3 and record["perf/straggler_host"] == "node-c"
    assert record["perf/straggler_compute_s"] == 3.0 and record["perf/median_compute_s"] == 1.05
    assert straggler_text(record) == ("straggler: rank 3 on node-c computes 2.86× the median rank's time "
                                      "(3.000 s vs 1.050 s a step)")


def test_an_even_count_takes_the_mean_of_the_middle_two_and_the_factor_is_strict():
    compute = [1.0, 2.0, 3.0, 10.0]  # median (2 + 3) / 2 = 2.5: ratio exactly 4
    assert straggler_record(times(compute), HOSTS[:4], factor=3.99)["perf/straggler_rank"] == 3
    record = straggler_record(times(compute), HOSTS[:4], factor=4.0)
    assert record == {"perf/slowest_rank": 3, "perf/slowest_ratio": 4.0}  # not above the factor: no straggler


def test_the_slowest_is_found_at_any_index_and_ties_go_to_the_lowest_rank():
    for slow in range(5):
        compute = [1.0] * 5
        compute[slow] = 4.0
        record = straggler_record(times(compute), HOSTS, factor=2.0)
        assert (record["perf/straggler_rank"], record["perf/straggler_host"]) == (slow, HOSTS[slow])
    record = straggler_record(times([1.0, 5.0, 1.0, 5.0, 1.0]), HOSTS, factor=2.0)
    assert record["perf/straggler_rank"] == 1 and record["perf/slowest_ratio"] == 5.0
