"""Figures the docs state in prose, held to what the commands and the tiny run produce."""
import json
import re

from doc_commands import REPO, documented_commands


def _output(results, text: str) -> str:
    (cmd,) = [c for c in documented_commands() if c.text == text]
    return results[cmd.id].stdout


def test_estimator_md_c2_gap_names_the_planners_figure(results):
    """docs/estimator.md's C2 heading and findings table carry the estimator's C2 maximum, as computed now."""
    c2 = re.search(r"C2 P_os \+ P_a\s+([\d.]+B) \((\d+) layers\)", _output(results, "python -m analysis --plan paper"))
    doc = (REPO / "docs/estimator.md").read_text()
    assert f"### The C2 gap (estimator {c2[1]}," in doc
    assert f"| C2 P_os + P_a | 60B | {c2[1]} ({c2[2]} layers)" in doc


def test_metrics_md_loss_scale_row_matches_an_fp32_run(tiny_run):
    """configs/tiny.toml trains in fp32 and still logs train/loss_scale (1): the key is not fp16-only."""
    records = [json.loads(line) for line in (tiny_run / "metrics.jsonl").read_text().splitlines()]
    assert [r["train/loss_scale"] for r in records if "train/loss_scale" in r] == [1.0, 1.0]
    row = next(ln for ln in (REPO / "docs/metrics.md").read_text().splitlines() if ln.startswith("| `train/loss_scale`"))
    assert "fp16 only" not in row and "1 under bf16 and fp32" in row
