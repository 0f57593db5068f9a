"""docs/performance.md's speed tables, rendered from their results files so the page cannot drift from the
measurement.

    python bench/speed_table.py            # print the table of the results file the page names
    python bench/speed_table.py --write    # rewrite the page's tables (speed-table and long-table markers)

The page names its results files in the opening marker:
`<!-- speed-table: bench/results/<user-paths>.json release=bench/results/<release-code>.json -->`. The ratios divide
the release's own code's timings (the second file: its `joint_schema_model.py` on the same H200) by ours, never our
re-implementation of the release path (`reference.py`, shown beside them for what it measured in our run).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "performance.md"
LONG_MARKERS = re.compile(r"(<!-- long-table: (?P<path>\S+) -->\n)(?P<table>.*?)(<!-- /long-table -->)", re.S)
MARKERS = re.compile(r"(<!-- speed-table: (?P<path>\S+) release=(?P<release>\S+) -->\n)(?P<table>.*?)"
                     r"(<!-- /speed-table -->)", re.S)

# (results key, label, our records' token range, ratio at least, p50 at most in ms or None)
LENGTHS = [("512", "~512 tokens", (450, 600), 3.0, 50.0), ("1024", "~1k tokens", (900, 1150), 2.2, 95.0),
           ("4096", "~4k tokens, cold", (3500, 4500), 1.6, None),
           ("16384", "~16k tokens, cold", (15000, 17000), 1.4, None)]

# Clef-27B's compute floor: ~50 GFLOP per token at the ~790 TFLOP/s this H200 reaches in bf16 (shared/measurements).
FLOOR_MS_PER_TOKEN = 50e9 / 790e12 * 1e3
FLOOR_TOKENS_PER_S = 1e3 / FLOOR_MS_PER_TOKEN


def _ms(value: float) -> str:
    return f"{value:,.1f} ms"


def _count(value: float) -> str:
    return f"{value:,.0f}"


def _met(ok: bool) -> str:
    return "yes" if ok else "**no**"


def release_ratio(release: dict, ours_ms: float, ours_tokens: float) -> float:
    """How many times faster than the release code: the smaller of the time ratio and the per-token ratio, since the
    release code's records (e.g. 16,922 tokens) and ours (a range around the bucket) are not the same length."""
    time_ratio = release["release_p50_ms"] / ours_ms
    return min(time_ratio, time_ratio * ours_tokens / release["tokens"])


def _floor(ours_ms: float, tokens: float) -> str:
    return f"{tokens * FLOOR_MS_PER_TOKEN / ours_ms:.0%}"


def render(results: dict, release: dict) -> str:
    """The table, with a last column saying whether this run meets each of issue 12's targets (computed here from
    the numbers, so a run that misses one says so). `release` is the release code's own timings."""
    rows = ["| user path (issue 12) | release code | our reference path | this engine, p50 / p95 | × release code "
            "| of compute floor | target | met |", "|---|---|---|---|---|---|---|---|"]
    for key, label, (low, high), min_ratio, max_ms in LENGTHS:
        entry, theirs = results["user_path"][key], release["single"][key]
        tokens = (low + high) / 2
        ratio = release_ratio(theirs, entry["ours_p50_ms"], tokens)
        # The independent side-by-side timed our engine too, in the release code's own run: a target is met only
        # if both runs support it.
        side_by_side = theirs["release_p50_ms"] / theirs["ours_p50_ms"]
        ok = (min(ratio, side_by_side) >= min_ratio and entry["ours_p95_ms"] <= 1.2 * entry["ours_p50_ms"]
              and (max_ms is None or max(entry["ours_p50_ms"], theirs["ours_p50_ms"]) <= max_ms))
        target = f"≥ {min_ratio:g}×" + (f", ≤ {max_ms:g} ms" if max_ms else "")
        rows.append(f"| `decide`, {label} ({low:,}–{high:,}) | {_ms(theirs['release_p50_ms'])} "
                    f"({theirs['tokens']:,} tokens) | {_ms(entry['baseline_p50_ms'])} | "
                    f"{entry['ours_p50_ms']:,.1f} / {_ms(entry['ours_p95_ms'])} | {ratio:.2f}× "
                    f"({side_by_side:.2f}× side by side: {_ms(theirs['ours_p50_ms'])}) | "
                    f"{_floor(entry['ours_p50_ms'], tokens)} | {target}; p95 ≤ 1.2× p50 | {_met(ok)} |")
    cached = results["cached_16k_new_schema_ms"]
    rows.append(f"| new schema on a cached 16k state | | | {_ms(cached)} | | | ≤ 70 ms | {_met(cached <= 70)} |")
    head = results["head_64x10_ms"]
    rows.append(f"| head alone, 64 questions × 10 options | | | {_ms(head)} | | | ≤ 5 ms | {_met(head <= 5)} |")
    batch, theirs = results["batch_run"], release["batch64_1k_tokens"]
    workbench, engine = batch["workbench_tokens_per_s"], batch["engine_tokens_per_s"]
    rows.append(f"| 256 cases through the workbench's JobRunner + SQLite / `decide_many` | "
                f"{_count(theirs['ref_tok_s'])} tokens/s (64 records, padded batches) | | "
                f"{_count(workbench)} / {_count(engine)} tokens/s | {workbench / theirs['ref_tok_s']:.2f}× | "
                f"{workbench / FLOOR_TOKENS_PER_S:.0%} | ≥ 12k, within 5% | "
                f"{_met(workbench >= 12_000 and workbench >= 0.95 * engine)} |")
    loaded = results["interactive_during_batch"]
    if loaded:
        slowdown = loaded["loaded_p95_ms"] / loaded["idle_p95_ms"]
        rows.append(f"| interactive `decide` (~1k) during a batch run, p95 | | | {_ms(loaded['loaded_p95_ms'])} "
                    f"(idle {_ms(loaded['idle_p95_ms'])}: {slowdown:.2f}×) | | | ≤ 1.5× idle | "
                    f"{_met(slowdown <= 1.5)} |")
    else:  # the benchmark ran out of its time before this section: said, not filled in from another run
        rows.append("| interactive `decide` (~1k) during a batch run, p95 | | | not measured in this run | | | "
                    "≤ 1.5× idle | **not measured** |")
    clients = results["concurrent_8"]
    rows.append(f"| 8 concurrent clients (~1k tokens) | | | {_count(clients['tokens_per_s'])} tokens/s, p95 / p50 "
                f"{clients['p95_over_p50']:.2f} | | {clients['tokens_per_s'] / FLOOR_TOKENS_PER_S:.0%} | "
                f"≥ 11k tokens/s | {_met(clients['tokens_per_s'] >= 11_000)} |")
    fidelity = results.get("fidelity")
    if fidelity:
        closer = (fidelity["ours_max_dp"] <= fidelity["release_max_dp"]
                  and fidelity["ours_flips"] <= fidelity["release_flips"])
        where = f" ({fidelity['measured_in']})" if fidelity.get("measured_in") else ""
        rows.append(f"| distance from the float32 truth (Clef-Flash shape){where} | "
                    f"max \\|Δp\\| {fidelity['release_max_dp']:.4f}, "
                    f"{fidelity['release_flips']} flips | | max \\|Δp\\| {fidelity['ours_max_dp']:.4f}, "
                    f"{fidelity['ours_flips']} flips | | | ours ≤ release | {_met(closer)} |")
    return "\n".join(rows) + "\n"


