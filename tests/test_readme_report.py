"""pipeline/readme_report.py: the README shows report.md as the pipeline wrote it, only re-levelled."""

from pathlib import Path

import pytest

from pipeline.readme_report import END, START, main, markers, paste, pasted_block
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


def write_demo(tmp_path):
    """A README with the markers and a report folder with its plot, as the pipeline leaves them."""
    (tmp_path / "results" / "demo").mkdir(parents=True)
    (tmp_path / "results" / "demo" / "report.md").write_text(REPORT)
    (tmp_path / "results" / "demo" / "loss_vs_alpha.png").write_bytes(b"\x89PNG plot")
    (tmp_path / "README.md").write_text(f"intro\n{START}\n{END}\n")
    return tmp_path / "results" / "demo" / "report.md", tmp_path / "README.md"


def test_plot_links_are_relative_to_the_readme_even_for_an_absolute_report_path(tmp_path):
    report, readme = write_demo(tmp_path)
    main([str(report.resolve()), str(readme)])
    assert "![loss vs alpha](results/demo/loss_vs_alpha.png)" in readme.read_text()


def test_images_copies_the_plots_and_links_the_copies(tmp_path):
    report, readme = write_demo(tmp_path)
    main([str(report), str(readme), "--images", str(tmp_path / "docs" / "demo")])
    assert "![loss vs alpha](docs/demo/loss_vs_alpha.png)" in readme.read_text()
    assert (tmp_path / "docs" / "demo" / "loss_vs_alpha.png").read_bytes() == b"\x89PNG plot"
    main([str(report), str(readme), "--images", str(report.parent)])  # the report's own folder: nothing to copy
    assert "![loss vs alpha](results/demo/loss_vs_alpha.png)" in readme.read_text()


def test_a_missing_plot_is_named_and_nothing_is_written(tmp_path):
    report, readme = write_demo(tmp_path)
    (report.parent / "loss_vs_alpha.png").unlink()
    with pytest.raises(TaskHetError, match="links loss_vs_alpha.png, but .*loss_vs_alpha.png does not exist"):
        main([str(report), str(readme), "--images", str(tmp_path / "docs" / "demo")])
    assert readme.read_text() == f"intro\n{START}\n{END}\n" and not (tmp_path / "docs").exists()


def test_a_full_disk_while_copying_a_plot_names_it_and_leaves_no_part(tmp_path, monkeypatch):
    import errno

    from utils import run_dir

    report, readme = write_demo(tmp_path)

    def full_disk(source, target):
        Path(target).write_bytes(b"\x89PN")  # half a file, then the disk is full
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(run_dir.shutil, "copyfile", full_disk)
    with pytest.raises(TaskHetError, match=r"loss_vs_alpha.png: no space left on device"):
        main([str(report), str(readme), "--images", str(tmp_path / "docs" / "demo")])
    assert list((tmp_path / "docs" / "demo").iterdir()) == [] and readme.read_text() == f"intro\n{START}\n{END}\n"


SECTIONED = ("# Title\n\nProduced by `x`.\n\n## Summary\n\n- a\n\n## Results\n\n| t |\n\n## Plots\n\n"
             "![loss vs alpha](loss_vs_alpha.png)\n")


def test_sections_keep_the_opening_text_and_the_named_sections_in_report_order(tmp_path):
    report, readme = write_demo(tmp_path)
    report.write_text(SECTIONED)
    main([str(report), str(readme), "--sections", "Results, Summary", "--images", str(tmp_path / "docs" / "demo")])
    assert readme.read_text() == (f"intro\n{START}\n\nProduced by `x`.\n\n#### Summary\n\n- a\n\n#### Results\n\n| t |"
                                  f"\n\n{END}\n")
    assert not (tmp_path / "docs" / "demo" / "loss_vs_alpha.png").exists()  # only the kept sections' plots are copied


def test_a_section_the_report_lacks_is_named_and_nothing_is_written(tmp_path):
    report, readme = write_demo(tmp_path)
    report.write_text(SECTIONED)
    with pytest.raises(TaskHetError, match=r"--sections: the report has no section 'Verdicts'; its sections: Summary, "
                                           r"Results, Plots"):
        main([str(report), str(readme), "--sections", "Summary,Verdicts"])
    assert readme.read_text() == f"intro\n{START}\n{END}\n"


def test_a_second_block_is_pasted_between_its_own_markers_and_leaves_the_first(tmp_path):
    report, readme = write_demo(tmp_path)
    start, end = markers("mechanism")
    assert (start, end) == ("<!-- mechanism report: start -->", "<!-- mechanism report: end -->")
    readme.write_text(f"intro\n{start}\n{end}\nmiddle\n{START}\nthe demo's\n{END}\n")
    main([str(report), str(readme), "--block", "mechanism", "--sections", "Summary"])
    text = readme.read_text()
    assert pasted_block(text, "demo") == "\nthe demo's\n"  # untouched
    assert pasted_block(text, "mechanism") == ("\n\nProduced by `x`.\n\n#### Summary\n\n- a\n\n"
                                               "![loss vs alpha](results/demo/loss_vs_alpha.png)\n\n")
    with pytest.raises(TaskHetError, match="expected one '<!-- other report: start -->'"):
        main([str(report), str(readme), "--block", "other"])
    with pytest.raises(SystemExit):  # a block name becomes part of an HTML comment: plain names only
        main([str(report), str(readme), "--block", "x -->"])
    assert pasted_block("no markers", "demo") is None
