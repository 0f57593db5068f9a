# ruff: noqa: B023 — the timed closures run at once, inside the loop iteration that defines them
"""FP8 next to bf16 on the Clef-27B architecture on one H200 (issue 25, "An opt-in FP8 precision"; issue 38's
block-scaled scheme, fast/fp8.py), in one run, and the merge of bench/long_records.py's sections into the same
results file.

    python bench/lengths_and_precision.py OUT.json --smoke        (CUDA, a tiny shape: checks everything, ~1-2 min)
    python bench/lengths_and_precision.py OUT.json                (CUDA; flash-linear-attention installed; < 10 min)
    python bench/lengths_and_precision.py OUT.json --sections fidelity,bf16,fp8 --no-decide     (issue 38's keys)
    python bench/lengths_and_precision.py OUT.json --sections fidelity         (one section again, merged into OUT)
    python bench/lengths_and_precision.py OUT.json --sections long --long-results long-records.json   (no GPU)
    python bench/lengths_and_precision.py OUT.json --smoke --device cpu       (the script only, plain FP8 functions)

Sections (`--sections`, comma-separated, run in the order given, `long` first; default bf16,fp8,fidelity):
- bf16: one model with random bf16 weights of the Clef-27B shape (bench/build.py, never zeros) in an engine with the
  default configuration: 256 cases of 700-1,300 tokens through the workbench's JobRunner + SQLite, after an untimed
  `decide_many` of all of them (Triton compiles and autotunes for every pack length, the allocator grows; the
  engine's full warm-up, ~2 min of CUDA-graph captures for every length, is left out: a batch runs packs, not
  graphs); then `decide` p50 at ~512 and ~1k tokens (16 fresh states each, lengths drawn from 450-600 and 900-1,150
  as bench/user_paths.py does, each request decided once untimed first so that its length's CUDA graph is captured
  before the timed call).
- fp8: the bf16 engine closed, the same model (the same weights) loaded again with precision="fp8":
  its in-layer projections quantized in place in 128x128 blocks, the checks of the blockwise `torch._scaled_mm`
  and the fused FP8 norm run at start-up (a kernel that fails its check is replaced by its plain version:
  `detail.fp8.kernels` says which ran, and why); weights in GiB; the same batch and `decide` timings; and its
  answers next to bf16's on the timed requests. `--no-decide` leaves out the `decide` timings of both sections.
- fidelity: the 27B model freed; bench/fidelity.py's comparison on the Clef-Flash shape: the truth is the release path
  in float32 (TF32 off) on 55 varied records; ours in bf16 and in fp8 (`engine.runner.forward`, one record at a time,
  as `decide` runs it; CUDA graphs off, which replay the same kernels). Clef-27B's float32 truth (~110 GB) does not
  fit next to its bf16 copy on one H200, hence the Flash shape (said in `fp8.fidelity_shape`).
- long: `long` and `p95_over_p50_16k` (and their detail) copied from bench/long_records.py's results (`--long-results`).

Writes OUT.json after every section and step, in issue 25's and 38's layout: `fp8.{bf16_batch_tokens_per_s,
fp8_batch_tokens_per_s, batch_speedup, p50_512_ms, p50_1024_ms, weights_gib, max_dp, max_flip_margin, flips,
questions}` (plus `gate_met`, `scheme`, `fidelity_shape`), `long`, `p95_over_p50_16k`; everything else under
`detail`. An existing OUT.json is read first and the sections run now replace their keys, so several calls build one
file. BENCH_DEADLINE_S (560) is the time after start by which it stops starting steps that would not end in time.
Copy the file to bench/results/<date>-h200-lengths-and-precision.json (or its `fp8` keys into issue 38's
<date>-h200-start-and-shapes.json): the engine reads FP8's distance from float32 there
(`Engine.info()["distance_from_float32"]`).
"""

from __future__ import annotations

import argparse
import copy
import gc
import json
import random
import statistics
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import build  # noqa: E402

STARTED = time.perf_counter()
SECTIONS = ("bf16", "fp8", "fidelity", "long")
BATCH_CASES, LATENCY_SAMPLES, FIDELITY_RECORDS = 256, 16, 55
SMOKE_RECORDS = 8
LATENCY_BUCKETS = {"512": (450, 600), "1024": (900, 1150)}
# the smoke shape of the fidelity section: Clef-Flash's structure at a width a CPU or a minute of GPU runs, every
# projection's features a multiple of 16 (torch._scaled_mm's rule; fidelity.py's "tiny" has 4-wide b/a projections)
SMOKE_FIDELITY_SHAPE = dict(hidden=256, ffn=512, layers=4, heads=4, kv_heads=2, gdn_k=4, gdn_v=16, vision_out=256,
                            head_width=64, vocab="tiny", state_tokens=(30, 150))

