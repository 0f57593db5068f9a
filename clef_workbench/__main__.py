"""Command line of the workbench's services, for scripts and CI:

    python -m clef_workbench run --db DB --case-set NAME --schema FILE --model SOURCE [--ray ADDRESS] [--replicas N]

runs a case set against a schema file and leaves the run in the store exactly as the Runs page does (same settings,
same results), so Runs, Review and the exports show it. It prints progress, and exits 0 when the run finished, 1 when
it failed or was cancelled (Ctrl-C cancels after the chunk in flight), 2 when the input is wrong and 130 on Ctrl-C
before the run started.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from clef_engine import DEFAULT_MAX_LENGTH, ClefError
from clef_workbench.jobs import DEFAULT_CHUNK_SIZE, JobRunner, check_engine
from clef_workbench.model_loader import DEMO_SOURCE, request_model_name
from clef_workbench.schemas import Schema, SchemaError
from clef_workbench.store import Store, StoreError

PROGRESS_EVERY_S = 2.0


class UsageError(Exception):
    """Wrong input: the message says which argument and why."""


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m clef_workbench")
    commands = parser.add_subparsers(dest="command", required=True)
    run = commands.add_parser("run", help="run a case set against a schema and store the results")
    run.add_argument("--db", required=True, help="the workbench's SQLite file (CLEF_DB of the workbench)")
    run.add_argument("--case-set", required=True, help="name of a case set in the database")
    run.add_argument("--schema", required=True, type=Path, help="a schema JSON file (as in the schema library)")
    run.add_argument("--model", required=True,
                     help=f"a release folder, a Hugging Face repo id, or {DEMO_SOURCE!r} for the demo release")
    run.add_argument("--revision", help="Hub revision of the release")
    run.add_argument("--ray", metavar="ADDRESS",
                     help="run on this Ray cluster ('auto' or the head's host:6379); default CLEF_RAY_ADDRESS, "
                          "none: in this process")
    run.add_argument("--replicas", type=int, help="engine replicas on Ray (default: one per GPU of the cluster)")
    run.add_argument("--chunk-tokens", type=int,
                     help="on Ray, cases are sent in chunks of about this many tokens (default: the replica's "
                          "token budget)")
    run.add_argument("--chunk-size", type=int, default=DEFAULT_CHUNK_SIZE, help="records per batch, in process")
    run.add_argument("--max-length", type=int, default=DEFAULT_MAX_LENGTH, help="token budget of one record")
    run.add_argument("--overflow", choices=["refuse", "truncate_state"], default="refuse",
                     help="a state over max_length: an error result (refuse) or its end cut off")
    run.add_argument("--device", help="in process: cpu or cuda (default: cuda when present)")
    run.add_argument("--dtype", help="float32, bfloat16 … (default: bf16 on CUDA, float32 on the CPU)")
    return parser.parse_args(argv)


def find_case_set(store: Store, name: str) -> int:
    sets = store.list_case_sets()
    for case_set in sets:
        if case_set["name"] == name:
            return case_set["id"]
    known = ", ".join(repr(s["name"]) for s in sets) or "none"
    raise UsageError(f"--case-set: no case set named {name!r} in {store.path} (there: {known})")


def load_schema(path: Path) -> dict:
    try:
        schema = Schema.from_json(path.read_text(encoding="utf-8"), source=path.name).to_dict()
    except OSError as exc:
        raise UsageError(f"--schema: cannot read {path}: {exc.strerror or exc}") from None
    except UnicodeDecodeError:
        raise UsageError(f"--schema: {path} is not UTF-8 text") from None
    except SchemaError as exc:
        raise UsageError(f"--schema: {path} is not a valid schema: {exc}") from None
    schema.pop("examples", None)  # as the Runs page stores it
    return schema


def model_source(model: str) -> str:
    if model == DEMO_SOURCE:
        from clef_engine import demo_release

        return str(demo_release())
    return model


def fmt_seconds(value: float | None) -> str:
    if value is None:
        return "–"
    minutes, seconds = divmod(int(round(value)), 60)
    return f"{minutes} min {seconds:02d} s" if minutes else f"{seconds} s"


def watch(runner: JobRunner, run_id: int) -> dict:
    """Print progress until the run's job ends; Ctrl-C asks it to stop after the chunk in flight."""
    last_print, last_done = 0.0, -1
    while True:
        try:
            ended = runner.wait(run_id, timeout=0.5)
        except KeyboardInterrupt:
            print("cancelling after the chunk in flight…", file=sys.stderr, flush=True)
            runner.cancel(run_id)
            continue
        progress = runner.progress(run_id)
        now = time.monotonic()
        if ended or (progress["done"] != last_done and now - last_print >= PROGRESS_EVERY_S):
            rate = f"{progress['rate_per_s']:.2f} cases/s" if progress["rate_per_s"] else "measuring"
            print(f"run {run_id}: {progress['done']}/{progress['total']} cases · {progress['errors']} errors · "
                  f"{rate} · ETA {fmt_seconds(progress['eta_s'])}", flush=True)
            last_print, last_done = now, progress["done"]
        if ended:
            return progress


