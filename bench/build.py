"""Build Clef-shaped models with random bf16 weights directly on the GPU (spec §1 sizes), for benchmarks; and what
every bench script shares: requests sized to a token count, CUDA-synchronized timing, sections that record their
error and carry on.

Token ids come from the tiny release's tokenizer (a byte-level BPE with every special token of §1), so requests
encode through the engine's real Encoder; the big vocabulary simply has unused rows.
"""

from __future__ import annotations

import functools
import json
import math
import random
import shutil
import sys
import threading
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from clef_engine.model.release import HeadConfig  # noqa: E402

SIZES = {
    "clef": dict(hidden=5120, ffn=17408, layers=64, heads=24, kv_heads=4, gdn_k=16, gdn_v=48, vision_out=5120),
    "clef-flash": dict(hidden=4096, ffn=12288, layers=32, heads=16, kv_heads=4, gdn_k=16, gdn_v=32, vision_out=4096),
}
VOCAB = 248_320


def clef_config(name: str, tiny_release: Path) -> dict:
    """config.json of a Clef / Clef-Flash shaped release, special-token ids taken from the tiny release."""
    import json

    tiny = json.loads((tiny_release / "config.json").read_text())
    s = SIZES[name]
    text = dict(tiny["text_config"])
    text.update(
        vocab_size=VOCAB, hidden_size=s["hidden"], intermediate_size=s["ffn"], num_hidden_layers=s["layers"],
        layer_types=(["linear_attention"] * 3 + ["full_attention"]) * (s["layers"] // 4),
        num_attention_heads=s["heads"], num_key_value_heads=s["kv_heads"], head_dim=256,
        linear_conv_kernel_dim=4, linear_key_head_dim=128, linear_value_head_dim=128,
        linear_num_key_heads=s["gdn_k"], linear_num_value_heads=s["gdn_v"], max_position_embeddings=262144,
        rope_parameters={"rope_type": "default", "rope_theta": 10_000_000.0, "partial_rotary_factor": 0.25,
                         "mrope_section": [11, 11, 10], "mrope_interleaved": True},
    )
    vision = dict(tiny["vision_config"])
    vision.update(depth=27, hidden_size=1152, intermediate_size=4304, num_heads=16, out_hidden_size=s["vision_out"],
                  num_position_embeddings=2304)
    config = dict(tiny)
    config.update(text_config=text, vision_config=vision)
    return config


def scale_down(config: dict) -> None:
    """A scaled-down copy of the architecture in place, so a bench script runs whole on a CPU (BENCH_CPU_SMOKE)."""
    t = config["text_config"]
    t.update(hidden_size=256, intermediate_size=512, num_hidden_layers=4, layer_types=t["layer_types"][:4],
             num_attention_heads=4, head_dim=64, vocab_size=2048, linear_num_value_heads=32,
             linear_key_head_dim=32, linear_value_head_dim=32)
    config["vision_config"].update(depth=1, out_hidden_size=256)


@torch.no_grad()
def randomize_backbone(model, seed: int = 0) -> None:
    """Random everywhere (never zeros): matrices N(0, 0.02); zero-centred RMSNorm gains ±0.1; the gated norm's gain
    1 ± 0.1; GDN decay parameters as transformers initializes them."""
    generator = torch.Generator(device=next(model.parameters()).device).manual_seed(seed)
    for name, p in model.named_parameters():
        if name.endswith("A_log"):
            p.copy_(torch.empty(p.shape, device=p.device).uniform_(1, 16, generator=generator).log())
        elif name.endswith("dt_bias"):
            p.copy_(1 + 0.1 * torch.randn(p.shape, device=p.device, generator=generator))
        elif "linear_attn.norm" in name or ("visual" in name and "norm" in name and name.endswith("weight")):
            p.copy_(1 + 0.1 * torch.randn(p.shape, device=p.device, generator=generator))
        elif "norm" in name:
            p.copy_(0.1 * torch.randn(p.shape, device=p.device, generator=generator))
        elif p.ndim == 1:  # biases (vision tower)
            p.copy_(0.02 * torch.randn(p.shape, device=p.device, generator=generator))
        else:
            p.normal_(0, 0.02, generator=generator)


def build_model(config: dict, device: str = "cuda", seed: int = 0):
    """Qwen3_5ForConditionalGeneration with random bf16 weights allocated on `device` (no fp32 copy)."""
    from transformers import Qwen3_5Config, Qwen3_5ForConditionalGeneration

    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device(device):
            model = Qwen3_5ForConditionalGeneration(Qwen3_5Config(**config))
    finally:
        torch.set_default_dtype(previous)
    model = model.to(torch.bfloat16)
    randomize_backbone(model, seed)
    return model.eval().requires_grad_(False)


def build_head(hidden: int, device: str = "cuda", seed: int = 1, *, width: int = 1024):
    from clef_engine.model.head import JointSchemaHead
    from clef_engine.tiny import randomize_head

    config = HeadConfig(hidden_size=hidden, width=width, routing_layers=2, layers=4, heads=16, feedforward=4096)
    head = JointSchemaHead(config)
    randomize_head(head, torch.Generator().manual_seed(seed))
    return head.to(device=device, dtype=torch.bfloat16).eval().requires_grad_(False), config


def random_engine(config: dict, tiny_release: Path, *, device: str = "cuda", dtype: torch.dtype = torch.bfloat16,
                  head_width: int = 1024):
    """A clef_engine.Engine over a random model of `config` built in place (no weights on disk), with the tiny
    release's tokenizer and processor."""
    import clef_engine
    from clef_engine.model.encoding import Encoder
    from clef_engine.model.release import Release, load_processor

    model = build_model(config, device=device)
    head, head_config = build_head(config["text_config"]["hidden_size"], device=device, width=head_width)
    if dtype != torch.bfloat16:
        model, head = model.to(dtype), head.to(dtype)
    checked = Release(path=tiny_release, source="clef-27b-shaped-random", revision=None, config=config,
                      head_config=head_config, weight_files=())
    # warm_up=False: the fast kernels are chosen as the engine is built (the caller warms up, if it wants to)
    return clef_engine.Engine(checked, model, head, Encoder(load_processor(checked)), torch.device(device), dtype,
                              warm_up=False)


RELEASE_FILES = ("tokenizer.json", "tokenizer_config.json", "processor_config.json", "chat_template.jinja",
                 "joint_schema_model.py", "LICENSE")


def write_release(directory: Path, tiny: Path, name: str, *, smoke: bool = False) -> dict:
    """A release of the `name` shape ("clef", "clef-flash"; scaled down with `smoke`, on the CPU) with random bf16
    weights written to `directory` with every file of a real one: sharded safetensors + index by transformers'
    save_pretrained, config.json of the real class, joint_head.safetensors + joint_head_config.json, and the tiny
    release's tokenizer / processor / chat template files (the tiny tokenizer's ids fit the big vocabulary).
    Returns what it wrote and how long it took."""
    from safetensors.torch import save_file

    started = time.perf_counter()
    config = clef_config(name, tiny)
    if smoke:
        scale_down(config)
    device = "cpu" if smoke else "cuda"
    model = build_model(config, device=device)
    built = time.perf_counter()
    params = parameter_count(model)
    directory.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(directory, max_shard_size="5GB")
    del model
    if not smoke:
        torch.cuda.empty_cache()
    saved = time.perf_counter()
    hidden = config["text_config"]["hidden_size"]
    head, head_config = build_head(hidden, device=device, width=64 if smoke else 1024)
    state = {k: v.detach().to("cpu").contiguous() for k, v in head.state_dict().items()}
    save_file(state, str(directory / "joint_head.safetensors"), metadata={"format": "pt"})
    (directory / "joint_head_config.json").write_text(json.dumps(
        {"hidden_size": hidden, "width": head_config.width, "routing_layers": head_config.routing_layers,
         "layers": head_config.layers, "heads": head_config.heads, "feedforward": head_config.feedforward}, indent=2))
    for file in RELEASE_FILES:
        if (tiny / file).exists():
            shutil.copy(tiny / file, directory / file)
    (directory / "README.md").write_text(f"# {name}-shaped release, random weights (benchmark only)\n")
    shards = sorted(directory.glob("model-*.safetensors"))
    return {"backbone_parameters": params, "head_parameters": parameter_count(head),
            "build_s": round(built - started, 1), "save_s": round(saved - built, 1), "shards": len(shards),
            "bytes_on_disk": sum(p.stat().st_size for p in directory.glob("*.safetensors"))}


def parameter_count(module) -> int:
    return sum(p.numel() for p in module.parameters())


def gib(n: int) -> float:
    return round(n / 2**30, 2)


def floor_ms(tokens: int, tokens_per_s: float = 15_800) -> float:
    return round(1000 * tokens / tokens_per_s, 1)


# ---- requests, timing, sections (shared by every bench script) ------------------------------------------------

WORDS = ("the invoice ticket customer payment refund amount total due date vendor alert security login password "
         "damage claim photo car vehicle image video order status approved rejected billing shipping delivery").split()


def schema(questions: int, options: int, seed: int, noul_every: int | None = None) -> dict:
    """`questions` typed questions: every `noul_every`-th a noul (None: none), the others choices of `options`."""
    rng = random.Random(seed)
    out = {}
    for q in range(questions):
        if noul_every and q % noul_every == 0:
            out[f"q{q}"] = {"type": "noul", "instructions": f"Is the {rng.choice(WORDS)} {rng.choice(WORDS)} due?"}
        else:
            out[f"q{q}"] = {"type": "choice", "instructions": f"Which {rng.choice(WORDS)} applies to the "
                                                                f"{rng.choice(WORDS)}?",
                            "criteria": {f"{rng.choice(WORDS)}_{k}": f"the {rng.choice(WORDS)} {rng.choice(WORDS)}"
                                         for k in range(options)}}
    return out


def sized_state(engine, tokens: int, questions: dict, seed: int) -> str:
    """A state of ordinary words (a fresh one per seed, at least one word) such that the request of `questions` is
    about `tokens` tokens, never more unless one word is already too many."""
    rng = random.Random(seed)
    words = [rng.choice(WORDS) for _ in range(tokens + 16)]
    fixed = engine.count_tokens({"state": "", "questions": questions}, max_length=2**31 - 1)["total"]
    budget = max(1, tokens - fixed)
    low, high = 1, len(words)
    while low < high:  # the most words whose state encodes within the budget
        mid = (low + high + 1) // 2
        if len(engine.encoder.tokenize(" ".join(words[:mid]))) <= budget:
            low = mid
        else:
            high = mid - 1
    return " ".join(words[:low])


def sized_request(engine, tokens: int, questions: dict, seed: int) -> dict:
    return {"model": "clef", "state": sized_state(engine, tokens, questions, seed), "questions": questions}


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


ALLOCATOR_COUNTS = ("num_alloc_retries", "num_device_alloc", "num_device_free", "num_sync_all_streams")


def allocator_counts(device: torch.device) -> dict[str, int]:
    """The caching allocator's cudaMalloc / cudaFree calls and its retries after a failed reservation (each retry
    frees every cached block: a device-wide wait); none off CUDA."""
    if device.type != "cuda":
        return {}
    stats = torch.cuda.memory_stats(device)
    return {key: stats.get(key, 0) for key in ALLOCATOR_COUNTS}


def live_at_peak(events: list[dict]) -> tuple[int, list[dict]]:
    """Replay a caching-allocator trace (`torch.cuda.memory._snapshot()["device_traces"][i]`): the most bytes
    allocated at once by the traced allocations, and the allocations live at that moment. A block counts from its
    `alloc` to its `free_requested`, as `torch.cuda.memory_allocated` counts it."""
    def replay(stop: int | None) -> tuple[int, int, dict[int, dict]]:
        live: dict[int, dict] = {}
        current = peak = peak_at = 0
        for index, event in enumerate(events[:stop]):
            if event["action"] == "alloc":
                live[event["addr"]] = event
                current += event["size"]
                if current > peak:
                    peak, peak_at = current, index
            elif event["action"] == "free_requested" and event["addr"] in live:
                current -= live.pop(event["addr"])["size"]
        return peak, peak_at, live

    peak, peak_at, _ = replay(None)
    return peak, list(replay(peak_at + 1)[2].values()) if events else []


def where_allocated(frames: list[dict], package: str = "clef_engine") -> str:
    """The innermost two frames of `package` in an allocation's Python stack (else its innermost frame)."""
    ours = [frame for frame in frames if package in frame["filename"]] or frames[:1]
    return " < ".join(f"{Path(f['filename']).name}:{f['line']}({f['name']})" for f in ours[:2]) or "?"


def memory_at_peak(device: torch.device, fn: Callable[[], Any], top: int = 20) -> dict:
    """Run `fn` while the caching allocator records a trace; then what was allocated at `fn`'s peak, grouped by
    where it was allocated (GiB, blocks), over what was allocated before it began."""
    torch.cuda.synchronize(device)
    before = torch.cuda.memory_allocated(device)
    entries = 2_000_000
    torch.cuda.memory._record_memory_history(max_entries=entries, stacks="python")
    try:
        fn()
        torch.cuda.synchronize(device)
        events = torch.cuda.memory._snapshot(device)["device_traces"][device.index or 0]
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)
    peak, live = live_at_peak(events)
    groups: dict[str, list[int]] = {}
    for block in live:
        group = groups.setdefault(where_allocated(block.get("frames", [])), [0, 0])
        group[0] += block["size"]
        group[1] += 1
    ranked = sorted(groups.items(), key=lambda kv: -kv[1][0])
    return {"allocated_before_gib": gib(before), "peak_gib": gib(before + peak), "traced_peak_gib": gib(peak),
            "at_peak": [(where, gib(size), blocks) for where, (size, blocks) in ranked[:top]],
            "at_peak_rest_gib": gib(sum(size for _, (size, _) in ranked[top:])),
            "trace_events": len(events), "trace_full": len(events) >= entries}


