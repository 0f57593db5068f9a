"""Command line of the workbench's services, for scripts and CI (`--help` lists each command's flags): `run`,
`import`, `calibrate` and `sweep` do what the Runs, Case sets and Sweeps pages do and leave the same rows in the store.
docs/operations.md ("Batch runs from the command line") and docs/workbench.md ("Schema sweeps") say what each does
and its exit codes: 0 done, 1 failed or cancelled (the store refused, a run or sweep stopped), 2 wrong input (nothing
stored), 3 a sweep above `--fail-if-order-sensitive`, 130 Ctrl-C before a run started.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import sqlite3
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path
from typing import Any

from clef_engine import DEFAULT_MAX_LENGTH, ClefError, ReleaseError
from clef_workbench import calibration, importing, sweeps
from clef_workbench.casesets import CaseImportError, CsvMapping, import_cases
from clef_workbench.jobs import DEFAULT_CHUNK_SIZE, JobRunner, RunProgress, check_engine, fmt_seconds
from clef_workbench.model_loader import DEMO_SOURCE, request_model_name
from clef_workbench.schema_library import SchemaLibrary
from clef_workbench.schemas import Schema, SchemaError
from clef_workbench.store import NotFoundError, RayPlacement, Run, RunSettings, Store, StoreError, Sweep

PROGRESS_EVERY_S = 2.0
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


class UsageError(Exception):
    """Wrong input: the message says which argument and why."""


def path_argument(text: str) -> Path:
    """A file named on the command line; an empty name, or one with a NUL character, is a usage error."""
    if not text or "\x00" in text:
        raise argparse.ArgumentTypeError(f"{text!r} is not a file name")
    return Path(text)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m clef_workbench")
    commands = parser.add_subparsers(dest="command", required=True)
    store = argparse.ArgumentParser(add_help=False)
    store.add_argument("--db", required=True, type=path_argument,
                       help="the workbench's SQLite file (CLEF_DB of the workbench; import creates it when missing)")
    model = argparse.ArgumentParser(add_help=False)  # run's and sweep's: where and how the model answers
    model.add_argument("--model", required=True,
                       help=f"a release folder, a Hugging Face repo id, or {DEMO_SOURCE!r} for the demo release")
    model.add_argument("--revision", help="Hub revision of the release")
    # None until defaulted in main: a resumed run changes only the settings given
    model.add_argument("--max-length", type=int, help=f"token budget of one record (default {DEFAULT_MAX_LENGTH})")
    model.add_argument("--overflow", choices=["refuse", "truncate_state"],
                       help="a state over max_length: an error answer (refuse, the default) or its end cut off")
    model.add_argument("--ray", metavar="ADDRESS",
                       help="run on this Ray cluster ('auto' or the head's host:6379); default CLEF_RAY_ADDRESS, "
                            "none: in this process")
    model.add_argument("--replicas", type=int, help="engine replicas on Ray (default: one per GPU of the cluster)")
    model.add_argument("--device", help="in process: cpu or cuda (default: cuda when present)")
    model.add_argument("--dtype", help="float32, bfloat16 … (default: bf16 on CUDA, float32 on the CPU)")
    run = commands.add_parser("run", parents=[store, model],
                              help="run a case set against a schema and store the results")
    run.add_argument("--case-set", help="name of a case set in the database")
    run.add_argument("--schema", type=path_argument, help="a schema JSON file (as in the schema library)")
    run.add_argument("--resume", type=int, metavar="RUN_ID",
                     help="go on with a run that stopped (failed, cancelled, its process killed): only the cases "
                          "without a result are computed, with the run's case set, schema and settings (those of "
                          "--max-length, --overflow and --chunk-size given here replace the run's)")
    run.add_argument("--retry-failed", action="store_true",
                     help="with --resume: compute the cases whose result is an error again too, into the same run "
                          "(change what made them fail first, e.g. --max-length)")
    run.add_argument("--new", action="store_true",
                     help="start a new run even though one of the same case set, schema and model exists")
    run.add_argument("--chunk-tokens", type=int,
                     help="on Ray, cases are sent in chunks of about this many tokens (default: the replica's "
                          "token budget)")
    run.add_argument("--chunk-size", type=int, help=f"records per batch, in process (default {DEFAULT_CHUNK_SIZE})")
    sweep = commands.add_parser("sweep", parents=[store, model],
                                help="score variants of a schema on a labelled case set, one state per case")
    sweep.add_argument("--case-set", required=True, help="name of a case set in the database, with expected answers")
    sweep.add_argument("--schema", required=True,
                       help="the base schema: its id or name in the schema library (CLEF_SCHEMAS_DIR), or a file")
    sweep.add_argument("--variants", default="auto", metavar="auto|FILE.json",
                       help="'auto' (default): every automatic variant; or a JSON file of your own, a list of "
                            '{"name", "questions": {question id: question}}')
    sweep.add_argument("--folds", type=int, default=sweeps.DEFAULT_FOLDS,
                       help="k of the k-fold choice of the best variant per question")
    sweep.add_argument("--json", type=path_argument, metavar="OUT", help="write the results as JSON to OUT")
    sweep.add_argument("--fail-if-order-sensitive", type=float, metavar="X",
                       help="exit 3 when a question's order sensitivity (share of cases whose answer changes with "
                            "the options' order alone) exceeds X")
    sweep.add_argument("--resume", action="store_true",
                       help="go on with the stopped sweep of the same case set, schema, variants and model (only "
                            "its cases without answers are computed); a new sweep when there is none")
    calibrate = commands.add_parser(
        "calibrate", parents=[store], help="fit per-question calibration on a run's labelled cases and print "
                                           "before/after")
    calibrate.add_argument("--run", type=int, help="the run whose labelled cases to fit on (required unless --export)")
    calibrate.add_argument("--name", help="name to keep it under (default: schema · model · run)")
    calibrate.add_argument("--min-labelled", type=int, default=calibration.MIN_LABELLED,
                           help="fewest labelled cases a question needs to be fitted")
    calibrate.add_argument("--folds", type=int, default=calibration.FOLDS, help="k of the k-fold held-out check")
    calibrate.add_argument("--export", type=path_argument, metavar="FILE",
                           help="write every stored calibration to FILE for `clef-engine serve --calibrations FILE`")
    imp = commands.add_parser("import", parents=[store],
                              help="import a CSV, tab-separated, JSONL or .xlsx file into a case set")
    imp.add_argument("file", type=path_argument, help="the file (.csv, .tsv, .txt, .jsonl, .json or .xlsx)")
    imp.add_argument("--case-set", required=True, help="name of the case set (created when missing)")
    imp.add_argument("--schema", type=path_argument,
                     help="a schema JSON file: expected answers are checked against its questions, and columns "
                          "named after a question (team, expected_team) are its expected answers")
    imp.add_argument("--encoding", choices=list(importing.ENCODINGS), help="default: detected")
    imp.add_argument("--delimiter", choices=list(DELIMITER_NAMES), help="default: sniffed")
    imp.add_argument("--state-column", action="append", default=[], metavar="COLUMN",
                     help="a column that becomes a state field, the evidence the model reads (a.b nests; repeat "
                          "for more); default: every column not mapped to an id, answers, tags or media and not "
                          "named like an answer (expected_*, label, gold…, or a question of the schema, or without "
                          "--schema of any schema in the library)")
    imp.add_argument("--id-column", metavar="COLUMN",
                     help="the case's own id (kept with it, never evidence); default: the first column named like "
                          "an id (ticket_id, id, key …)")
    imp.add_argument("--state-text-column", metavar="COLUMN", help="one column whose text is the whole state")
    imp.add_argument("--expected", action="append", default=[], metavar="COLUMN=QUESTION",
                     help="a column of expected answers to a question (repeat); default: columns named after "
                          "the schema's questions")
    imp.add_argument("--tags-column", metavar="COLUMN", help="tags separated by ';' or ',' (default: 'tags')")
    imp.add_argument("--image-column", action="append", default=[], metavar="COLUMN",
                     help="image file paths (relative to the file's folder) or data URLs")
    imp.add_argument("--video-column", action="append", default=[], metavar="COLUMN", help="as --image-column")
    imp.add_argument("--skip-bad-rows", action="store_true",
                     help="import the other rows when some are ragged, empty or have an empty state (by default "
                          "they are listed and nothing is imported)")
    return parser.parse_args(argv)


DELIMITER_NAMES = {name: delimiter for delimiter, name in importing.DELIMITERS.items()} | {
    ",": ",", ";": ";", "\\t": "\t"}


def find_case_set(store: Store, name: str) -> int:
    sets = store.list_case_sets()
    for case_set in sets:
        if case_set["name"] == name:
            return case_set["id"]
    known = ", ".join(repr(s["name"]) for s in sets) or "none"
    raise UsageError(f"--case-set: no case set named {name!r} in {store.path} (there: {known})")


def load_schema(path: Path) -> dict:
    try:
        schema = Schema.from_json(path.read_text(encoding="utf-8"), source=path.name)
    except OSError as exc:
        raise UsageError(f"--schema: cannot read {path}: {exc.strerror or exc}") from None
    except UnicodeDecodeError:
        raise UsageError(f"--schema: {path} is not UTF-8 text") from None
    except SchemaError as exc:
        raise UsageError(f"--schema: {path} is not a valid schema: {exc}") from None
    return replace(schema, examples=[]).to_dict()  # without examples, as the Runs page stores it


def open_store(db: Path) -> Store:
    if not db.is_file():
        raise UsageError(f"--db: {db} does not exist (create case sets in the workbench or import them first)")
    return Store(db)


def check_model_args(args: argparse.Namespace, *ray_only: str) -> str | None:
    """The Ray address the run or sweep goes to (None: in this process), once the numbers are checked to be at least
    1 and the options in `ray_only` (besides --replicas) are checked to come with an address."""
    for name in ("replicas", "max_length", *ray_only, "chunk_size"):
        if getattr(args, name, None) is not None and getattr(args, name) < 1:
            raise UsageError(f"--{name.replace('_', '-')} must be at least 1")
    from clef_workbench.distributed import ray_address

    address = ray_address(args.ray)
    given = [f"--{name.replace('_', '-')}" for name in ("replicas", *ray_only) if getattr(args, name)]
    if address is None and given:
        raise UsageError(f"{' and '.join(given)} {'is' if len(given) == 1 else 'are'} for work on Ray: add "
                         "--ray ADDRESS or set CLEF_RAY_ADDRESS")
    return address


def start_model(args: argparse.Namespace, address: str | None) -> tuple[Any, dict[str, Any]]:
    """The release loaded in this process, or a distributed.ReplicaPool of it on Ray; and what it says of itself,
    with where it runs ("where")."""
    import clef_engine

    source = str(clef_engine.demo_release()) if args.model == DEMO_SOURCE else args.model
    if address is None:
        print(f"loading {args.model} in this process…", flush=True)
        try:
            engine = clef_engine.load(source, revision=args.revision, device=args.device, dtype=args.dtype)
        except ReleaseError as exc:  # no such release, device or dtype
            raise UsageError(f"--model {args.model}: {exc}") from None
        return engine, {**engine.info(), "where": "in process"}
    from clef_workbench.distributed import ReplicaPool, connect

    connect(address)
    print(f"starting replicas of {args.model} on Ray ({address})…", flush=True)
    pool = ReplicaPool.start(source, revision=args.revision, replicas=args.replicas, dtype=args.dtype)
    return pool, {**pool.info, "where": f"Ray, {pool.info['replicas']} replicas"}


@contextmanager
def stop_on_signals() -> Iterator[threading.Event]:
    """While a run is on, SIGINT (Ctrl-C) and SIGTERM set the event instead of interrupting: `watch` then cancels the
    run after the chunk in flight. A KeyboardInterrupt raised inside Thread.join makes Python 3.11 report the run's
    thread as ended while it still works, so the process exited under it and left the run `running`."""
    requested = threading.Event()
    previous = {signum: signal.signal(signum, lambda *_: requested.set()) for signum in STOP_SIGNALS}
    try:
        yield requested
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


def watch(runner: JobRunner, run_id: int, stop: threading.Event) -> RunProgress:
    """Print progress until the run's job ends; once `stop` is set, ask it to stop after the chunk in flight."""
    last_print, last_done, cancelling = 0.0, -1, False
    while True:
        ended = runner.wait(run_id, timeout=0.5)
        if stop.is_set() and not cancelling and not ended:
            print(f"run {run_id}: cancelling after the chunk in flight…", file=sys.stderr, flush=True)
            cancelling = runner.cancel(run_id)
        progress = runner.progress(run_id)
        now = time.monotonic()
        if ended or (progress["done"] != last_done and now - last_print >= PROGRESS_EVERY_S):
            rate = f"{progress['rate_per_s']:.2f} cases/s" if progress["rate_per_s"] else "measuring"
            print(f"run {run_id}: {progress['done']}/{progress['total']} cases · {progress['errors']} errors · "
                  f"{rate} · ETA {fmt_seconds(progress['eta_s'])}", flush=True)
            last_print, last_done = now, progress["done"]
        if ended:
            return progress


