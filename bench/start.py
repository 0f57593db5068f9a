"""Start-up (issue 38's "Done when" `start` fields): from a fresh process to its first answer, loading through
`clef_engine.load` a release written to disk, for a Clef-Flash-shaped and a Clef-27B-shaped release (random bf16
weights, bench/build.write_release).

    python bench/start.py OUT.json [--models flash,clef] [--directory /tmp/start] [--keep]   (CUDA; < 6 min per model)
    BENCH_CPU_SMOKE=1 python bench/start.py /tmp/smoke/start.json                     (scaled down, CPU: the script)

Per model, the release is written, its files are dropped from the page cache (posix_fadvise DONTNEED: the next
read comes from the disk, as on a fresh machine; `detail.<model>.disk_read_gb_s` is what the disk gives, one shard
read cold), then two fresh processes, one after the other, each `python bench/start.py --child RELEASE`:

- cold (`start.<model>_cold_s`): an empty cache folder (CLEF_CACHE_DIR, where the engine keeps Triton's and
  inductor's caches and the autotuner's choices): every kernel compiles and autotunes;
- warm (`start.<model>_warm_s`): the caches the cold process left, the release's pages as it left them (a restart on
  the same machine).

Each figure is the parent's wall time from starting the process (interpreter and imports included) to the child's
first answer (`engine.decide`, a short record). The child goes on until its background warm-up is done and reports
its phases (`import_s`, `load_s`, `decide_s` of the first answer, the engine's state then, `ready_s` from its
start to the end of the warm-up): the cold process must finish compiling for the warm one to find the caches. The
cache folder stays in DIRECTORY/cache-<model> (emptied before the cold process): later benchmarks in the same
machine session can start warm with CLEF_CACHE_DIR pointing there. The release is deleted after its model (the 27B
shape takes 55 GB of the disk) unless --keep, which leaves it in DIRECTORY/<model> with bench/sweep.py's
`.complete` marker (BENCH_RELEASE_DIR). OUT is merged into if it exists, and saved after every process.
BENCH_PROFILE_LOAD=1 adds a third, warm process whose `clef_engine.load` runs under cProfile (a diagnostic, in
`detail.<model>.profiled_load`; its times are not the start figures). BENCH_WRITE_BYTECODE=1 starts the processes
without PYTHONDONTWRITEBYTECODE, which the H200's image sets: the cold process then writes the `.pyc` files a pip
install into `.venv` (scripts/setup.sh) writes at install time, and the warm one reads them, as on a user's machine
(`detail.write_bytecode` says which way it ran).
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

SMOKE = os.environ.get("BENCH_CPU_SMOKE") == "1"
SHAPES = {"flash": "clef-flash", "clef": "clef"}
REQUEST = {"model": "start", "state": "a customer asks for a refund of order 1234",
           "questions": {"refund_due": {"type": "noul", "instructions": "Is a refund due?"}}}
FIRST_ANSWER = "first-answer"  # the child's line the parent times
PROFILE_LOAD = os.environ.get("BENCH_PROFILE_LOAD_CHILD") == "1"  # set by the parent for its profiled process
WRITE_BYTECODE = os.environ.get("BENCH_WRITE_BYTECODE") == "1"


def child(release: Path) -> None:
    """One fresh process: load, first answer (its line printed at once), then wait for the warm-up; a JSON line."""
    started = time.perf_counter()
    import clef_engine

    imported = time.perf_counter()
    profile = cProfile.Profile() if PROFILE_LOAD else None
    if profile is not None:
        profile.enable()
    engine = clef_engine.load(release, device="cpu" if SMOKE else None)
    loaded = time.perf_counter()
    if profile is not None:
        profile.disable()
        listing = io.StringIO()
        pstats.Stats(profile, stream=listing).sort_stats("cumulative").print_stats(40)
        print(json.dumps({"load_profile": listing.getvalue().splitlines()}), flush=True)
    answer = engine.decide(REQUEST)
    answered = time.perf_counter()
    state = engine.state
    print(FIRST_ANSWER, flush=True)
    while engine.state == "warming":
        time.sleep(0.1)
    ready = time.perf_counter()
    print(json.dumps({"import_s": round(imported - started, 2), "load_s": round(loaded - imported, 2),
                      "decide_s": round(answered - loaded, 3), "state_at_first_answer": state,
                      "ready_s": round(ready - started, 2), "warm_up_s": engine.info()["warm_up_seconds"],
                      "graphs": engine.info()["kernels"].get("cuda_graphs"),
                      "answer": answer["answers"]}), flush=True)
    engine.close(wait=True)


def fresh_process(release: Path, cache: Path, extra_env: dict | None = None) -> dict:
    """Start a child with `cache` as its cache folder; the seconds to its first answer and what it reported."""
    env = {**os.environ, "CLEF_CACHE_DIR": str(cache), **(extra_env or {})}
    if SMOKE:
        env["CLEF_WARM_UP"] = "1"  # off on the CPU by default: the smoke run checks the background path too
    for name in ("TRITON_CACHE_DIR", "TORCHINDUCTOR_CACHE_DIR"):
        env.pop(name, None)  # the engine puts them in the cache folder
    if WRITE_BYTECODE:
        env.pop("PYTHONDONTWRITEBYTECODE", None)
    started = time.perf_counter()
    process = subprocess.Popen([sys.executable, __file__, "--child", str(release)], stdout=subprocess.PIPE,
                               text=True, env=env)
    first = None
    report: dict = {}
    for line in process.stdout:
        if line.strip() == FIRST_ANSWER:
            first = time.perf_counter() - started
        elif line.startswith("{"):
            report.update(json.loads(line))
        else:
            print(line, end="", flush=True)
    process.wait()
    if process.returncode or first is None:
        raise RuntimeError(f"the child process exited with {process.returncode} before its first answer")
    return {"first_answer_s": round(first, 2), **report}


def drop_from_page_cache(directory: Path) -> bool:
    """Evict the release's files from the page cache, so that the next read comes from the disk."""
    try:
        for path in directory.iterdir():
            with open(path, "rb") as file:
                os.posix_fadvise(file.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
    except (AttributeError, OSError):
        return False
    return True


def disk_read_gb_s(directory: Path) -> float:
    """The read speed of the largest weight file, cold (then evicted again)."""
    largest = max(directory.glob("*.safetensors"), key=lambda p: p.stat().st_size)
    started = time.perf_counter()
    with open(largest, "rb", buffering=0) as file:
        while file.read(64 << 20):
            pass
    seconds = time.perf_counter() - started
    drop_from_page_cache(directory)
    return round(largest.stat().st_size / seconds / 1e9, 2)


def measure(model: str, directory: Path, results: dict, save, keep: bool) -> None:
    from bench.build import write_release
    from clef_engine.tiny import build_tiny_release

    release = directory / model
    shutil.rmtree(release, ignore_errors=True)
    release.mkdir(parents=True)
    detail = results["detail"].setdefault(model, {})
    detail["write"] = write_release(release, build_tiny_release(directory / "tiny"), SHAPES[model], smoke=SMOKE)
    os.sync()
    detail["page_cache_dropped"] = drop_from_page_cache(release)
    detail["disk_read_gb_s"] = disk_read_gb_s(release)
    detail["write_bytecode"] = WRITE_BYTECODE
    cache = directory / f"cache-{model}"
    shutil.rmtree(cache, ignore_errors=True)
    for run in ("cold", "warm"):
        detail[run] = fresh_process(release, cache)
        results["start"][f"{model}_{run}_s"] = detail[run]["first_answer_s"]
        save()
        print(model, run, detail[run], flush=True)
    if os.environ.get("BENCH_PROFILE_LOAD") == "1":  # a third, warm process: where its load's time goes
        profiled = fresh_process(release, cache, {"BENCH_PROFILE_LOAD_CHILD": "1"})
        detail["profiled_load"] = {"load_s_under_cprofile": profiled["load_s"], "top": profiled["load_profile"]}
        save()
    if keep:
        (release / ".complete").write_text("written by bench/start.py\n")
    else:
        shutil.rmtree(release, ignore_errors=True)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("out", type=Path, nargs="?")
    parser.add_argument("--models", default="flash,clef")
    parser.add_argument("--directory", type=Path, default=Path(tempfile.gettempdir()) / "start")
    parser.add_argument("--keep", action="store_true", help="leave the releases on disk for later benchmarks")
    parser.add_argument("--child", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child is not None:
        child(args.child)
        return 0
    if args.out is None:
        parser.error("OUT.json is required")
    import torch

    results = json.loads(args.out.read_text()) if args.out.exists() else {}
    results.setdefault("start", {})
    results.setdefault("detail", {})
    results["detail"]["command"] = " ".join(sys.argv)
    results["detail"]["machine"] = (f"{torch.cuda.get_device_name()}, torch {torch.__version__}"
                                    if torch.cuda.is_available() and not SMOKE else "CPU (BENCH_CPU_SMOKE)")

    def save() -> None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(results, indent=1, default=str))

    args.directory.mkdir(parents=True, exist_ok=True)
    for model in args.models.split(","):
        measure(model, args.directory, results, save, args.keep)
    print(json.dumps(results["start"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