def percentile(values: list[float], q: float, digits: int = 1) -> float:
    """The value at quantile `q` of `values` (nearest rank)."""
    ordered = sorted(values)
    return round(ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))], digits)


def closed_loop(engine, per_client: list[list[dict]]) -> tuple[list[float], int, float]:
    """One thread per client, each deciding its requests one after another: (every latency in ms, input tokens,
    wall seconds)."""
    latencies: list[float] = []
    tokens = [0]
    lock = threading.Lock()

    def client(mine):
        for request in mine:
            t0 = time.perf_counter()
            response = engine.decide(request)
            with lock:
                latencies.append((time.perf_counter() - t0) * 1000)
                tokens[0] += response["usage"]["input_tokens"]

    wall = in_threads(client, per_client)
    return latencies, tokens[0], wall


def in_threads(target: Callable[[Any], None], args: list) -> float:
    """Run `target(arg)` for every arg, each in a thread of its own, all at once: the wall seconds until the last
    one ends."""
    threads = [threading.Thread(target=target, args=(arg,)) for arg in args]
    t0 = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return time.perf_counter() - t0


def print_summary(results: dict) -> None:
    """The headline numbers (everything but `detail`) and the names of the steps that failed or were skipped."""
    print(json.dumps({k: v for k, v in results.items() if k != "detail"}, indent=1))
    print("errors:", list(results["detail"]["errors"]))