def same_run(store: Store, case_set_id: int, schema: dict, model_id: str, settings: RunSettings) -> Run | None:
    """The newest run of this case set with the same questions, model and token budget: its results are what this
    invocation would compute."""
    for run in store.list_runs(case_set_id):
        ran = run["settings"]
        if (run["model_id"] == model_id and run["schema"].get("questions") == schema["questions"]
                and run["schema"].get("name") == schema.get("name")
                and (ran.max_length, ran.overflow) == (settings.max_length, settings.overflow)):
            return run
    return None


def resume_or_new(store: Store, run: Run) -> int | None:
    """What to do about an earlier run of the same work: the run id to resume, or None for a new run. Asks at a
    terminal; without one, refuses with the flags that decide."""
    left = run["total"] - run["done"]
    holder = store.run_lease_holder(run["id"])
    what = (f"run {run['id']} ({run['status']}, {run['done']}/{run['total']} cases done) already runs this case set "
            "with this schema and model")
    if holder is not None:
        raise UsageError(f"{what}, in another process now ({holder}); wait for it, or pass --new to compute the case "
                         "set again as a new run")
    resume = f"--resume {run['id']}"
    if not sys.stdin.isatty():
        if left:
            raise UsageError(f"{what}; pass {resume} to compute only its {left} cases without a result, or --new to "
                             "compute the case set again as a new run")
        raise UsageError(f"{what} and has a result for every case; pass --new to compute the case set again as a new "
                         "run")
    if not left:
        again = input(f"{what} and has every result. Compute it again as a new run? [y/N]: ")
        if again.strip().lower() in ("y", "yes"):
            return None
        raise UsageError("nothing run")
    answer = input(f"{what}. Resume it ({left} cases left)? [Y]es / [n]ew run / [q]uit: ").strip().lower()
    if answer in ("", "y", "yes"):
        return run["id"]
    if answer in ("n", "new"):
        return None
    raise UsageError(f"nothing run: choose {resume} or --new")


