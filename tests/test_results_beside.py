"""raysim's cells beside published numbers (issue 83, raysim/results/beside.py): Welch's test
on numbers worked by hand, the file's bad input as one line naming it, and the document's
opening section made from runs.csv alone."""
import csv

import pytest

from raysim.errors import ConfigError
from raysim.results.beside import judge, read_published
from raysim.results.stats import paired_p, welch_p

SWEEP = """name: t
fixed: {rounds: 2, num_clients: 6}
grid:
  seed: [0, 1, 2]
  setting:
    - {label: digits, dataset: digits, model: mlp}
  algorithm: [fedavg, fedprox]
"""


def test_welchs_test_on_numbers_worked_by_hand():
    # means 10 and 12, std 1 each, 3 runs a side: t = -2 / sqrt(1/3 + 1/3) = -2.449, df = 4,
    # two-sided p = 0.0705 (t table: 2.776 at 0.05 for 4 df), so equal means are not rejected
    assert welch_p(10, 1, 3, 12, 1, 3) == pytest.approx(0.0705, abs=5e-4)
    # 5 runs a side: t = -2 / sqrt(0.4) = -3.162, df = 8, p = 0.0134: rejected
    assert welch_p(10, 1, 5, 12, 1, 5) == pytest.approx(0.0134, abs=5e-4)
    # unequal spreads (Welch-Satterthwaite df): 80 +- 1 (3) against 78.10 +- 2.51 (3):
    # v = 1/3 and 2.51^2/3 = 2.100, t = 1.9 / sqrt(2.4334) = 1.218, df = 2.4334^2 / (v1^2/2 + v2^2/2)
    # = 2.62 (not the pooled 4), p = 0.321
    assert welch_p(80, 1, 3, 78.10, 2.51, 3) == pytest.approx(0.3215, abs=5e-4)
    assert welch_p(5, 0, 3, 5, 0, 3) == 1.0 and welch_p(5, 0, 3, 6, 0, 3) == 0.0  # no spread either side
    assert judge([10.0, 11.0, 9.0], (12.0, 1.0), 3)["within"] is True
    assert judge([10.0, 11.0, 9.0, 10.0, 10.0], (14.0, 0.5), 3)["within"] is False
    assert judge([10.0], (12.0, 1.0), 3) == {"mean": 10.0, "std": 0.0, "n": 1, "p": None, "within": None}


@pytest.mark.parametrize("text, says", [
    ("cifar: {source: x, reading: best, seeds: 3, numbers: {}}", "cifar: not a setting of the sweep (digits)"),
    ("digits: {source: x, reading: last, seeds: 3, numbers: {}}", "digits: reading must be best or final, not 'last'"),
    ("digits: {source: x, reading: best, seeds: 1, numbers: {}}", "digits: seeds must be a whole number >= 2"),
    ("digits: {source: x, reading: best, seeds: 3, numbers: {fedrs: [1, 2]}}",
     "digits: numbers names 'fedrs', not an algorithm of the sweep (fedavg, fedprox)"),
    ("digits: {source: x, reading: best, seeds: 3, numbers: {fedavg: [0.78, 2.5, 3]}}",
     "digits: fedavg must be [mean, std], an accuracy in % (0-100) and a std >= 0"),
    ("digits: {source: x, reading: best, numbers: {}}", "digits: needs source, reading, seeds and numbers (and may have diverged_at)"),
])
def test_a_wrong_published_file_is_one_line_naming_it_and_the_key(tmp_path, text, says):
    f = tmp_path / "published.yaml"
    f.write_text(text)
    with pytest.raises(ConfigError) as e:
        read_published(f, ["digits"], ["fedavg", "fedprox"])
    assert str(e.value).startswith(f"{f}: {says}") and "\n" not in str(e.value)


