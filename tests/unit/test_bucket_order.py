"""Gradient buckets reduce in one fixed order whatever order their gradients arrive in (zero3d/buckets.py).

Every DP rank must issue the same reduce-scatters in the same order. A compiled layer hands autograd its
gradients all at once, in an order that follows its graph, and graphs can differ between ranks (megatron warns
from inside its row-parallel layer on rank 0 only: a graph break there alone), which once made two ranks of a
compiled stage 3 Llama reduce different buckets first and abort. Here the arrival orders are permutations written
in the test, and the launches are recorded by a plan that reduces nothing."""
import itertools

import torch

from zero3d.buckets import GradientBuckets
from zero3d.engine import GroupState
from zero3d.flat import FlatLayout


class RecordingPlan:
    """A CommPlan stand-in: rank 0 of 2, every reduce-scatter recorded (by the buffer it reduces), none run."""

    class Shard:
        rank = 0

    class Stats:
        @staticmethod
        def poll():
            pass

    def __init__(self):
        self.shard, self.stats, self.launched = self.Shard(), self.Stats(), []

    def reduce_scatter(self, piece, buffer, overlap):
        self.launched.append(buffer.numel())
        return None


def model_params():
    """Six parameters of distinct sizes in model order: a 'layer' of three matrices and three vectors."""
    sizes = [(6, 4), (4,), (8, 4), (8,), (4, 8), (4,)]
    return [torch.nn.Parameter(torch.zeros(shape)) for shape in sizes]


def buckets_for(params, plan, held=frozenset()):
    decay = [(f"w{i}", p) for i, p in enumerate(params) if p.dim() > 1]
    vectors = [(f"b{i}", p) for i, p in enumerate(params) if p.dim() == 1]
    groups = [GroupState(name, FlatLayout(named, dp_size=2, bucket_elements=1), [p for _, p in named], decays)
              for name, named, decays in (("decay", decay, True), ("no_decay", vectors, False))]
    return GradientBuckets(groups, plan, lambda *args: None, dtype=torch.float32, device=torch.device("cpu"),
                           pre_scale=1.0, held_elsewhere=held, overlap=False,
                           position={p: i for i, p in enumerate(params)})


def launches(order, held=frozenset()):
    params = model_params()
    plan = RecordingPlan()
    buckets = buckets_for(params, plan, {params[i] for i in held})
    for i in order:
        params[i].grad = torch.ones_like(params[i])
        buckets.hold(params[i]) if i in held else buckets.add(params[i])
    buckets.add_held({params[i]: NoComm() for i in sorted(held)})
    buckets.launch_remaining()
    return plan.launched


class NoComm:
    @staticmethod
    def all_reduce(tensor, tag):
        pass


def test_every_arrival_order_reduces_the_buckets_in_the_same_order():
    """One bucket per parameter (bucket_elements = 1): eager backward's order (latest parameter first) launches them
    latest first; each of the 720 arrival orders launches exactly that sequence."""
    eager = launches([5, 4, 3, 2, 1, 0])
    sizes = [p.numel() + p.numel() % 2 for p in model_params()]  # each bucket padded to a multiple of DP = 2
    assert eager == sizes[::-1]
    for order in itertools.permutations(range(6)):
        assert launches(order) == eager, order


def test_eager_order_launches_each_bucket_as_it_completes():
    """No waiting in eager order: the k-th gradient to arrive launches the k-th reduction at once."""
    params = model_params()
    plan = RecordingPlan()
    buckets = buckets_for(params, plan)
    for k, i in enumerate([5, 4, 3, 2, 1, 0]):
        params[i].grad = torch.ones_like(params[i])
        buckets.add(params[i])
        assert len(plan.launched) == k + 1


def test_held_gradients_reduce_at_the_end_without_holding_the_rest_back():
    """A parameter whose gradient is summed over another group first (held) completes its bucket in add_held; the
    other buckets still launch in order as they complete, in every arrival order."""
    eager = launches([5, 4, 3, 2, 1, 0], held={3})
    assert eager[-1] == 8  # parameter 3's bucket, last
    for order in itertools.permutations(range(6)):
        assert launches(order, held={3}) == eager, order


def test_a_launched_buffer_holds_each_gradient_summed_and_zeros_where_none_arrived(monkeypatch):
    """A bucket's buffer is allocated unfilled (here: NaN, standing in for whatever memory held): the gradient that
    reaches a slot first is written into it, a second one for the same slot while the bucket is still open (a
    pipeline schedule's next micro-batch) is added, and at launch the slot of a parameter that got no gradient and
    the padding (4 + 3 elements padded to 9 for DP 3) are zeros: the reduce-scatter sees four 3s and five 0s."""
    a, b = torch.nn.Parameter(torch.zeros(4)), torch.nn.Parameter(torch.zeros(3))
    group = GroupState("no_decay", FlatLayout([("a", a), ("b", b)], dp_size=3, bucket_elements=100), [a, b], False)
    seen = []

    class Plan(RecordingPlan):
        def reduce_scatter(self, piece, buffer, overlap):
            seen.append(buffer.clone())

    buckets = GradientBuckets([group], Plan(), lambda *args: None, dtype=torch.float32, device=torch.device("cpu"),
                              pre_scale=1.0, held_elsewhere=frozenset(), overlap=False, position={a: 0, b: 1})
    empty = torch.empty
    monkeypatch.setattr(torch, "empty", lambda *args, **kwargs: empty(*args, **kwargs).fill_(float("nan")))
    for value in (1.0, 2.0):
        a.grad = torch.full((4,), value)
        buckets.add(a)
        assert a.grad is None and b.grad is None
    assert not seen  # b's gradient is still missing: the bucket waits for the end of backward
    buckets.launch_remaining()
    assert len(seen) == 1 and torch.equal(seen[0], torch.tensor([3.0] * 4 + [0.0] * 5))