def run_command(args: argparse.Namespace) -> int:
    from clef_workbench.distributed import RayJobRunner

    address = check_model_args(args, "chunk_tokens")
    store = open_store(args.db)
    store.require_writable()  # before the model loads: a run writes its results
    model_id = request_model_name(args.model)
    if args.retry_failed and args.resume is None:
        raise UsageError("--retry-failed goes with --resume RUN_ID: it computes that run's failed cases again")
    if args.resume is not None:
        if args.case_set or args.schema or args.new:
            raise UsageError("--resume goes on with the run's own case set and schema: leave out --case-set, "
                             "--schema and --new")
        try:
            run = store.get_run(args.resume)
        except NotFoundError:
            raise UsageError(f"--resume: there is no run {args.resume} in {args.db}") from None
        if run["model_id"] != model_id:
            raise UsageError(f"--model: run {run['id']} runs model {run['model_id']!r}, not {model_id!r}; give "
                             "--model for that model")
        to_compute = run["total"] - run["done"] + (run["errors"] if args.retry_failed else 0)
        if not to_compute:
            failed = (f"; its {run['errors']} failed case(s) are computed again with --retry-failed"
                      if run["errors"] else "")
            print(f"run {run['id']} has a result for every case: nothing to resume{failed}")
            return 0
        changed = {name: getattr(args, name) for name in ("max_length", "overflow", "chunk_size")
                   if name in args.given}
        if changed:  # the cases computed from now on use them; the answered ones keep theirs
            store.update_run_settings(run["id"], **changed)
        run_id: int | None = run["id"]
        settings = store.get_run(run["id"])["settings"]
        schema, case_set_name = run["schema"], run["case_set_name"]
    else:
        if not args.case_set or not args.schema:
            raise UsageError("--case-set and --schema are required (or --resume RUN_ID)")
        case_set_id = find_case_set(store, args.case_set)
        if not store.get_case_set(case_set_id)["case_count"]:
            raise UsageError(f"--case-set: {args.case_set!r} has no cases; import some first")
        schema = load_schema(args.schema)
        case_set_name = args.case_set
        settings = RunSettings(chunk_size=args.chunk_size, max_length=args.max_length, overflow=args.overflow,
                               schema_slug=args.schema.stem)
        earlier = None if args.new else same_run(store, case_set_id, schema, model_id, settings)
        run_id = None if earlier is None else resume_or_new(store, earlier)
    model, info = start_model(args, address)
    engine = model if address is None else None  # on Ray, the runner holds the replicas
    runner = JobRunner(store) if address is None else RayJobRunner(store, pool=model)
    if address is not None:
        settings = replace(settings, chunk_tokens=args.chunk_tokens or info["token_budget"],
                           ray=RayPlacement(address=address, replicas=info["replicas"], nodes=info["nodes"]))
    settings = replace(settings, device=info.get("device"), dtype=info.get("dtype"), precision=info.get("precision"))
    try:
        with stop_on_signals() as stop:
            check_engine(engine)  # a remote endpoint that does not answer: refused before a run is recorded
            doing = "run" if run_id is None else "resuming run"
            if run_id is None:
                run_id = store.create_run(case_set_id, schema=schema, model_id=model_id,
                                          model_revision=info.get("revision"), settings=settings)
            print(f"{doing} {run_id}: {case_set_name} · {schema['name']} v{schema['version']} · {args.model} on "
                  f"{info.get('device')} ({info['where']})", flush=True)
            runner.start(run_id, engine, check=False, retry_failed=args.retry_failed)  # checked above
            progress = watch(runner, run_id, stop)
    finally:
        model.close()
    if progress["status"] != "finished":
        # a run whose failure could not be written to the store still reads `running` there
        status = "failed" if progress["error"] and progress["status"] == "running" else progress["status"]
        reason = f": {progress['error']}" if progress["error"] else ""
        again = f"python -m clef_workbench run --db {args.db} --resume {run_id} --model {args.model}"
        hint = (f"to resume and compute its failed cases again: {again} --retry-failed, with what made them fail "
                "changed" if progress["errors"] else f"to resume: {again}")
        print(f"run {run_id} {status}{reason} ({hint})", file=sys.stderr)
        return 1
    print(f"run {run_id} finished: {progress['done']}/{progress['total']} cases, {progress['errors']} errors")
    return 0


