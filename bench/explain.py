"""How long "Why" takes (issue 26): `Engine.explain` of a ~1k-token text record of 32 sentences on Clef-27B- and
Clef-Flash-shaped engines, and of a 16-region image on the Clef-27B shape, on one H200.

    python bench/explain.py [OUT.json]       (CUDA; flash-linear-attention installed; < 5 minutes; default OUT:
                                              bench/results/<UTC date>-h200-explain.json)
    python bench/explain.py --smoke OUT.json (or BENCH_CPU_SMOKE=1: scaled-down shapes on the CPU, checks the
                                              script only; its numbers say nothing about the H200)

Random bf16 weights (bench/build.py) and the tiny release's tokenizer. Per model, one engine at a time (built,
measured, freed):

- text: a ~1,024-token request (4 questions) whose state is 32 sentences of ordinary words; `explain` decides the
  record and its 32 one-sentence-shorter copies as one job. After one untimed call (compiles, autotunes), REPEATS
  timed calls: p50 / min wall seconds, tokens, and `decide` of the record alone for scale. Then the batch-vs-alone
  check: for a few segments, the delta `explain` reported against deciding the shortened request by itself
  (`Engine.probabilities`), the largest difference (bf16 noise, not an error).
- image (Clef-27B only): a 1024×768 photo-like image with a short text state, unit "region": the record and its 16
  painted copies (padded multimodal batches).
- `prepare_p50_s` in each: the part of the wall time spent before the job reaches the GPU worker (splitting the
  state, painting, tokenizing and running the image processor on every variant), the rest is the batched forward.

- shared prefix: how many of the variants' tokens repeat the record's own tokens before the first one the variant
  changes (the prefix, the media and the state up to the removed segment) — what reusing "the prefix before the
  first removed segment" saves — and whether the engine reuses it: for a text record it does (issue 38: the record
  runs once in chunks ending where the variants change, each variant continues from the record's state there,
  explain.py's SharedPrefixes); the media variants of an image run whole.

- variations (BENCH_VARIATIONS=1): the text record under torch.profiler; the runner's part alone (`forward_shared`,
  no encoding or queue), and once under cProfile (where the host's time goes); then again with 2 / 4 / 8 / 16
  split points (runner.SHARED_SPLITS, other than its own), p50 of three calls each.

BENCH_MODELS (clef-flash,clef) picks the shapes; BENCH_SKIP=image,batch_vs_alone leaves those out.
Each measured section carries its issue-26 target (`target_s`) and whether the p50 met it (`met`). CUDA graphs are
off (CLEF_CUDA_GRAPHS=0 unless set): an explanation runs packs and padded batches, never a graph. Writes OUT.json
after every section.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import io
import json
import os
import random
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

os.environ.setdefault("CLEF_CUDA_GRAPHS", "0")

from bench import build  # noqa: E402

SMOKE = os.environ.get("BENCH_CPU_SMOKE") == "1" or "--smoke" in sys.argv[1:]
DEVICE = torch.device("cpu" if SMOKE else "cuda")
DEADLINE = time.perf_counter() + float(os.environ.get("BENCH_DEADLINE_S", "600" if SMOKE else "280"))
SCALE = 4 if SMOKE else 1  # lengths and image sides divided by this on the CPU
RECORD_TOKENS = 1024
SENTENCES = 6 if SMOKE else 32
QUESTIONS = 2 if SMOKE else 4
REPEATS = 1 if SMOKE else 5
VARIATION_REPEATS = 1 if SMOKE else 3
SKIP = set(os.environ.get("BENCH_SKIP", "").split(","))
CHECKED_SEGMENTS = 2 if SMOKE else 4
IMAGE_SIZE = (1024, 768)
TARGETS_S = {"clef": {"text": 2.0, "image": 3.0}, "clef-flash": {"text": 0.6}}  # issue 38 (text), issue 26 (image)

results: dict = {"clef": {}, "clef-flash": {}, "detail": {"errors": {}}}
OUT: Path


def save() -> None:
    OUT.write_text(json.dumps(results, indent=1, default=str))


def left() -> float:
    return DEADLINE - time.perf_counter()


section = build.sections(left, lambda: save(), results["detail"]["errors"])


def text_request(engine) -> dict:
    """~RECORD_TOKENS tokens (scaled on the CPU) whose state is SENTENCES sentences of ordinary words."""
    questions = build.schema(QUESTIONS, 3, seed=26, noul_every=2)
    words = build.sized_state(engine, RECORD_TOKENS // SCALE, questions, seed=26).split()
    # full stops take tokens too: drop as many words as there are sentences so the record stays at its size
    words = words[: max(SENTENCES, len(words) - SENTENCES)]
    per = len(words) / SENTENCES
    sentences = [" ".join(words[round(i * per): round((i + 1) * per)]).capitalize() + "." for i in range(SENTENCES)]
    return {"model": "clef", "state": " ".join(sentences), "questions": questions}


def image_request() -> dict:
    from PIL import Image

    from clef_engine.protocol import data_url

    width, height = IMAGE_SIZE[0] // SCALE, IMAGE_SIZE[1] // SCALE
    rng = np.random.default_rng(26)
    # smooth colour fields plus noise: an image whose regions differ, as a photo's do
    y, x = np.mgrid[0:height, 0:width]
    pixels = np.stack([128 + 100 * np.sin(x / (37 + 20 * c) + y / (53 - 10 * c)) for c in range(3)], axis=-1)
    pixels = np.clip(pixels + rng.normal(0, 12, pixels.shape), 0, 255).astype(np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, "PNG")
    return {"model": "clef", "state": "Claim photo of the rear bumper.", "images": [data_url("image/png",
                                                                                           buffer.getvalue())],
            "questions": build.schema(2, 3, seed=27, noul_every=2)}


def timed_explain(engine, request: dict, unit: str) -> dict:
    engine.explain(request, unit=unit)  # untimed: compiles and autotunes these shapes
    walls, prepares, explained = [], [], None
    for _ in range(REPEATS):  # as engine.explain, split where the CPU's part (segments, encoding) hands over
        t0 = time.perf_counter()
        future = engine.submit_explanation(request, unit)
        prepares.append(time.perf_counter() - t0)
        explained = future.result()[0]
        build.sync(DEVICE)
        walls.append(time.perf_counter() - t0)
    t0 = time.perf_counter()
    engine.decide(request)
    build.sync(DEVICE)
    decide_s = time.perf_counter() - t0
    segments = next(iter(explained["x_explanations"].values()))
    return {"p50_s": build.percentile(walls, 0.5, 3), "min_s": round(min(walls), 3),
            "walls_s": [round(w, 3) for w in walls], "segments": len(segments),
            "prepare_p50_s": build.percentile(prepares, 0.5, 3),
            "record_tokens": explained["usage"]["input_tokens"], "variant_tokens": explained["x_explain_tokens"],
            "decide_alone_s": round(decide_s, 3), "explained": explained}


def batch_vs_alone(engine, request: dict, explained: dict) -> dict:
    """The reported delta against deciding the request without the segment alone, for the first few segments."""
    base = engine.probabilities([request])[0]
    worst = 0.0
    for q, question_id in enumerate(request["questions"]):
        chosen = int(np.argmax(base[q]))
        for segment in explained["x_explanations"][question_id][:CHECKED_SEGMENTS]:
            state = request["state"][: segment["start"]] + request["state"][segment["end"]:]
            again = engine.probabilities([dict(request, state=state)])[0]
            worst = max(worst, abs(segment["delta"] - (again[q][chosen] - base[q][chosen])))
    return {"max_abs_delta_difference": worst, "segments_checked": CHECKED_SEGMENTS * len(request["questions"])}


def shared_prefix(engine, request: dict, unit: str) -> dict:
    """Of the variants' tokens, how many repeat the record's own before the first token the variant changes; for a
    text record, also how many tokens the engine computes (the record once, each variant after the point it
    continues from: runner.continuation_points)."""
    from clef_engine.explain import segments
    from clef_engine.runner import continuation_points

    record = engine.encode(request)
    lengths, shared = [], []
    for location, variant in segments(request, record, unit):
        ids = engine.encode(variant()).input_ids
        if location["kind"] in ("region", "frame"):
            # a painted region keeps the token ids but changes every embedding of its image (the vision encoder
            # attends across the whole image): what is shared is the prefix before the media
            common = record.token_counts["prefix"]
        else:
            common = next((i for i, (a, b) in enumerate(zip(ids, record.input_ids)) if a != b),
                          min(len(ids), len(record.input_ids)))
        lengths.append(len(ids))
        shared.append(common)
    out = {"variant_tokens": sum(lengths), "shared_prefix_tokens": sum(shared),
           "shared_fraction": round(sum(shared) / max(1, sum(lengths)), 3),
           "reused_by_engine": not record.has_media}  # explain.py's SharedPrefixes: text records on the packed path
    if not record.has_media:
        start = {i: end for end, variants in continuation_points(shared).items() for i in variants}
        out["computed_tokens"] = len(record) + sum(n - start[i] for i, n in enumerate(lengths, start=1))
    return out


def computed_tokens(engine, request: dict, splits: int) -> int:
    """`shared_prefix`'s computed_tokens with runner.SHARED_SPLITS set to `splits`."""
    from clef_engine import runner

    default, runner.SHARED_SPLITS = runner.SHARED_SPLITS, splits
    try:
        return shared_prefix(engine, request, "sentence")["computed_tokens"]
    finally:
        runner.SHARED_SPLITS = default