def sections(left: Callable[[], float], save: Callable[[], None], errors: dict,
             keep: Callable[[str, object], object] | None = None, before: Callable[[], None] | None = None):
    """A decorator `section(name, needs_s)` for a bench step: skipped (said in `errors`) when fewer than `needs_s`
    seconds are `left`; an exception is recorded in `errors` and the next step runs; `before()` runs first and
    `keep(name, value)` stores what the step returned (each if given); the results are saved after every step."""
    def section(name: str, needs_s: float = 0.0):
        def wrap(fn):
            @functools.wraps(fn)
            def run(*args, **kwargs):
                if left() < needs_s:
                    errors[name] = f"skipped: {left():.0f} s left, needs ~{needs_s:.0f} s"
                    print(f"[{name}] skipped (time)", flush=True)
                    save()
                    return None
                started = time.perf_counter()
                if before is not None:
                    before()
                try:
                    value = fn(*args, **kwargs)
                    if keep is not None:
                        value = keep(name, value)
                except Exception as error:  # noqa: BLE001 — record and carry on
                    errors[name] = f"{type(error).__name__}: {error}\n{traceback.format_exc()[-3000:]}"
                    print(f"[{name}] ERROR {type(error).__name__}: {error}", flush=True)
                    value = None
                print(f"[{name}] {time.perf_counter() - started:.1f} s", flush=True)
                save()
                return value
            return run
        return wrap
    return section