def find_schema(text: str) -> tuple[dict, str | None]:
    """--schema: a library schema by id or name, else a file; (the schema, its library id or None)."""
    library = SchemaLibrary()
    broken = None  # a library file of that name that does not load: no match, but said if nothing else matches
    for entry in library.list():
        if entry.problem is None and text in (entry.slug, entry.name):
            return load_schema(entry.path), entry.slug
        if entry.problem is not None and text == entry.slug:
            broken = entry
    path = Path(text)
    if path.is_file():
        return load_schema(path), None
    if broken is not None:
        raise UsageError(f"--schema: {broken.path} in the library is not a valid schema: {broken.problem}")
    known = ", ".join(repr(s) for s in library.slugs()) or "none"
    raise UsageError(f"--schema: {text!r} is neither a schema of the library {library.directory} (there: {known}) "
                     "nor a file")


def sweep_variants(text: str, schema: dict) -> list[sweeps.Variant]:
    if text == "auto":
        return sweeps.auto_variants(schema)
    try:
        data = Path(text).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        reason = "not UTF-8 text" if isinstance(exc, UnicodeDecodeError) else exc.strerror or exc
        raise UsageError(f"--variants: cannot read {text}: {reason}") from None
    try:
        return sweeps.variants_from_json(data, schema, source=text)
    except sweeps.SweepError as exc:
        raise UsageError(f"--variants: {exc}") from None