def build_engine(name: str, tiny: Path):
    config = build.clef_config(name, tiny)
    if SMOKE:
        build.scale_down(config)
    t0 = time.perf_counter()
    engine = build.random_engine(config, tiny, device=str(DEVICE), dtype=torch.float32 if SMOKE else torch.bfloat16,
                                 head_width=64 if SMOKE else 1024)
    engine.model_id = f"{name}-shaped-random"
    results[name]["build_s"] = round(time.perf_counter() - t0, 1)
    return engine


@section("text", needs_s=20)
def text(name: str, engine) -> None:
    request = text_request(engine)
    measured = timed_explain(engine, request, "sentence")
    explained = measured.pop("explained")
    measured["target_s"] = TARGETS_S[name]["text"]
    measured["met"] = measured["p50_s"] <= measured["target_s"]
    results[name]["text"] = measured
    save()
    measured["shared_prefix"] = shared_prefix(engine, request, "sentence")
    if "batch_vs_alone" not in SKIP:
        results[name]["text"]["batch_vs_alone"] = batch_vs_alone(engine, request, explained)
    if os.environ.get("BENCH_VARIATIONS") == "1":
        variations(name, engine, request)


@section("variations", needs_s=60)
def variations(name: str, engine, request: dict) -> None:
    """The default under the profiler (GPU busy time against wall time, kernels by category); the runner's part
    alone (no encoding, no queue), p50 of VARIATION_REPEATS calls; then the explanation again with other split
    counts (runner.SHARED_SPLITS), p50 of VARIATION_REPEATS calls after one untimed each."""
    from clef_engine import runner
    from clef_engine.explain import segments

    out = results[name]["text"]["variations"] = {}
    if DEVICE.type == "cuda":
        out["profile"] = build.kernel_table(lambda: engine.explain(request, unit="sentence"), 2)
    def walls(fn) -> list[float]:
        """Wall seconds of VARIATION_REPEATS synchronized calls of `fn`."""
        seconds = []
        for _ in range(VARIATION_REPEATS):
            t0 = time.perf_counter()
            fn()
            build.sync(DEVICE)
            seconds.append(time.perf_counter() - t0)
        return seconds

    record = engine.encode(request)
    item = runner.SharedPrefixes([record, *(engine.encode(v()) for _, v in segments(request, record, "sentence"))])
    out["forward_shared_p50_s"] = build.percentile(walls(lambda: engine.runner.forward_shared(item)), 0.5, 3)
    out["forward_shared_python"] = build.python_profile(lambda: engine.runner.forward_shared(item))
    save()
    default = runner.SHARED_SPLITS
    for splits in (2, 4, 8, 16):
        if splits == default or left() < 30:
            continue
        runner.SHARED_SPLITS = splits
        try:
            engine.explain(request, unit="sentence")
            timed = walls(lambda: engine.explain(request, unit="sentence"))
        finally:
            runner.SHARED_SPLITS = default
        out[f"splits_{splits}"] = {"p50_s": build.percentile(timed, 0.5, 3), "min_s": round(min(timed), 3),
                                   "computed_tokens": computed_tokens(engine, request, splits)}
        save()


