"""The README's speed table is the one its results file renders to: editing the numbers by hand, or measuring again
without regenerating the table (`python bench/speed_table.py --write`), fails here."""

from pathlib import Path

from bench.speed_table import README, readme_table


def test_readme_speed_table_matches_its_results_file():
    match, table = readme_table(README.read_text())
    assert Path(match["path"]).suffix == ".json"
    assert match["table"] == table