def category(name: str) -> str:
    n = name.lower()
    if any(s in n for s in ("gemm", "nvjet", "cutlass", "xmma", "sm90_", "cublas")):
        return "gemm"
    if "flash" in n or "fmha" in n or "attention" in n:
        return "attention"
    if any(s in n for s in ("chunk", "solve_tril", "recompute_w_u", "kkt", "l2norm", "cumsum", "delta")):
        return "gdn"
    if "conv" in n:
        return "conv"
    if "layer_norm" in n or "rms" in n or "norm" in n:
        return "norm"
    if "memcpy" in n or "memset" in n or "copy" in n or "cat" in n:
        return "copy"
    return "elementwise/other"


def kernel_table(fn, iterations: int = 3) -> dict:
    """GPU time per iteration of `fn` under torch.profiler: in total, by kernel category and the top 30 kernels; and
    the host's 25 calls with the most self time."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        started = time.perf_counter()
        for _ in range(iterations):
            fn()
        torch.cuda.synchronize()
        wall_ms = (time.perf_counter() - started) * 1000 / iterations
    per_kernel: dict[str, list] = {}
    count = 0
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            entry = per_kernel.setdefault(event.name, [0.0, 0])
            entry[0] += event.time_range.elapsed_us()
            entry[1] += 1
            count += 1
    by_category: dict[str, float] = {}
    for name, (us, _) in per_kernel.items():
        by_category[category(name)] = by_category.get(category(name), 0.0) + us / 1000 / iterations
    top = sorted(per_kernel.items(), key=lambda kv: -kv[1][0])[:30]
    host = sorted((e for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CPU),
                  key=lambda e: -e.self_cpu_time_total)[:25]
    return {"wall_ms_per_iteration": round(wall_ms, 2),  # under the profiler: an upper bound
            "gpu_ms_per_iteration": round(sum(v[0] for v in per_kernel.values()) / 1000 / iterations, 2),
            "kernels_per_iteration": count // iterations,
            "by_category_ms": {k: round(v, 2) for k, v in sorted(by_category.items(), key=lambda kv: -kv[1])},
            "top": [(name[:110], round(us / 1000 / iterations, 3), n // iterations) for name, (us, n) in top],
            # where the host thread's time goes (CUDA runtime and driver calls among them: launches, syncs, copies)
            "host_self_ms": [(e.key[:110], round(e.self_cpu_time_total / 1000 / iterations, 3), e.count // iterations)
                             for e in host]}


def python_profile(fn, top: int = 25) -> list:
    """One call of `fn` under cProfile (this thread only): its `top` functions by own time, as (where, calls, own ms,
    cumulative ms). A host sync shows as own time in the call that waits (`Tensor.cpu`, `synchronize`)."""
    import cProfile
    import pstats

    profiler = cProfile.Profile()
    profiler.runcall(fn)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    stats = pstats.Stats(profiler).stats  # {(file, line, name): (primitive calls, calls, own s, cumulative s, callers)}
    rows = sorted(stats.items(), key=lambda kv: -kv[1][2])[:top]
    return [(f"{Path(file).name}:{line}({name})"[:110], calls, round(own * 1000, 2), round(cumulative * 1000, 2))
            for (file, line, name), (_, calls, own, cumulative, _) in rows]


def store_run(engine, requests: list[dict], schema: dict, db: Path) -> tuple[float, int, dict]:
    """A case set of these requests' states and one run of `schema` through the JobRunner: (seconds, tokens,
    final progress)."""
    from clef_workbench.jobs import JobRunner
    from clef_workbench.store import Store

    store = Store(db)
    set_id = store.create_case_set(f"bench {time.time()}")
    store.add_cases(set_id, [{"state": r["state"]} for r in requests])
    run_id = store.create_run(set_id, schema={"name": "bench", "version": "1", "questions": schema},
                              model_id="clef")
    runner = JobRunner(store)
    t0 = time.perf_counter()
    runner.start(run_id, engine)
    runner.wait(run_id)
    seconds = time.perf_counter() - t0
    tokens = sum(r["input_tokens"] or 0 for r in store.list_results(run_id))
    return seconds, tokens, runner.progress(run_id)


__all__ = ["clef_config", "scale_down", "build_model", "build_head", "random_engine", "write_release",
           "parameter_count", "gib",
           "floor_ms", "math", "WORDS", "schema", "sized_state", "sized_request", "sync", "allocator_counts",
           "percentile", "closed_loop",
           "sections", "kernel_table", "python_profile", "store_run"]
