"""The README's speed table is the one its results file renders to: editing the numbers by hand, or measuring again
without regenerating the table (`python bench/speed_table.py --write`), fails here."""

import json
from pathlib import Path

from bench.speed_table import README, ROOT, readme_table, render


def test_readme_speed_table_matches_its_results_file():
    match, table = readme_table(README.read_text())
    assert Path(match["path"]).suffix == ".json"
    assert match["table"] == table


def test_the_table_says_which_targets_a_run_misses():
    results = json.loads((ROOT / "bench/results/2026-12-01-h200-user-paths-run7.json").read_text())
    assert "**no**" not in render(results)  # run 7 met every target
    results["batch_run"]["workbench_tokens_per_s"] = 11_971
    results["user_path"]["512"]["ours_p50_ms"] = 50.1
    missed = [row.split(" | ")[0] for row in render(results).splitlines() if row.endswith("| **no** |")]
    assert missed == ["| `decide`, ~512 tokens (450–600), p50 / p95",
                      "| 256 cases through the workbench's JobRunner + SQLite / `decide_many`"]