results: dict = {"fp8": {}, "long": {}, "p95_over_p50_16k": None, "detail": {"errors": {}}}
OUT: Path
DEADLINE = 0.0


def save() -> None:
    OUT.write_text(json.dumps(results, indent=1, default=str))


def left() -> float:
    return DEADLINE - time.perf_counter()


def say(*parts) -> None:
    print(f"[{time.perf_counter() - STARTED:6.1f} s]", *parts, flush=True)


section = build.sections(left, save, results["detail"]["errors"])


# ---- engines over one model ---------------------------------------------------------------------------------------

class Setup:
    """What every section shares: device, shapes, the tiny release (tokenizer, processor)."""

    def __init__(self, args):
        from clef_engine.tiny import build_tiny_release

        self.smoke = args.smoke
        self.decide = not args.no_decide
        self.device = torch.device(args.device)
        self.scale = 16 if self.smoke else 1  # request lengths divided by this in the smoke run
        self.tiny = build_tiny_release(Path(tempfile.mkdtemp(prefix="clef-bench-tiny-")))


def engine_config(setup: Setup, precision: str, **options):
    """The default configuration for `precision`. On a CPU (the script's own check) FP8 is refused by the config, so
    the config is built as bf16 and then marked fp8: the plain FP8 functions run (fp8.select_fp8_kernels)."""
    from clef_engine.config import EngineConfig

    if setup.device.type == "cpu" and precision == "fp8":
        return replace(EngineConfig.resolve(device="cpu", dtype="bfloat16", precision="bf16", **options),
                       precision="fp8")
    # no background warm-up: the kernels are chosen as the engine is built (see PackedRunner)
    return EngineConfig.resolve(device=str(setup.device), dtype="bfloat16", precision=precision, warm_up=False,
                                **options)


def make_engine(setup: Setup, model, head, head_config, config_json: dict, precision: str, **options):
    import clef_engine
    from clef_engine.model.encoding import Encoder
    from clef_engine.model.release import Release, load_processor

    checked = Release(path=setup.tiny, source=f"clef-27b-shaped-random-{precision}", revision=None,
                      config=config_json, head_config=head_config, weight_files=())
    config = engine_config(setup, precision, **options)
    return clef_engine.Engine(checked, model, head, Encoder(load_processor(checked)), config=config)


