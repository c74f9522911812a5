"""pipeline/readme_report.py: the README shows report.md as the pipeline wrote it, only re-levelled."""

import pytest

from pipeline.readme_report import END, START, paste
from utils.errors import TaskHetError

REPORT = "# Label-based vs embedding-based heterogeneity\n\nProduced by `x`.\n\n## Summary\n\n- a\n\n![loss vs alpha](loss_vs_alpha.png)\n"


def test_the_block_between_the_markers_is_replaced_and_nothing_else():
    readme = f"intro\n### What the demo found\n{START}\nold report\n{END}\nafter\n"
    pasted = paste(readme, REPORT, "results/demo")
    assert pasted == (f"intro\n### What the demo found\n{START}\n\nProduced by `x`.\n\n#### Summary\n\n- a\n\n"
                      f"![loss vs alpha](results/demo/loss_vs_alpha.png)\n\n{END}\nafter\n")
    assert paste(pasted, REPORT, "results/demo") == pasted  # pasting again changes nothing


def test_a_readme_without_both_markers_is_refused():
    with pytest.raises(TaskHetError, match="expected one"):
        paste(f"intro\n{START}\nno end\n", REPORT, "results/demo")