@section("image", needs_s=20)
def image(name: str, engine) -> None:
    request = image_request()
    measured = timed_explain(engine, request, "region")
    measured.pop("explained")
    measured["target_s"] = TARGETS_S[name]["image"]
    measured["met"] = measured["p50_s"] <= measured["target_s"]
    results[name]["image"] = measured
    save()
    measured["shared_prefix"] = shared_prefix(engine, request, "region")


def parse_args() -> argparse.Namespace:
    today = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d")
    parser = argparse.ArgumentParser(prog="python bench/explain.py", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out", nargs="?", type=Path,
                        default=Path(__file__).resolve().parent / "results" / f"{today}-h200-explain.json",
                        help="where the results go (default: %(default)s)")
    parser.add_argument("--smoke", action="store_true",
                        help="scaled-down shapes on the CPU (as BENCH_CPU_SMOKE=1): checks that the script runs")
    args = parser.parse_args()
    if SMOKE and args.out.resolve().parent == Path(__file__).resolve().parent / "results":
        parser.error("a smoke run's numbers are not H200 results: give it an OUT.json outside bench/results")
    return args


def main() -> int:
    global OUT
    OUT = parse_args().out
    OUT.parent.mkdir(parents=True, exist_ok=True)
    from clef_engine.tiny import build_tiny_release

    tiny = build_tiny_release(Path(os.environ.get("BENCH_TINY_DIR", tempfile.mkdtemp(prefix="clef-bench-tiny-"))))
    detail = results["detail"]
    detail["command"] = " ".join(sys.argv)
    detail["targets_s"] = TARGETS_S
    detail["device"] = "cpu (smoke: scaled-down shapes)" if SMOKE else "cuda"
    if DEVICE.type == "cuda":
        import transformers

        detail["environment"] = {"torch": torch.__version__, "transformers": transformers.__version__,
                                 "gpu": torch.cuda.get_device_name()}
    random.seed(26)
    # Flash first: the cheaper one is measured even if time runs short
    for name in os.environ.get("BENCH_MODELS", "clef-flash,clef").split(","):
        if left() < 60:
            detail["errors"][name] = f"skipped: {left():.0f} s left"
            continue
        engine = build_engine(name, tiny)
        detail[f"config_{name}"] = {k: str(v) for k, v in vars(engine.config).items()}
        text(name, engine)
        if "image" in TARGETS_S[name] and "image" not in SKIP:
            image(name, engine)
        if DEVICE.type == "cuda":
            results[name]["peak_allocated_gib"] = build.gib(torch.cuda.max_memory_allocated())
        engine.close()
        del engine
        gc.collect()
        if DEVICE.type == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
        save()
    save()
    build.print_summary(results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