def run_command(args: argparse.Namespace) -> int:
    from clef_workbench.distributed import RayJobRunner, ReplicaPool, connect, ray_address

    if not Path(args.db).is_file():
        raise UsageError(f"--db: {args.db} does not exist (create case sets in the workbench or import them first)")
    for name in ("replicas", "chunk_tokens", "chunk_size", "max_length"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            raise UsageError(f"--{name.replace('_', '-')} must be at least 1")
    store = Store(args.db)
    case_set_id = find_case_set(store, args.case_set)
    schema = load_schema(args.schema)
    source = model_source(args.model)
    address = ray_address(args.ray)
    if address is None and (args.replicas or args.chunk_tokens):
        raise UsageError("--replicas and --chunk-tokens are for runs on Ray: add --ray ADDRESS or set CLEF_RAY_ADDRESS")
    settings = {"chunk_size": args.chunk_size, "max_length": args.max_length, "overflow": args.overflow,
                "schema_slug": args.schema.stem}
    engine = pool = None
    if address is None:
        import clef_engine

        print(f"loading {args.model} in this process…", flush=True)
        engine = clef_engine.load(source, revision=args.revision, device=args.device, dtype=args.dtype)
        info = engine.info()
        runner = JobRunner(store)
    else:
        connect(address)
        print(f"starting replicas of {args.model} on Ray ({address})…", flush=True)
        pool = ReplicaPool.start(source, revision=args.revision, replicas=args.replicas, dtype=args.dtype)
        info = pool.info
        settings["chunk_tokens"] = args.chunk_tokens or info["token_budget"]
        settings["ray"] = {"address": address, "replicas": info["replicas"], "nodes": info["nodes"]}
        runner = RayJobRunner(store, pool=pool)
    settings.update(device=info.get("device"), dtype=info.get("dtype"))
    try:
        if engine is not None:
            check_engine(engine)  # a remote endpoint that does not answer: refused before a run is recorded
        run_id = store.create_run(case_set_id, schema=schema, model_id=request_model_name(args.model),
                                  model_revision=info.get("revision"), settings=settings)
        where = f"Ray, {info['replicas']} replicas" if pool else "in process"
        print(f"run {run_id}: {args.case_set} · {schema['name']} v{schema['version']} · {args.model} on "
              f"{info.get('device')} ({where})", flush=True)
        runner.start(run_id, engine, check=False)  # checked above, before the run was recorded
        progress = watch(runner, run_id)
    finally:
        if pool is not None:
            pool.shutdown()
        if engine is not None:
            engine.close()
    if progress["status"] != "finished":
        reason = f": {progress['error']}" if progress["error"] else ""
        print(f"run {run_id} {progress['status']}{reason}", file=sys.stderr)
        return 1
    return 0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        return run_command(args)
    except UsageError as exc:
        print(f"python -m clef_workbench run: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # before the run started (while loading); once it runs, Ctrl-C cancels it
        print("interrupted", file=sys.stderr)
        return 130
    except (ClefError, StoreError, RuntimeError) as exc:  # a release that does not load, a replica that cannot start
        print(f"python -m clef_workbench run: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
