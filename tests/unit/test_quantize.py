"""Block-wise int8/int4 quantization (error bound, exact cases, refusals), the per-link ring model and the ZeRO++ byte formulas."""
from fractions import Fraction

import pytest
import torch

from analysis.comm_model import link_bytes, zeropp_collectives
from zero3d.comm.core import CommStats, ring_link_split
from zero3d.comm.quantize import QuantSpec, dequantize, quantize

SPECS = [QuantSpec(8, 64), QuantSpec(4, 64), QuantSpec(8, 100, torch.float16), QuantSpec(4, 6, torch.float16),
         QuantSpec(8, 1)]


def block_max(x: torch.Tensor, block: int) -> torch.Tensor:
    """Each element's block maximum |x|, computed with a loop (independently of quantize's reshape)."""
    out = torch.empty_like(x)
    for start in range(0, x.numel(), block):
        out[start:start + block] = x[start:start + block].abs().max()
    return out


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: f"int{s.bits}-b{s.block}-{str(s.scale_dtype)[6:]}")
@pytest.mark.parametrize("seed", range(4))
def test_error_within_half_a_scale(spec, seed):
    g = torch.Generator().manual_seed(seed)
    numel = 1 + int(torch.randint(1, 3000, (1,), generator=g))
    x = torch.randn(numel, generator=g) * 10 ** float(torch.empty(1).uniform_(-3, 3, generator=g))
    x[::7] = 0.0
    codes, scales = quantize(x, spec)
    y = dequantize(codes, scales, numel, spec)
    levels = 127 if spec.bits == 8 else 7
    # the documented bound with the documented scale; an fp16 scale rounds up by at most one fp16 step (2^-10)
    slack = 1 + (2**-10 if spec.scale_dtype == torch.float16 else 0) + 1e-6
    assert ((x - y).abs() <= block_max(x, spec.block) / levels / 2 * slack + 1e-30).all()
    assert y.dtype == torch.float32 and y.shape == x.shape
    assert codes.numel() == spec.code_bytes(numel)  # int4: two codes per byte
    assert spec.wire_bytes(numel) == -(-numel // spec.block) * (spec.block * spec.bits // 8 +
                                                                (4 if spec.scale_dtype == torch.float32 else 2))


@pytest.mark.parametrize("bits,levels", [(8, 127), (4, 7)])
def test_representable_values_round_trip_exactly(bits, levels):
    g = torch.Generator().manual_seed(0)
    spec = QuantSpec(bits, 16)
    codes = torch.randint(-levels, levels + 1, (160,), generator=g)
    codes[::16] = levels  # each block's maximum sets scale = 2^-3 exactly
    x = codes.float() * 0.125
    assert torch.equal(dequantize(*quantize(x, spec), 160, spec), x)


def test_int4_packing_by_hand():
    spec = QuantSpec(4, 4)
    codes, scales = quantize(torch.tensor([7.0, -7.0, 1.0, 0.0]), spec)
    # scale 1; codes + 8 = 15, 1, 9, 8; low nibble first: 0x1F, 0x89
    assert codes.tolist() == [0x1F, 0x89] and scales.tolist() == [1.0]


def test_zeros_and_refusals():
    codes, scales = quantize(torch.zeros(10), QuantSpec(8, 4))
    assert scales.tolist() == [0.0, 0.0, 0.0] and not codes.any()
    assert not dequantize(codes, scales, 10, QuantSpec(8, 4)).any()
    for bad in (float("inf"), float("-inf"), float("nan")):
        with pytest.raises(ValueError, match="cannot quantize a tensor holding"):
            quantize(torch.tensor([1.0, bad]))
    with pytest.raises(ValueError, match="overflows an fp16 scale"):
        quantize(torch.tensor([1e9]), QuantSpec(8, 4, torch.float16))
    for kwargs, message in (({"bits": 2}, "bits = 2 is invalid"), ({"bits": 4, "block": 5}, "block = 5 is invalid"),
                            ({"scale_dtype": torch.bfloat16}, "scale_dtype")):
        with pytest.raises(ValueError, match=message):
            QuantSpec(**kwargs)


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("bad", [float("inf"), float("-inf"), float("nan")])
def test_unchecked_quantize_reads_no_host_value_and_never_hides_a_non_finite_block(monkeypatch, bits, bad):
    """check_finite=False (the engine's hot path): no Tensor.item / bool / tolist; the finite blocks come out
    as the checked call gives them, and the block holding the non-finite value is non-finite in every element
    (its scale is inf or nan), never finite garbage."""
    spec = QuantSpec(bits, 4)
    x = torch.tensor([1.0, -2.0, 0.5, 3.0, 4.0, bad, 0.25, -1.0, 0.0, 7.0])
    clean = x.clone()
    clean[5] = 0.0
    expected = dequantize(*quantize(clean, spec), 10, spec)
    reads = []

    def counted(name, original):
        def read(self, *args, **kwargs):
            reads.append(name)
            return original(self, *args, **kwargs)
        return read
    for name in ("item", "tolist", "__bool__", "__float__", "__int__"):
        monkeypatch.setattr(torch.Tensor, name, counted(name, getattr(torch.Tensor, name)))
    codes, scales = quantize(x, spec, check_finite=False)
    monkeypatch.undo()
    assert reads == []
    y = dequantize(codes, scales, 10, spec)
    assert torch.equal(y[:4], expected[:4]) and torch.equal(y[8:], expected[8:])
    assert not torch.isfinite(y[4:8]).any()