def same_sweep(store: Store, case_set_id: int, schema: dict, variants: list[sweeps.Variant],
               model_id: str) -> Sweep | None:
    """The newest sweep of this case set with the same base questions, variants and model."""
    wanted = [(v.name, v.schema["questions"]) for v in variants]
    for listed in store.list_sweeps(case_set_id):
        if listed["model_id"] != model_id or listed["schema"]["questions"] != schema["questions"]:
            continue
        sweep = store.get_sweep(listed["id"])
        if [(v["name"], v["schema"]["questions"]) for v in sweep["variants"] if v["kind"] != "composed"] == wanted:
            return sweep
    return None


def print_sweep(result: sweeps.SweepResult) -> None:
    board = sweeps.leaderboard(result)
    print(board.to_string(index=False, float_format=lambda x: f"{x:.3f}"))
    if result.order_sensitivity:
        print("order sensitivity: " + ", ".join(f"{q} {share:.1%}" for q, share in result.order_sensitivity.items()))
    if result.best is not None:
        best = result.best
        print(f"best per question (chosen on {best.folds} folds' training cases): "
              + ", ".join(f"{q}: {name}" for q, name in best.choices.items()))
        if best.heldout_accuracy.value is not None and best.base_heldout_accuracy.value is not None:
            print(f"composed per fold, run on its held-out {best.cases} cases: accuracy "
                  f"{best.heldout_accuracy.value:.3f} [{best.heldout_accuracy.low:.3f}, "
                  f"{best.heldout_accuracy.high:.3f}]; the base {best.base_heldout_accuracy.value:.3f}")
    print(f"{result.cases} cases, {result.state_prefills} states prefilled, {len(result.errors)} failed answers")