def render_long(results: dict) -> str:
    """The long-records table (issue 25's targets: ≥ 1.3× the release code's second call, wall ≤ 1.1× the GPU kernel
    time, peak ≤ weights + the record's K/V + 8 GiB; 16k p95 ≤ 1.2× p50)."""
    rows = ["| record | release code (2nd call) | this engine | GPU kernels | wall / GPU | × release code "
            "| of compute floor | peak / allowed | target ≥ 1.3×, wall ≤ 1.1× GPU, peak | met |",
            "|---|---|---|---|---|---|---|---|---|---|"]
    for key, entry in results["long"].items():
        if "release_ms" not in entry:
            continue
        ratio, wall = entry["release_ms"] / entry["ours_ms"], entry["ours_ms"] / entry["ours_gpu_ms"]
        peak_ok = entry["peak_gib"] <= entry["allowed_gib"]
        rows.append(f"| ~{int(key) // 1024}k ({entry['tokens']:,} tokens) | {_ms(entry['release_ms'])} | "
                    f"{_ms(entry['ours_ms'])} | {_ms(entry['ours_gpu_ms'])} | {wall:.2f} | {ratio:.2f}× | "
                    f"{_floor(entry['ours_ms'], entry['tokens'])} | {entry['peak_gib']:.1f} / "
                    f"{entry['allowed_gib']:.1f} GiB | | {_met(ratio >= 1.3 and wall <= 1.1 and peak_ok)} |")
    longest = results["long"].get("262144")
    if longest:
        rows.append(f"| ~256k ({longest['tokens']:,} tokens) | | {_ms(longest['ours_ms'])} | | | | "
                    f"{_floor(longest['ours_ms'], longest['tokens'])} | {longest['peak_gib']:.1f} / "
                    f"{longest['allowed_gib']:.1f} GiB | answered with Clef-Flash resident | "
                    f"{_met(longest['flash_resident'] and longest['peak_gib'] <= longest['allowed_gib'])} |")
    spread = results.get("p95_over_p50_16k")
    if spread is not None:
        rows.append(f"| 16k–17k tokens, p95 / p50 | | {spread:.2f} | | | | | | ≤ 1.2 | {_met(spread <= 1.2)} |")
    return "\n".join(rows) + "\n"


def page_long_table(page: str) -> tuple[re.Match, str] | None:
    match = LONG_MARKERS.search(page)
    return None if match is None else (match, render_long(json.loads((ROOT / match["path"]).read_text())))


def page_table(page: str) -> tuple[re.Match, str]:
    """The page's table block and the table its results file renders to."""
    match = MARKERS.search(page)
    if match is None:
        raise SystemExit("docs/performance.md has no <!-- speed-table: FILE --> … <!-- /speed-table --> block")
    return match, render(json.loads((ROOT / match["path"]).read_text()),
                         json.loads((ROOT / match["release"]).read_text()))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--write", action="store_true", help="rewrite the page's tables from their results files")
    args = parser.parse_args()
    page = PAGE.read_text()
    match, table = page_table(page)
    if args.write:
        page = page[:match.start("table")] + table + page[match.end("table"):]
        long = page_long_table(page)
        if long is not None:
            page = page[:long[0].start("table")] + long[1] + page[long[0].end("table"):]
        PAGE.write_text(page)
    sys.stdout.write(table)


if __name__ == "__main__":
    main()