def test_ring_link_split_by_hand():
    # 4 ranks on 2 nodes in blocks: 2 of the 4 ring edges cross → half of what a rank sends
    assert ring_link_split(Fraction(120), [0, 0, 1, 1]) == (60, 60)
    # 6 ranks, 3 nodes of 2: 3 of 6 edges cross
    assert ring_link_split(Fraction(90), [5, 5, 6, 6, 7, 7]) == (45, 45)
    # every rank on its own node: all inter; one node: all intra
    assert ring_link_split(Fraction(7), [0, 1, 2]) == (0, 7)
    assert ring_link_split(Fraction(7), [3, 3, 3]) == (7, 0)
    # interleaved placement 0,1,0,1: all 4 edges cross
    assert ring_link_split(Fraction(8), [0, 1, 0, 1]) == (0, 8)


def test_comm_stats_reports_links_only_with_a_topology():
    stats = CommStats()
    stats.add("all_gather", "params", Fraction(30), 2)
    assert not any("node_bytes" in k for k in stats.report())  # default: as before
    stats.add("all_gather", "params", Fraction(30), 2, nodes=[0, 0, 1, 1])  # 60 bytes: 30 + 30
    stats.record("quantized_all_to_all", "grads", Fraction(10), Fraction(12), (Fraction(4), Fraction(8)))
    r = stats.report()
    assert r["comm/all_gather/params/intra_node_bytes"] == 30 and r["comm/all_gather/params/inter_node_bytes"] == 30
    assert r["comm/intra_node_bytes"] == 34 and r["comm/inter_node_bytes"] == 38
    assert r["comm/total/bytes"] == 60 + 60 + 12
    with pytest.raises(ValueError, match="do not add up"):
        stats.record("x", "y", Fraction(1), Fraction(5), (Fraction(1), Fraction(1)))
    stats.reset()
    assert "comm/inter_node_bytes" not in stats.report()


def test_zeropp_formulas_by_hand():
    # Ψ = 1024, N = 4 on 2 nodes of 2, fp16, block 256, fp32 scales: q_w = 1 + 4/256, q_g (int4) = 1/2 + 4/256
    inter = {mode: link_bytes(zeropp_collectives(mode, 1024, 4, 2))[1] for mode in
             ("stage 3", "+hpZ", "+hybrid", "+qwZ", "+qgZ", "qwZ+hpZ+qgZ")}
    # per rank: a ring pass sends 2048·3/4 = 1536 bytes, half of it across (2 crossings of 4 edges)
    assert inter["stage 3"] == 3 * 768
    assert inter["+hpZ"] == 2 * 768
    assert inter["+hybrid"] == 2 * 1024 * 1 / 2  # all-reduce of the 1024-byte shard over 2 nodes: 2·1024·1/2
    assert inter["+qwZ"] == 2 * 1040 * Fraction(3, 4) / 2 + 768  # 1040 = 1024·(1 + 4/256)
    # qgZ: one chunk of Ψ/N = 256 at 528/1024 bytes; its overflow flag, one fp32 all-reduced over 4 ranks a bucket:
    # 2·4·3/4 = 6 bytes, half of them across the nodes
    assert inter["+qgZ"] == 2 * 768 + 256 * Fraction(528, 1024) + 3
    assert inter["qwZ+hpZ+qgZ"] == 390 + 132 + 3
    assert inter["qwZ+hpZ+qgZ"] <= inter["stage 3"] / 4
    intra = link_bytes(zeropp_collectives("+qgZ", 1024, 4, 2))[0]
    assert intra == 2 * 768 + 512 * Fraction(528, 1024) + 3  # the intra-node all-to-all: one chunk of Ψ/m = 512
    with pytest.raises(ValueError, match="mode 'zero4' is invalid"):
        zeropp_collectives("zero4", 1024, 4, 2)
    with pytest.raises(ValueError, match="dp = 6 with 4 per node is invalid"):
        zeropp_collectives("stage 3", 1024, 6, 4)
