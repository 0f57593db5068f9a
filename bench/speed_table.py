"""The README's "Speed on one H200" table, rendered from a user-paths results file so the README cannot drift from
the measurement.

    python bench/speed_table.py            # print the table of the results file the README names
    python bench/speed_table.py --write    # rewrite the README's table (between its speed-table markers)

The README names its results file in the opening marker: `<!-- speed-table: bench/results/<file>.json -->`.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
MARKERS = re.compile(r"(<!-- speed-table: (?P<path>\S+) -->\n)(?P<table>.*?)(<!-- /speed-table -->)", re.S)

LENGTHS = [("512", "~512 tokens (450–600)", "≥ 3×, ≤ 50 ms"), ("1024", "~1k tokens (900–1,150)", "≥ 2.2×, ≤ 95 ms"),
           ("4096", "~4k tokens, cold", "≥ 1.6×"), ("16384", "~16k tokens, cold", "≥ 1.4×")]


def _ms(value: float) -> str:
    return f"{value:,.1f} ms"


def _count(value: float) -> str:
    return f"{value:,.0f}"


def render(results: dict) -> str:
    rows = ["| user path (issue 12) | release path | this engine | target |", "|---|---|---|---|"]
    for key, label, target in LENGTHS:
        entry = results["user_path"][key]
        ratio = entry["baseline_p50_ms"] / entry["ours_p50_ms"]
        rows.append(f"| `decide`, {label}, p50 / p95 | {_ms(entry['baseline_p50_ms'])} | "
                    f"{entry['ours_p50_ms']:,.1f} / {_ms(entry['ours_p95_ms'])} ({ratio:.2f}×) | "
                    f"{target}; p95 ≤ 1.2× p50 |")
    rows.append(f"| new schema on a cached 16k state | | {_ms(results['cached_16k_new_schema_ms'])} | ≤ 70 ms |")
    rows.append(f"| head alone, 64 questions × 10 options | | {_ms(results['head_64x10_ms'])} | ≤ 5 ms |")
    batch = results["batch_run"]
    rows.append(f"| 256 cases through the workbench's JobRunner + SQLite / `decide_many` | | "
                f"{_count(batch['workbench_tokens_per_s'])} / {_count(batch['engine_tokens_per_s'])} tokens/s | "
                "≥ 12k, within 5% |")
    loaded = results["interactive_during_batch"]
    rows.append(f"| interactive `decide` (~1k) during a batch run, p95 | | {_ms(loaded['loaded_p95_ms'])} "
                f"(idle {_ms(loaded['idle_p95_ms'])}: {loaded['loaded_p95_ms'] / loaded['idle_p95_ms']:.2f}×) | "
                "≤ 1.5× idle |")
    clients = results["concurrent_8"]
    rows.append(f"| 8 concurrent clients (~1k tokens) | | {_count(clients['tokens_per_s'])} tokens/s, p95 / p50 "
                f"{clients['p95_over_p50']:.2f} | ≥ 11k tokens/s |")
    fidelity = results.get("fidelity")
    if fidelity:
        rows.append("| distance from the float32 truth (Clef-Flash shape) | "
                    f"max \\|Δp\\| {fidelity['release_max_dp']:.4f}, "
                    f"{fidelity['release_flips']} flips | max \\|Δp\\| {fidelity['ours_max_dp']:.4f}, "
                    f"{fidelity['ours_flips']} flips | ours ≤ release |")
    return "\n".join(rows) + "\n"


def readme_table(readme: str) -> tuple[re.Match, str]:
    """The README's table block and the table its results file renders to."""
    match = MARKERS.search(readme)
    if match is None:
        raise SystemExit("README.md has no <!-- speed-table: FILE --> … <!-- /speed-table --> block")
    return match, render(json.loads((ROOT / match["path"]).read_text()))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--write", action="store_true", help="rewrite the README's table from its results file")
    args = parser.parse_args()
    readme = README.read_text()
    match, table = readme_table(readme)
    if args.write:
        README.write_text(readme[:match.start("table")] + table + readme[match.end("table"):])
    sys.stdout.write(table)


if __name__ == "__main__":
    main()
