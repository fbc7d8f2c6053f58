"""ZeRO++ foundations on 4 gloo ranks as 2 nodes × 2: node sub-groups, qwZ / qgZ against the exact fp32 collectives,
and every mode's bytes per link against comm_model's formulas."""
from datetime import timedelta
from fractions import Fraction

import pytest
import torch

from ranks import run_ranks
from analysis.comm_model import ZEROPP_MODES, link_bytes, zeropp_collectives

WORLD, GPN, C, BLOCK = 4, 2, 256, 64  # C: elements per DP rank's chunk; Ψ = 4·C
PSI = WORLD * C


def randn(seed: int, n: int) -> torch.Tensor:
    return torch.randn(n, generator=torch.Generator().manual_seed(seed))


def representable(seed: int, n: int, levels: int) -> torch.Tensor:
    """Odd integers in [−levels, levels] with `levels` at every block start: scale 1 in a rank's blocks,
    2 in a node's sum of two (even, maximum 2·levels), so every quantization is exact."""
    x = torch.randint(-(levels // 2) - 1, levels // 2 + 1, (n,), generator=torch.Generator().manual_seed(seed))
    x = (2 * x + 1).clamp(-levels, levels).float()
    x[::BLOCK] = levels
    return x


def _ranks(rank, world):
    import torch.distributed as dist

    from pretrain.runtime.rendezvous import launcher_gpus_per_node
    from zero3d.comm.core import Comm, CommStats, p2p_all_to_all, wait_all
    from zero3d.comm.hierarchical import quantized_reduce_scatter
    from analysis.modes import named_modes
    from zero3d.comm.plan import CommPlan
    from zero3d.comm.quantize import QuantSpec
    from zero3d.comm.topology import TopologyError, build_node_topology
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    out = {}
    try:  # 3 ranks per node does not divide 4: every rank refuses, before any group is made
        build_node_topology(dist.group.WORLD, gpus_per_node=3)
    except TopologyError as err:
        out["refused"] = str(err)
    try:  # ranks that disagree on the node size: every rank refuses alike, before any group is made
        build_node_topology(dist.group.WORLD, gpus_per_node=2 if rank < 2 else 4)
    except TopologyError as err:
        out["disagree"] = str(err)
    topo = build_node_topology(dist.group.WORLD, gpus_per_node=GPN, timeout=timedelta(seconds=60))
    ranks_of = dist.get_process_group_ranks
    launcher = build_node_topology(dist.group.WORLD, launcher_gpus_per_node())  # run_ranks sets LOCAL_WORLD_SIZE = 4
    out["launcher"] = (launcher.nodes, launcher.per_node, ranks_of(launcher.intra_group), launcher.inter_group)
    out["topo"] = (topo.node, topo.local, ranks_of(topo.intra_group), ranks_of(topo.inter_group))
    # TP 2 × DP 2 (TP-consecutive): each DP group has one rank on each node
    dp_groups = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    tp_topo = build_node_topology(dp_groups[rank % 2], gpus_per_node=GPN, dp_groups=[[0, 2], [1, 3]])
    out["tp_topo"] = (tp_topo.node, tp_topo.per_node, tp_topo.intra_group, ranks_of(tp_topo.inter_group))

    world = Comm(None, CommStats())
    intra, inter = (Comm(g, CommStats(), gpus_per_node=GPN) for g in (topo.intra_group, topo.inter_group))
    for bits in (8, 4):
        spec = QuantSpec(bits, BLOCK)
        full = torch.empty(PSI)
        world.all_gather_quantized(full, randn(rank, C), spec, "params")
        out[f"qwz{bits}"] = full.clone()
        world.all_gather_quantized(full, representable(rank, C, 127 if bits == 8 else 7), spec, "params")
        out[f"qwz{bits}_exact"] = full.clone()
        piece = torch.empty(C)
        quantized_reduce_scatter(piece, randn(100 + rank, PSI), intra, inter, spec)
        out[f"qgz{bits}"] = piece.clone()
        quantized_reduce_scatter(piece, representable(100 + rank, PSI, 127 if bits == 8 else 7), intra, inter, spec)
        out[f"qgz{bits}_exact"] = piece.clone()
    # asynchronous (stage 3's prefetch): `full` untouched until wait(), then what the synchronous call gave
    full = torch.full((PSI,), float("nan"))
    pending = world.all_gather_quantized(full, randn(rank, C), QuantSpec(8, BLOCK), "params", async_op=True)
    dist.barrier()  # every rank's bytes have been sent: only the dequantization waits for wait()
    out["qwz8_async_before_wait"] = full.clone()
    pending.wait()
    out["qwz8_async"] = full.clone()
    full = torch.empty(PSI)  # fp16 scales: the bound holds with the stored (rounded-up) scale
    world.all_gather_quantized(full, randn(rank, C), QuantSpec(8, BLOCK, torch.float16), "params")
    out["qwz8_fp16_scales"] = full
    a2a_in, a2a_out = torch.arange(8.0) + 10 * rank, torch.empty(8)
    p2p_all_to_all(a2a_out, a2a_in, None)  # the fallback of backends without all_to_all_single
    out["p2p"] = a2a_out

    # one stage-3 step's collectives per mode, as the engine's CommPlan issues them, counted per link (fp32: 4 bytes)
    for mode in ZEROPP_MODES:
        stats = CommStats()
        plan = CommPlan(named_modes("" if mode == "stage 3" else mode), None, stats, node=topo, quant_block=BLOCK)
        shard = PSI // plan.shard.size  # hybrid: shards of the node
        full, piece, secondary = torch.randn(PSI), torch.randn(shard), torch.randn(PSI // GPN)
        for phase in ("params", "params_bwd"):
            wait_all([plan.gather(full, piece, phase, secondary=secondary)])
        plan.reduce_scatter(piece, full, async_op=False)
        plan.sum_across_replicas([piece])
        out[mode] = stats.report()
    return out


@pytest.fixture(scope="module")
def results():
    return run_ranks(_ranks, WORLD, timeout=120)


def test_node_groups(results):
    for rank, r in enumerate(results):
        assert "does not split evenly into nodes of 3" in r["refused"]
        assert "ranks disagree on gpus_per_node: [2, 4]" in r["disagree"]
        node, local = rank // 2, rank % 2
        assert r["topo"] == (node, local, [2 * node, 2 * node + 1], [local, local + 2])
        assert r["launcher"] == (1, 4, [0, 1, 2, 3], None)
        assert r["tp_topo"] == (node, 1, None, [rank % 2, rank % 2 + 2])
        assert r["p2p"].tolist() == [2 * rank + 10 * s + j for s in range(4) for j in range(2)]


def _block_max(x):
    return x.abs().view(-1, BLOCK).amax(1).repeat_interleave(BLOCK)


@pytest.mark.parametrize("bits,levels", [(8, 127), (4, 7)])
def test_quantized_all_gather_within_bound(results, bits, levels):
    exact = torch.cat([randn(r, C) for r in range(WORLD)])
    for r in results:
        assert ((r[f"qwz{bits}"] - exact).abs() <= _block_max(exact) / levels / 2 * (1 + 1e-6)).all()
        assert not torch.equal(r[f"qwz{bits}"], exact)  # it did quantize
        assert torch.equal(r[f"qwz{bits}"], results[0][f"qwz{bits}"])  # every rank computes with the same weights
        assert torch.equal(r[f"qwz{bits}_exact"], torch.cat([representable(q, C, levels) for q in range(WORLD)]))


def test_async_quantized_all_gather_dequantizes_on_wait(results):
    for r in results:
        assert r["qwz8_async_before_wait"].isnan().all()
        assert torch.equal(r["qwz8_async"], r["qwz8"])


def test_quantized_all_gather_with_fp16_scales(results):
    exact = torch.cat([randn(r, C) for r in range(WORLD)])
    for r in results:  # an fp16 scale is at most one fp16 step (2^-10 relative) above max / 127
        err = (r["qwz8_fp16_scales"] - exact).abs()
        assert (err <= _block_max(exact) / 127 / 2 * (1 + 2**-10 + 1e-6)).all() and err.max() > 0


@pytest.mark.parametrize("bits,levels", [(8, 127), (4, 7)])
def test_quantized_reduce_scatter_within_bound(results, bits, levels):
    fulls = [randn(100 + r, PSI) for r in range(WORLD)]
    exact = torch.stack(fulls).double().sum(0)
    # QuantSpec's bound summed over the senders: every rank's block maxima in step 1, every node's partial
    # sums in step 2 (their maxima raised by step 1's error); scales are at most the whole tensor's max / levels
    m = [f.abs().max().item() for f in fulls]
    step1 = sum(m) / levels / 2
    partial = [(fulls[2 * i] + fulls[2 * i + 1]).abs().max().item() + step1 for i in range(2)]
    bound = (step1 + sum(partial) / levels / 2) * (1 + 1e-6)
    for rank, r in enumerate(results):
        mine = exact[rank * C:(rank + 1) * C]
        err = (r[f"qgz{bits}"].double() - mine).abs()
        assert err.max() <= bound and err.max() > 0
        exact_rep = sum(representable(100 + q, PSI, levels) for q in range(WORLD))[rank * C:(rank + 1) * C]
        assert torch.equal(r[f"qgz{bits}_exact"], exact_rep)


def test_bytes_per_link_match_the_formulas(results):
    # By hand, Ψ = 1024 fp32 elements (b = 4), N = 4 ranks, m = 2 a node, k = 2 nodes, blocks of 64 (each rank's
    # chunk C = 256 is 4 whole blocks): a ring over N sends S(N−1)/N and 1/m of it crosses nodes.
    plain = results[0]["stage 3"]["comm/inter_node_bytes"]
    # stage 3: forward gather, backward gather, reduce-scatter: 3Ψb(N−1)/N / m = 3 · 1024 · 4 · 3/4 / 2
    assert plain == 3 * PSI * 4 * Fraction(3, 4) / 2 == 4608
    # qwZ+hpZ+qgZ: the int8 forward gather Ψ(1 + 4/64)(N−1)/N / m = 1024 · 17/16 · 3/4 / 2 = 408; the hpZ backward
    # gather inside the node, 0; qgZ int4 across nodes, (k−1) chunks of Ψ/N (4/8 + 4/64) = 256 · 9/16 = 144, and its
    # overflow flag, one fp32 all-reduced over N: 2 · 4 · 3/4 / 2 = 3
    assert results[0]["qwZ+hpZ+qgZ"]["comm/inter_node_bytes"] == 408 + 144 + 3
    for mode in ZEROPP_MODES:  # qgZ's overflow flag included: the plan issues it, comm_model counts it
        intra, inter = link_bytes(zeropp_collectives(mode, PSI, WORLD, GPN, value_bytes=4, block=BLOCK))
        for r in results:
            report = r[mode]
            assert Fraction(report["comm/inter_node_bytes"]) == inter, mode
            assert Fraction(report["comm/intra_node_bytes"]) == intra, mode
            assert report["comm/intra_node_bytes"] + report["comm/inter_node_bytes"] == report["comm/total/bytes"]


# ---------------------------------------------------------------- off 2 × 2: 6 ranks as 2 nodes × 3 and 3 × 2

WORLD6 = 6


def _asymmetric_ranks(rank, world):
    """qgZ at 2 nodes × 3 and 3 nodes × 2 (where a chunk index transposed between node and local rank, or a node
    count taken for the ranks per node, is no longer the same by symmetry), and qwZ at 6 ranks."""
    import torch.distributed as dist

    from zero3d.comm.core import Comm, CommStats
    from zero3d.comm.hierarchical import quantized_reduce_scatter
    from zero3d.comm.quantize import QuantSpec
    from zero3d.comm.topology import build_node_topology
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    out = {}
    for gpn in (3, 2):
        topo = build_node_topology(dist.group.WORLD, gpus_per_node=gpn, timeout=timedelta(seconds=60))
        out[gpn, "topo"] = (topo.nodes, topo.per_node, topo.node, topo.local)
        intra, inter = (Comm(g, CommStats(), gpus_per_node=gpn) if g is not None else None
                        for g in (topo.intra_group, topo.inter_group))
        for bits in (8, 4):
            piece = torch.empty(C)
            quantized_reduce_scatter(piece, randn(200 + rank, WORLD6 * C), intra, inter, QuantSpec(bits, BLOCK))
            out[gpn, bits] = piece
    full = torch.empty(WORLD6 * C)
    Comm(None, CommStats()).all_gather_quantized(full, randn(300 + rank, C), QuantSpec(8, BLOCK), "params")
    out["qwz8"] = full
    dist.destroy_process_group()
    return out


@pytest.fixture(scope="module")
def results6():
    return run_ranks(_asymmetric_ranks, WORLD6, timeout=120)


@pytest.mark.parametrize("gpn", [3, 2], ids=["2x3", "3x2"])
@pytest.mark.parametrize("bits,levels", [(8, 127), (4, 7)])
def test_quantized_reduce_scatter_off_2x2_within_bound(results6, gpn, bits, levels):
    """Each DP rank d (node d // m, local d % m) gets the sum over the 6 ranks of chunk d, within the bound summed
    over the senders as at 2 × 2: step 1 every rank's block maxima, step 2 every node's partial sums."""
    nodes = WORLD6 // gpn
    fulls = [randn(200 + r, WORLD6 * C) for r in range(WORLD6)]
    exact = torch.stack(fulls).double().sum(0)
    step1 = sum(f.abs().max().item() for f in fulls) / levels / 2
    partial = [sum(fulls[i * gpn:(i + 1) * gpn]).abs().max().item() + step1 for i in range(nodes)]
    bound = (step1 + sum(partial) / levels / 2) * (1 + 1e-6)
    for d, r in enumerate(results6):
        assert r[gpn, "topo"] == (nodes, gpn, d // gpn, d % gpn)
        err = (r[gpn, bits].double() - exact[d * C:(d + 1) * C]).abs()
        assert 0 < err.max() <= bound, (d, err.max().item(), bound)


def test_quantized_all_gather_at_6_ranks_within_bound(results6):
    exact = torch.cat([randn(300 + r, C) for r in range(WORLD6)])
    for r in results6:
        assert ((r["qwz8"] - exact).abs() <= _block_max(exact) / 127 / 2 * (1 + 1e-6)).all()
        assert torch.equal(r["qwz8"], results6[0]["qwz8"])
