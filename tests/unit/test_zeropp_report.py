"""`python -m analysis --zeropp`: the α-β time per link by hand, the paper rows' bytes by formula, refusals."""
import pytest

from analysis.__main__ import main
from analysis.comm_model import PAPER_LINKS, LinkCollective, link_seconds
from analysis.estimate import gpt_param_count
from analysis.zeropp_report import DGX2, H100, predict


def test_link_seconds_by_hand():
    # 300 GB over NVSwitch at 300 GB/s: 1 s; 6.25 GB across nodes at 100 GB/s per node shared by 16 GPUs: 1 s
    both = LinkCollective("x", 300e9, 6.25e9, steps=10)
    assert link_seconds(both, PAPER_LINKS) == pytest.approx(1.0 + 10 * 10e-6)
    intra_only = LinkCollective("y", 150e9, 0, steps=3)
    assert link_seconds(intra_only, PAPER_LINKS) == pytest.approx(0.5 + 3 * 5e-6)
    # H100: 8 × 400 Gb/s = 400 GB/s per node, 8 GPUs → 50 GB/s each
    assert link_seconds(LinkCollective("z", 0, 50e9, steps=0), H100.links) == pytest.approx(1.0)


def test_paper_100b_row_bytes_by_formula():
    # Figure 2's 100B: 125 layers × 8192, 400 GPUs, TP 16 → N = 25 DP ranks, one per DGX-2 node, batch 32 × 25
    p = predict(DGX2, layers=125, hidden=8192, heads=64, gpus=400, tp=16, micro_batch=32, global_batch=800)
    psi = gpt_param_count(125, 8192, 50257, 1024, 16)
    rows = {r["mode"]: r for r in p["rows"]}
    assert (p["dp"], p["per_node"], p["accumulation"]) == (25, 1, 1)
    # one DP rank per node: everything it sends crosses nodes; 3 fp16 passes of Ψ·24/25
    assert rows["stage 3"]["inter_bytes"] == pytest.approx(3 * 2 * psi * 24 / 25)
    assert rows["stage 3"]["intra_bytes"] == 0
    # hpZ's node has one rank: its backward gather is free, and the secondary copy is the whole slice
    assert rows["+hpZ"]["inter_bytes"] == pytest.approx(2 * 2 * psi * 24 / 25)
    assert rows["+hpZ"]["extra_bytes"] == pytest.approx(2 * psi)
    # int8 weights (1 + 4/256 bytes) twice, int4 gradients (1/2 + 4/256) once over 25 nodes
    assert rows["qwZ+hpZ+qgZ"]["inter_bytes"] == pytest.approx(psi * (1 + 4 / 256) * 24 / 25
                                                                + psi * (0.5 + 4 / 256) * 24 / 25)
    base = rows["stage 3"]
    assert base["gain_serial"] == 1 and rows["qwZ+hpZ+qgZ"]["gain_serial"] > 1
    assert base["serial_s"] == pytest.approx(p["compute_s"] + base["comm_s"])


def test_cli_prints_both_machines_for_each_row(capsys):
    assert main(["--zeropp", "100B", "170B"]) == 0
    out = capsys.readouterr().out
    for model in ("100B (125 layers × 8192)", "170B (212 layers × 8192)"):
        assert out.count(model) == 4  # DGX-2 and H100, each the paper's layout and TP 1
    assert out.count("qwZ+hpZ+qgZ") == 8


@pytest.mark.parametrize("argv,message", [
    (["--zeropp", "7B"], "model '7B' has no Figure 2 ZeRO row"),
    (["--zeropp", "--quant-block", "3"], "--quant-block 3 is invalid"),
])
def test_cli_refusals(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    assert exit_.value.code == 2 and message in capsys.readouterr().err


def test_tp_beyond_a_node_is_refused():
    with pytest.raises(ValueError, match="tp = 16 does not fit a node of 8 GPUs"):
        predict(H100, layers=2, hidden=64, heads=4, gpus=32, tp=16, micro_batch=1, global_batch=2)