def sweep_command(args: argparse.Namespace) -> int:
    address = check_model_args(args)
    if args.json is not None and (args.json.is_dir() or not args.json.parent.is_dir()):
        raise UsageError(f"--json: {str(args.json)!r} is not a file name in an existing folder")
    store = open_store(args.db)
    case_set_id = find_case_set(store, args.case_set)
    schema, slug = find_schema(args.schema)
    variants = [sweeps.base_variant(schema), *sweep_variants(args.variants, schema)]
    try:
        variants, _ = sweeps.check_sweep(store, case_set_id, schema, variants, folds=args.folds)
    except sweeps.SweepError as exc:
        raise UsageError(str(exc)) from None
    model_id = request_model_name(args.model)
    earlier = same_sweep(store, case_set_id, schema, variants, model_id)
    if earlier is not None and earlier["status"] != "finished" and not args.resume:
        raise UsageError(f"sweep {earlier['id']} of this case set, schema, variants and model stopped at "
                         f"{earlier['done']}/{earlier['total']} cases: pass --resume to compute only the rest")
    engine, info = start_model(args, address)
    if args.resume and earlier is not None:
        sweep_id = earlier["id"]
        print(f"resuming sweep {sweep_id}: {earlier['done']}/{earlier['total']} cases done", flush=True)
    else:
        settings = {"max_length": args.max_length, "overflow": args.overflow, "schema_slug": slug,
                    "device": info["device"], "dtype": info["dtype"], "precision": info.get("precision"),
                    "replicas": info.get("replicas")}
        sweep_id = sweeps.start_sweep(store, case_set_id, schema, variants, model_id=model_id,
                                      model_revision=info.get("revision"), settings=settings, folds=args.folds)
        print(f"sweep {sweep_id}: {len(variants)} variants over {args.case_set} on {info['device']} "
              f"({info['where']})", flush=True)
    last_print = [0.0]

    def show(progress: sweeps.SweepProgress) -> None:
        now = time.monotonic()
        if progress.status != "running" or now - last_print[0] >= PROGRESS_EVERY_S:
            rate = f"{progress.rate_per_s:.2f} cases/s" if progress.rate_per_s else "measuring"
            print(f"sweep {sweep_id}: {progress.done}/{progress.total} cases · {rate} · ETA "
                  f"{fmt_seconds(progress.eta_s)}", flush=True)
            last_print[0] = now

    try:
        with stop_on_signals() as stop:
            progress = sweeps.run_sweep(store, sweep_id, engine, progress=show, stop=stop.is_set)
    finally:
        engine.close()
    result = sweeps.load_sweep(store, sweep_id, threshold=args.fail_if_order_sensitive)
    print_sweep(result)
    if args.json is not None:
        document = {**result.to_json(), "computed_now": {"cases": progress.computed,
                                                         "state_prefills": progress.state_prefills},
                    "command": shlex.join(["python", "-m", "clef_workbench", *args.argv])}
        write_json(args.json, document)
    if progress.status != "finished":
        print(f"sweep {sweep_id} {progress.status} at {progress.done}/{progress.total} cases (to go on: the same "
              "command with --resume)", file=sys.stderr)
        return 1
    if result.flagged:
        print(f"order sensitive above {args.fail_if_order_sensitive}: " + ", ".join(
            f"{q} ({result.order_sensitivity[q]:.1%})" for q in result.flagged), file=sys.stderr)
        return 3
    return 0