def test_the_document_opens_with_its_cells_beside_the_published_numbers(tmp_path):
    """From runs.csv alone: the final and best readings, Welch's verdict by the source's
    reading, a cell short of seeds, and a "no" without a note flagged until it has one."""
    from raysim.results.published import RECORD, write_doc

    f = tmp_path / "table.yaml"
    f.write_text(SWEEP)
    side = tmp_path / "paper"  # the folder beside paper.md
    side.mkdir()
    (side / "published.yaml").write_text(
        "digits: {source: A table, reading: final, seeds: 3, numbers: {fedavg: [80.0, 1.0], fedprox: [50.0, 0.5]}}\n")
    curves = {"fedavg": ["1:0.9000 2:0.7900", "1:0.7000 2:0.8000", "1:0.8200 2:0.8100"],
              "fedprox": ["1:0.6000 2:0.6100", "1:0.6200 2:0.6000"]}
    rows = [{"setting": "digits", "algorithm": a, "seed": str(i), "final_accuracy": c.split(":")[-1],
             "status": "finished", "model_sha256": "ab" * 32, "accuracy_curve": c}
            for a, cs in curves.items() for i, c in enumerate(cs)]
    with (side / "runs.csv").open("w", newline="") as out:
        w = csv.DictWriter(out, RECORD)
        w.writeheader()
        w.writerows(rows)
    write_doc(f, tmp_path / "paper.md", tmp_path / "runs")
    text = (tmp_path / "paper.md").read_text()
    assert text.startswith("# Results: the papers' set-ups beside their published numbers")
    assert "**1 of 2 cells** with 2 or more runs lie within the published spread" in text
    # fedavg: final 79, 80, 81 -> 80.0 +- 1.0, against 80 +- 1: p = 1; best 90, 80, 82
    assert "| fedavg | 80.0 ± 1.0 | 84.0 ± 5.3 | 80.00 ± 1.00 | 1.000 | yes |  |" in text
    assert "| fedprox | 60.5 ± 0.7 (2/3) | 61.5 ± 0.7 (2/3) | 50.00 ± 0.50 |" in text
    assert '**1 "no" cell(s) without a note yet**: digits/fedprox.' in text
    assert (side / "runs.csv").is_file() and not (tmp_path / "results").exists()  # beside paper.md, not results/
    (side / "notes.yaml").write_text('"digits/fedprox": "Measured: the reason."\n')
    write_doc(f, tmp_path / "paper.md", tmp_path / "runs")
    text = (tmp_path / "paper.md").read_text()
    assert "without a note yet" not in text and "| **no** | [note 1](#note-1) |" in text
    # a run that diverged: in no mean, or, with diverged_at, as the source's code records one
    rows.append({"setting": "digits", "algorithm": "fedprox", "seed": "2", "status": "diverged",
                 "model_sha256": "cd" * 32, "accuracy_curve": "1:0.7000"})
    with (side / "runs.csv").open("w", newline="") as out:
        w = csv.DictWriter(out, RECORD)
        w.writeheader()
        w.writerows(rows)
    write_doc(f, tmp_path / "paper.md", tmp_path / "runs")
    assert "| fedprox | 60.5 ± 0.7; 1 diverged | 61.5 ± 0.7; 1 diverged |" in (tmp_path / "paper.md").read_text()
    (side / "published.yaml").write_text((side / "published.yaml").read_text().replace("seeds: 3,", "seeds: 3, "
                                                                                       "diverged_at: 10,"))
    write_doc(f, tmp_path / "paper.md", tmp_path / "runs")
    # final: 61, 60 and the diverged run at 10; best: 62, 61 and max(70 before it diverged, 10)
    assert ("| fedprox | 43.7 ± 29.2; 1 diverged, counted at 10 | 64.3 ± 4.9; 1 diverged, counted at its best before, at least 10 |"
            in (tmp_path / "paper.md").read_text())


def test_a_cell_whose_setting_runs_fewer_seeds_is_whole_at_its_own_count(tmp_path):
    """The sweep file's `only` gives fedprox seeds 0-1 of the grid's 0-2: its two runs are the
    whole cell (no "(2/3)"), while fedavg with two of its three says so."""
    from raysim.results.published import RECORD, write_doc

    f = tmp_path / "table.yaml"
    f.write_text(SWEEP + "only:\n  - {seed: 2, algorithm: [fedavg]}\n")
    side = tmp_path / "paper"
    side.mkdir()
    (side / "published.yaml").write_text(
        "digits: {source: A table, reading: final, seeds: 3, numbers: {fedavg: [80.0, 1.0], fedprox: [60.0, 1.0]}}\n")
    rows = [{"setting": "digits", "algorithm": a, "seed": str(i), "final_accuracy": acc, "status": "finished",
             "model_sha256": "ab" * 32, "accuracy_curve": f"1:{acc}"}
            for a, accs in (("fedavg", ["0.7900", "0.8100"]), ("fedprox", ["0.6000", "0.6200"]))
            for i, acc in enumerate(accs)]
    with (side / "runs.csv").open("w", newline="") as out:
        w = csv.DictWriter(out, RECORD)
        w.writeheader()
        w.writerows(rows)
    write_doc(f, tmp_path / "paper.md", tmp_path / "runs")
    text = (tmp_path / "paper.md").read_text()
    assert "| fedavg | 80.0 ± 1.4 (2/3) | 80.0 ± 1.4 (2/3) |" in text
    assert "| fedprox | 61.0 ± 1.4 | 61.0 ± 1.4 |" in text