def free() -> None:
    """Memory of what nothing references any more (engines hold reference cycles: collected, not just dropped)."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def close_big_engine() -> None:
    if Big.engine is not None:
        Big.engine.close()
        Big.engine = None
    free()


# ---- the measurements -----------------------------------------------------------------------------------------------

def batch_requests(setup: Setup, engine, count: int) -> tuple[list[dict], dict]:
    rng = random.Random(7)
    schema = build.schema(4, 3, 4, noul_every=4)
    return [build.sized_request(engine, rng.randint(700, 1300) // setup.scale, schema, seed=7000 + i)
            for i in range(count)], schema


def batch_run(setup: Setup, engine) -> dict:
    """The whole case set once through `decide_many`, untimed (as bench/user_paths.py's batch_run does before its
    workbench run: every pack length's Triton compiles and autotunes happen there, in either precision), then the
    case set through the JobRunner (tokens/s of the whole run)."""
    cases = 24 if setup.smoke else BATCH_CASES
    requests, schema = batch_requests(setup, engine, cases)
    t0 = time.perf_counter()
    engine.decide_many([dict(r, state=f"warm {r['state']}") for r in requests])
    warm_s = time.perf_counter() - t0
    with tempfile.TemporaryDirectory() as folder:
        seconds, tokens, progress = build.store_run(engine, requests, schema, Path(folder) / "w.sqlite3")
    return {"tokens_per_s": round(tokens / seconds), "cases": cases, "tokens": tokens, "seconds": round(seconds, 2),
            "warm_up_batch_s": round(warm_s, 2), "run": progress}


def latency_requests(setup: Setup, engine) -> dict[str, list[dict]]:
    rng = random.Random(12)
    samples = 3 if setup.smoke else LATENCY_SAMPLES
    return {name: [build.sized_request(engine, rng.randint(low, high) // setup.scale,
                                       build.schema(4, 3, 100_000 * (i + 1) + int(name), noul_every=4),
                                       seed=100_000 * (i + 1) + int(name)) for i in range(samples)]
            for name, (low, high) in LATENCY_BUCKETS.items()}


def latencies(engine, requests: dict[str, list[dict]]) -> dict:
    """`decide` wall times per length bucket: each request decided once untimed (its length's CUDA graph and its
    schema's head graph are captured then; below the state cache's least prefix nothing is cached), then timed."""
    out = {}
    for name, bucket in requests.items():
        if left() < 20:
            results["detail"]["errors"][f"latency_{name}"] = f"skipped: {left():.0f} s left"
            continue
        for request in bucket:
            engine.decide(request)
        times, answers, tokens = [], [], []
        for request in bucket:
            t0 = time.perf_counter()
            response = engine.decide(request)
            times.append(round((time.perf_counter() - t0) * 1000, 2))
            answers.append(response["answers"])
            tokens.append(response["usage"]["input_tokens"])
        out[name] = {"p50_ms": round(statistics.median(times), 2), "ms": times, "tokens": tokens, "answers": answers}
    return out


def answer_distance(a: list[dict], b: list[dict]) -> dict:
    """max |Δp| and argmax flips between two runs' System One answers of the same requests."""
    worst, flips, questions = 0.0, 0, 0
    for answers_a, answers_b in zip(a, b, strict=True):
        for qid, x in answers_a.items():
            y = answers_b[qid]
            px = x["probabilities"] if "probabilities" in x else {"true": x["noul"], "false": 1 - x["noul"]}
            py = y["probabilities"] if "probabilities" in y else {"true": y["noul"], "false": 1 - y["noul"]}
            worst = max(worst, max(abs(px[k] - py[k]) for k in px))
            flips += max(px, key=px.get) != max(py, key=py.get)
            questions += 1
    return {"max_dp": round(worst, 4), "flips": flips, "questions": questions}


def weights_gib(engine) -> float:
    from clef_engine.fast.fp8 import weight_bytes

    return build.gib(weight_bytes(engine.runner.model, engine.runner.head))


class Big:
    """The Clef-27B-shaped model and its engines, across the bf16 and fp8 sections."""

    model = head = head_config = config_json = None
    engine = None
    latency_requests: dict | None = None
    bf16_answers: dict | None = None


def build_big(setup: Setup) -> None:
    free()  # what an earlier section (fidelity, when run first) left
    if setup.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    config_json = build.clef_config("clef", setup.tiny)
    if setup.smoke:
        build.scale_down(config_json)
    t0 = time.perf_counter()
    Big.model = build.build_model(config_json, device=str(setup.device))
    Big.head, Big.head_config = build.build_head(config_json["text_config"]["hidden_size"], device=str(setup.device),
                                                 width=64 if setup.smoke else 1024)
    Big.config_json = config_json
    results["detail"]["build_s"] = round(time.perf_counter() - t0, 1)
    say("built the", "scaled-down" if setup.smoke else "Clef-27B-shaped", "model")


def measure_engine(setup: Setup, precision: str) -> dict:
    """Batch and latency of one engine over Big.model; its figures go under detail[precision]."""
    detail = results["detail"].setdefault(precision, {})
    t0 = time.perf_counter()
    Big.engine = engine = make_engine(setup, Big.model, Big.head, Big.head_config, Big.config_json, precision)
    detail["engine_s"] = round(time.perf_counter() - t0, 1)
    detail["precision"] = engine.info()["precision"]
    detail["kernels"] = engine.runner.info()["kernels"].get("packed")
    detail["weights_gib"] = weights_gib(engine)
    detail["memory_loaded_gib"] = build.gib(engine.loaded_bytes)
    say(precision, "engine ready in", detail["engine_s"], "s; weights", detail["weights_gib"], "GiB")
    save()
    detail["batch_run"] = batch_run(setup, engine)
    say(precision, "batch:", detail["batch_run"]["tokens_per_s"], "tokens/s")
    save()
    timed = {}
    if setup.decide:
        if Big.latency_requests is None:
            Big.latency_requests = latency_requests(setup, engine)
        timed = latencies(engine, Big.latency_requests)
        detail["decide"] = {name: {k: v for k, v in row.items() if k != "answers"} for name, row in timed.items()}
        say(precision, "decide p50:", {name: row["p50_ms"] for name, row in timed.items()})
    if setup.device.type == "cuda":
        detail["memory_peak_allocated_gib"] = build.gib(torch.cuda.max_memory_allocated())
    detail["scheduler"] = vars(engine.scheduler.stats).copy()
    return {name: row["answers"] for name, row in timed.items()}


@section("bf16", needs_s=90)
def bf16_section(setup: Setup) -> None:
    if Big.model is None:
        build_big(setup)
    Big.bf16_answers = measure_engine(setup, "bf16")
    results["fp8"]["bf16_batch_tokens_per_s"] = results["detail"]["bf16"]["batch_run"]["tokens_per_s"]


@section("fp8", needs_s=90)
def fp8_section(setup: Setup) -> None:
    if Big.model is None:
        build_big(setup)
    close_big_engine()  # its fused bf16 weights go as the fp8 engine re-fuses and quantizes the modules' views
    answers = measure_engine(setup, "fp8")
    detail = results["detail"]["fp8"]
    say("fp8 kernels:", {k: v for k, v in detail["kernels"].items() if k.startswith("fp8.")})
    fp8 = results["fp8"]
    fp8["fp8_batch_tokens_per_s"] = detail["batch_run"]["tokens_per_s"]
    for name in LATENCY_BUCKETS:
        fp8[f"p50_{name}_ms"] = detail.get("decide", {}).get(name, {}).get("p50_ms")
    fp8["weights_gib"] = detail["weights_gib"]
    if fp8.get("bf16_batch_tokens_per_s"):
        fp8["batch_speedup"] = round(fp8["fp8_batch_tokens_per_s"] / fp8["bf16_batch_tokens_per_s"], 3)
    if Big.bf16_answers:  # the same requests, the same weights: how far FP8 moves the answers from bf16's
        detail["vs_bf16"] = {name: answer_distance(answers[name], Big.bf16_answers[name])
                             for name in answers if name in Big.bf16_answers}


@section("fidelity", needs_s=120)
def fidelity_section(setup: Setup) -> None:
    """Distances from the float32 truth (bench/fidelity.py's records and comparison) of ours in bf16 and in fp8."""
    from bench import fidelity as F
    from clef_engine.fp8_fidelity import GATE_FLIP_MARGIN, GATE_MAX_DP, SCHEME

    close_big_engine()
    Big.model = Big.head = None
    free()
    shape = "fp8-smoke" if setup.smoke else "flash"
    F.SHAPES.setdefault("fp8-smoke", SMOKE_FIDELITY_SHAPE)
    sizes = F.SHAPES[shape]
    records = SMOKE_RECORDS if setup.smoke else FIDELITY_RECORDS
    t0 = time.perf_counter()
    config_json = F.shape_config(shape, setup.tiny)
    model = build.build_model(config_json, device=str(setup.device), seed=0)
    head, head_config = build.build_head(sizes["hidden"], device=str(setup.device), seed=1, width=sizes["head_width"])
    from clef_engine.model.encoding import Encoder
    from clef_engine.model.release import Release, load_processor
    from clef_engine.protocol import prepare

    checked = Release(path=setup.tiny, source=f"{shape}-shaped-random", revision=None, config=config_json,
                      head_config=head_config, weight_files=())
    encoder = Encoder(load_processor(checked))
    rng = random.Random(0)
    low, high = sizes["state_tokens"]
    encoded = [encoder.encode(prepare(F.varied_request(rng, rng.randint(low, high)), max_length=2**31 - 1))
               for _ in range(records)]
    truth_model, truth_head = copy.deepcopy(model).float(), copy.deepcopy(head).float()
    order = sorted(range(records), key=lambda i: len(encoded[i]))  # padded batches of similar lengths: less padding
    with F._NoTF32():
        by_length = F.release_path(truth_model, truth_head, encoder, torch.float32, [encoded[i] for i in order])
    truth = [None] * records
    for i, answer in zip(order, by_length):
        truth[i] = answer
    del truth_model, truth_head, by_length
    free()
    truth_s = round(time.perf_counter() - t0, 1)
    say("float32 truth of", records, "records in", truth_s, "s")
    detail = {"shape": shape, "records": records, "truth_s": truth_s,
              "questions": sum(len(r.questions) for r in encoded),
              "options": sum(len(s) for r in encoded for s in r.option_spans),
              "tokens": {"min": min(map(len, encoded)), "max": max(map(len, encoded)),
                         "mean": round(sum(map(len, encoded)) / records)}}
    results["detail"]["fidelity"] = detail
    save()
    for precision in ("bf16", "fp8"):  # bf16 first: fp8 quantizes the model in place
        if left() < 30:
            results["detail"]["errors"][f"fidelity_{precision}"] = f"skipped: {left():.0f} s left"
            continue
        t0 = time.perf_counter()
        engine = make_engine(setup, model, head, head_config, config_json, precision, cuda_graphs=False)
        try:
            with torch.inference_mode():
                ours = [engine.runner.forward([r])[0] for r in encoded]
            fp8_kernels = {k: v for k, v in engine.runner.backbone.kernels.describe().items() if k.startswith("fp8.")}
        finally:
            engine.close()
            del engine
            free()
        distance = F.compare(ours, truth)
        distance["seconds"] = round(time.perf_counter() - t0, 1)
        if fp8_kernels:  # which FP8 GEMM and norm answered (a plain one where the CUDA one failed its check)
            distance["kernels"] = fp8_kernels
        detail[precision] = distance
        say(precision, "vs float32:", {k: v for k, v in distance.items() if k != "flip_margins"})
        save()
    detail["truth_top2_gap_smallest"] = F.top_two_gaps(truth)[:10]
    if "fp8" in detail:
        fp8 = detail["fp8"]
        margin = max(fp8["flip_margins"], default=0.0)
        results["fp8"].update(max_dp=fp8["max_dp"], max_flip_margin=margin, flips=fp8["flips"],
                              questions=detail["questions"], scheme=SCHEME,
                              gate_met=fp8["max_dp"] <= GATE_MAX_DP and margin <= GATE_FLIP_MARGIN,
                              fidelity_shape=(f"{shape} (random weights; the truth is the release path in float32; "
                                              "Clef-27B's float32 truth does not fit next to its bf16 copy on one "
                                              "H200)" if not setup.smoke else f"{shape} (smoke)"))


@section("long")
def long_section(path: Path | None) -> None:
    if path is None:
        raise ValueError("--sections long needs --long-results FILE (bench/long_records.py's output)")
    long_records = json.loads(path.read_text())
    results["long"] = long_records.get("long") or {}
    results["p95_over_p50_16k"] = long_records.get("p95_over_p50_16k")
    results["detail"]["long_records"] = {"source": str(path), "detail": long_records.get("detail")}


def main(argv: list[str] | None = None) -> int:
    global OUT, DEADLINE
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--sections", default="bf16,fp8,fidelity",
                        help=f"comma-separated, of {', '.join(SECTIONS)} (default bf16,fp8,fidelity)")
    parser.add_argument("--long-results", type=Path, help="bench/long_records.py's results, for --sections long")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes and counts: the whole run in a minute or two")
    parser.add_argument("--no-decide", action="store_true",
                        help="leave out the decide timings of the bf16 and fp8 sections (batch speed only)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--deadline-s", type=float, default=None, help="default: BENCH_DEADLINE_S or 560")
    args = parser.parse_args(argv)
    import os

    DEADLINE = STARTED + (args.deadline_s or float(os.environ.get("BENCH_DEADLINE_S", "560")))
    chosen = [name.strip() for name in args.sections.split(",") if name.strip()]
    unknown = sorted(set(chosen) - set(SECTIONS))
    if unknown:
        parser.error(f"unknown section(s) {', '.join(unknown)}; use {', '.join(SECTIONS)}")
    if args.device == "cpu" and not args.smoke and set(chosen) - {"long"}:
        parser.error("on a CPU only --smoke runs (the full shapes need the H200)")
    OUT = args.out
    OUT.parent.mkdir(parents=True, exist_ok=True)
    if OUT.exists():  # another call's sections: kept, the ones run now replace theirs
        previous = json.loads(OUT.read_text())
        results.update({key: value for key, value in previous.items() if key != "detail"})
        results["detail"].update({key: value for key, value in previous.get("detail", {}).items() if key != "errors"})
        results["detail"]["errors"].update(previous.get("detail", {}).get("errors", {}))
        for name in chosen:
            results["detail"]["errors"] = {key: value for key, value in results["detail"]["errors"].items()
                                           if not key.startswith(name)}
    runs = results["detail"].setdefault("runs", [])
    runs.append({"command": " ".join(sys.argv), "sections": chosen, "smoke": args.smoke})
    if "long" in chosen:
        long_section(args.long_results)
    if set(chosen) - {"long"}:
        setup = Setup(args)
        if setup.device.type == "cuda":
            import transformers

            runs[-1]["environment"] = {"torch": torch.__version__, "transformers": transformers.__version__,
                                       "gpu": torch.cuda.get_device_name()}
        steps = {"bf16": bf16_section, "fp8": fp8_section, "fidelity": fidelity_section}
        for name in chosen:
            if name in steps:
                steps[name](setup)
        close_big_engine()
    runs[-1]["elapsed_s"] = round(time.perf_counter() - STARTED, 1)
    save()
    build.print_summary(results)
    return 1 if results["detail"]["errors"] and args.smoke else 0


if __name__ == "__main__":
    sys.exit(main())