def write_json(path: Path, document: dict[str, Any]) -> None:
    """Write a file through a temporary one beside it, renamed over it once complete: a full disk or a killed
    process leaves the earlier file as it was, never a truncated one."""
    partial = path.with_name(f".{path.name}.{os.getpid()}.partial")
    try:
        partial.write_text(json.dumps(document, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
        os.replace(partial, path)
    finally:
        partial.unlink(missing_ok=True)


def calibrate_command(args: argparse.Namespace) -> int:
    if args.run is None and args.export is None:
        raise UsageError("name the run to fit on (--run) or a file to export to (--export)")
    if args.export is not None and (args.export.is_dir() or not args.export.name):
        raise UsageError(f"--export: {str(args.export)!r} is not a file name")
    if args.folds < 2 or args.min_labelled < 1:
        raise UsageError("--folds must be at least 2 and --min-labelled at least 1")
    store = open_store(args.db)
    if args.run is not None:
        store.require_writable()  # before the fitting: its result is kept in the store
        try:
            store.get_run(args.run)
        except NotFoundError:
            raise UsageError(f"--run: there is no run {args.run} in {args.db}") from None
        calibration_id, reports = calibration.calibrate_run(store, args.run, name=args.name,
                                                            min_labelled=args.min_labelled, folds=args.folds)
        print(calibration.summary_table(reports).to_string(index=False))
        print(f"calibration {calibration_id} '{store.get_calibration(calibration_id)['name']}' saved "
              "(ECE and Brier after: on held-out cases; [95% bootstrap interval])")
    if args.export is not None:
        document = calibration.export_document(store)
        try:
            write_json(args.export, document)
        except OSError as exc:
            print(f"python -m clef_workbench calibrate: --export {args.export}: cannot write it "
                  f"({exc.strerror or exc}); the file was left as it was", file=sys.stderr)
            return 1
        print(f"exported {len(document['calibrations'])} calibration(s) to {args.export}")
    return 0


def import_mapping(args: argparse.Namespace, columns: list[str], schema: dict | None) -> CsvMapping:
    """The mapping of the flags, importing.suggest_mapping's where a flag is left out. Without --schema a column
    named like an answer is left out: its answers cannot be checked, and the model must not read them."""
    # without --schema, a column named after a question of any library schema holds answers: never evidence
    library = SchemaLibrary()
    questions = list((schema or {}).get("questions", {})) or [
        question for entry in library.list() if not entry.problem for question in library.load(entry.slug).questions]
    mapping = importing.suggest_mapping(columns, questions)
    if schema is None or args.expected:
        mapping.expected_columns = {}
    for pair in args.expected:
        column, sep, question_id = pair.partition("=")
        if not sep or not column or not question_id:
            raise UsageError(f"--expected: {pair!r} is not COLUMN=QUESTION")
        mapping.expected_columns[column] = question_id
    mapping.tags_column = args.tags_column or mapping.tags_column
    mapping.id_column = args.id_column or mapping.id_column
    mapping.image_columns, mapping.video_columns = args.image_column, args.video_column
    if args.state_column or args.state_text_column:
        mapping.state_columns, mapping.state_text_column = args.state_column, args.state_text_column
    else:
        used = {*mapping.expected_columns, mapping.tags_column, mapping.id_column, *args.image_column,
                *args.video_column}
        mapping.state_columns = [c for c in mapping.state_columns if c not in used]
    return mapping


def describe_mapping(mapping: CsvMapping, columns: list[str], chosen_state: bool) -> str:
    """Which column was taken as what, in words."""
    state = [mapping.state_text_column] if mapping.state_text_column else mapping.state_columns
    parts = [("case id", [mapping.id_column] if mapping.id_column else []), ("evidence (the state)", state),
             ("expected answers", [f"{c} → {q}" for c, q in mapping.expected_columns.items()]),
             ("tags", [mapping.tags_column] if mapping.tags_column else []),
             ("images", mapping.image_columns), ("videos", mapping.video_columns)]
    used = {*state, *mapping.expected_columns, mapping.tags_column, mapping.id_column, *mapping.image_columns,
            *mapping.video_columns}
    left_out = [c for c in columns if c.strip() and c not in used]
    words = [f"{what}: {', '.join(names)}" for what, names in parts if names]
    if left_out and chosen_state:
        words.append(f"left out: {', '.join(left_out)} (not chosen as state: --state-column COLUMN makes one evidence)")
    elif left_out:
        words.append(f"left out: {', '.join(left_out)} (named like answers: --schema imports them as expected "
                     "answers, --state-column COLUMN makes one evidence)")
    return "columns: " + " · ".join(words)


def import_command(args: argparse.Namespace) -> int:
    if args.file.suffix.lower() not in importing.FILE_SUFFIXES:
        raise UsageError(f"{args.file.name}: not a file import reads; use {', '.join(importing.FILE_SUFFIXES)}")
    if args.state_text_column and args.state_column:
        raise UsageError("--state-text-column makes one column's text the whole state; --state-column makes "
                         "columns state fields: give one of them")
    try:
        data = args.file.read_bytes()
    except OSError as exc:
        raise UsageError(f"cannot read {args.file}: {exc.strerror or exc}") from None
    schema = load_schema(args.schema) if args.schema else None
    delimiter = DELIMITER_NAMES[args.delimiter] if args.delimiter else None
    try:
        source = importing.read_source(args.file.name, data, encoding=args.encoding, delimiter=delimiter)
        print(f"read {args.file.name}: {source.describe()}", flush=True)
        mapping = None
        if source.kind != "jsonl":
            mapping = import_mapping(args, source.columns, schema)
            print(describe_mapping(mapping, source.columns, bool(args.state_column or args.state_text_column)),
                  flush=True)
        cases = importing.parse_cases(source, mapping, schema, skip_bad_rows=args.skip_bad_rows,
                                      base_dir=args.file.resolve().parent)
    except importing.BadRowsError as exc:
        raise UsageError(f"{len(exc.bad_rows)} row(s) cannot be imported, so nothing was: "
                         + "; ".join(exc.problems) + ". Add --skip-bad-rows to import the other rows.") from None
    except CaseImportError as exc:
        raise UsageError(f"{args.file.name}: {exc}") from None
    if not args.case_set.strip():
        raise UsageError("--case-set must not be empty")
    store = Store(args.db)
    case_set_id = store.get_or_create_case_set(args.case_set, schema_name=args.schema.stem if args.schema else None)
    added = import_cases(store, case_set_id, cases)
    print(f"imported {len(added)} case(s) into {args.case_set!r} (case set {case_set_id})"
          + (f"; {len(cases) - len(added)} already in it were skipped" if len(added) < len(cases) else ""))
    if source.kind != "jsonl" and args.skip_bad_rows:
        skipped = importing.bad_rows(source, mapping)
        if skipped:
            print(f"skipped {len(skipped)} bad row(s): " + "; ".join(map(str, skipped)))
    return 0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    args.argv = sys.argv[1:] if argv is None else argv
    defaults = {"max_length": DEFAULT_MAX_LENGTH, "overflow": "refuse", "chunk_size": DEFAULT_CHUNK_SIZE}
    args.given = {name for name in defaults if getattr(args, name, None) is not None}
    for name, value in defaults.items():
        if hasattr(args, name) and getattr(args, name) is None:
            setattr(args, name, value)
    command = {"run": run_command, "import": import_command, "calibrate": calibrate_command,
               "sweep": sweep_command}[args.command]
    try:
        return command(args)
    except (UsageError, calibration.CalibrationRefused) as exc:  # nothing stored: the input cannot be used
        print(f"python -m clef_workbench {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # before the run started (while loading); once it runs, Ctrl-C cancels it
        print("interrupted", file=sys.stderr)
        return 130
    except StoreError as exc:  # the store refuses the work
        print(f"python -m clef_workbench {args.command}: {exc}", file=sys.stderr)
        return 1
    except (ClefError, RuntimeError) as exc:  # a release that does not load, a replica that cannot start
        print(f"python -m clef_workbench {args.command}: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    except sqlite3.Error as exc:  # the database cannot be read or written before the run started
        print(f"python -m clef_workbench {args.command}: the database {args.db} cannot be used: {exc}",
              file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
