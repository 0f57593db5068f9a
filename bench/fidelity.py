"""How close our bf16 answers are to the exact answer, next to how close the release code's own bf16 answers are
(issue 12: ours must be at least as close as the release code's).

    python bench/fidelity.py [--device cuda] [--shape flash] [--records 55] [--out FILE]
    python bench/fidelity.py --device cpu --shape small --records 12      (scaled down, runs on a laptop CPU)

One model with random, never-zero weights (bench/build.py) is built once; a float32 copy of it is the truth. On the
same varied records (lengths, question types and option counts all drawn at random) it runs:
- truth: the release code's path (`reference_decide`: padded text model + per-option loop head) in float32, with
  TF32 off so that float32 really is float32;
- release: the same path in bf16, in padded batches of 8 as the release code batches;
- ours: `engine.runner.forward` in bf16, one record at a time (what `decide` runs) and all records at once (packed).
Each is compared with the truth: max and mean |Δp| over every option, and the argmax flips with the truth's top-two
gap of each flipped question (a flip on a near tie is rounding; a flip on a wide gap is a defect).
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import random
import sys
import time
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.build import SIZES, build_head, build_model, clef_config  # noqa: E402

# Scaled-down shapes keep Clef-Flash's structure ((3 GDN + 1 attention) blocks, GQA, head dim 256, partial RoPE)
# with fewer layers and a narrower width, the tiny tokenizer's vocabulary and the tiny vision tower, so they run on a
# CPU. `state_tokens`: the range a record's state is drawn from (its schema adds a few hundred tokens more).
SHAPES = {
    "flash": dict(SIZES["clef-flash"], head_width=1024, vocab=None, state_tokens=(100, 3000)),
    "small": dict(hidden=512, ffn=1536, layers=8, heads=4, kv_heads=2, gdn_k=4, gdn_v=8, vision_out=512,
                  head_width=256, vocab="tiny", state_tokens=(50, 400)),
    "tiny": dict(hidden=128, ffn=256, layers=4, heads=2, kv_heads=1, gdn_k=2, gdn_v=4, vision_out=128,
                 head_width=64, vocab="tiny", state_tokens=(10, 60)),
}
WORDS = ("the invoice ticket customer payment refund amount total due date vendor alert security login password "
         "damage claim photo car vehicle image video order status approved rejected billing shipping delivery "
         "late early broken missing duplicate urgent minor major").split()


def shape_config(shape: str, tiny_release: Path) -> dict:
    """config.json of a Clef-Flash-structured model of `shape` (see SHAPES)."""
    sizes = SHAPES[shape]
    config = clef_config("clef-flash", tiny_release)
    text = config["text_config"]
    text.update(hidden_size=sizes["hidden"], intermediate_size=sizes["ffn"], num_hidden_layers=sizes["layers"],
                layer_types=(["linear_attention"] * 3 + ["full_attention"]) * (sizes["layers"] // 4),
                num_attention_heads=sizes["heads"], num_key_value_heads=sizes["kv_heads"],
                linear_num_key_heads=sizes["gdn_k"], linear_num_value_heads=sizes["gdn_v"])
    if sizes["vocab"] == "tiny":
        tiny = json.loads((tiny_release / "config.json").read_text())
        text["vocab_size"] = tiny["text_config"]["vocab_size"]
        config["vision_config"] = tiny["vision_config"]
    config["vision_config"]["out_hidden_size"] = sizes["vision_out"]
    return config


def varied_request(rng: random.Random, state_tokens: int) -> dict:
    """A request with a state of roughly `state_tokens` tokens, then 1-8 questions of every type."""
    questions = {}
    for j in range(rng.randint(1, 8)):
        kind = rng.choice(["noul", "choice", "score"])
        instruction = f"Is the {rng.choice(WORDS)} {rng.choice(WORDS)} {rng.choice(WORDS)}?"
        if kind == "noul":
            questions[f"q{j}"] = {"type": "noul", "instructions": instruction}
        elif kind == "choice":
            options = rng.sample(WORDS, rng.randint(2, 10))
            questions[f"q{j}"] = {"type": "choice", "instructions": instruction,
                                  "criteria": {o: f"the {rng.choice(WORDS)} is {o}" for o in options}}
        else:
            questions[f"q{j}"] = {"type": "score", "instructions": instruction,
                                  "criteria": [f"{rng.choice(WORDS)} level {k}" for k in range(rng.randint(2, 6))]}
    state = " ".join(rng.choice(WORDS) for _ in range(max(1, state_tokens * 2 // 3)))
    return {"model": "clef-flash", "state": state, "questions": questions}


def compare(answers: list, truth: list) -> dict:
    """Distance of `answers` from `truth` (both [record][question][option] probabilities)."""
    worst, total, options, flips, margins = 0.0, 0.0, 0, 0, []
    for record_answers, record_truth in zip(answers, truth, strict=True):
        for got, want in zip(record_answers, record_truth, strict=True):
            gaps = [abs(a - b) for a, b in zip(got, want, strict=True)]
            worst, total, options = max(worst, *gaps), total + sum(gaps), options + len(gaps)
            if max(range(len(got)), key=got.__getitem__) != max(range(len(want)), key=want.__getitem__):
                top = sorted(want, reverse=True)
                flips += 1
                margins.append(round(top[0] - top[1], 4))
    return {"max_dp": round(worst, 6), "mean_dp": round(total / max(options, 1), 7), "flips": flips,
            "flip_margins": sorted(margins)}


def _argmax(values: list[float]) -> int:
    return max(range(len(values)), key=values.__getitem__)


def paired_flips(ours: list, release: list, truth: list, *, margin: float = 0.01, resamples: int = 2000,
                 seed: int = 0) -> dict:
    """Ours' and the release code's argmax flips against the truth, question by question on the same questions, so
    that a difference in flip counts can be read against its noise:
    - `*_flips_wide`: flips on questions whose truth top-two gap is over `margin` (a flip on a near tie is rounding);
    - `both`, `ours_only`, `release_only`: the paired counts; `exact_p`: the two-sided sign test on the discordant
      questions (ours_only vs release_only; 1.0 = no evidence that either flips more often);
    - `difference_95`: the 2.5% and 97.5% quantiles of (ours - release) flips over `resamples` bootstrap resamples
      of the records (a record's questions move together: they share one forward pass);
    - `per_question`: every question either side flips: record, question, truth gap, who flips."""
    rows = []  # (record, question, truth gap, ours flips, release flips)
    for r, (record_ours, record_release, record_truth) in enumerate(zip(ours, release, truth, strict=True)):
        for q, (got, theirs, want) in enumerate(zip(record_ours, record_release, record_truth, strict=True)):
            top = sorted(want, reverse=True) + [0.0]
            rows.append((r, q, round(top[0] - top[1], 4), _argmax(got) != _argmax(want),
                         _argmax(theirs) != _argmax(want)))
    ours_only = sum(o and not t for *_, o, t in rows)
    release_only = sum(t and not o for *_, o, t in rows)
    discordant = ours_only + release_only
    tail = sum(math.comb(discordant, k) for k in range(min(ours_only, release_only) + 1)) / 2**discordant
    per_record = [0] * len(truth)  # ours - release flips of each record
    for r, _, _, o, t in rows:
        per_record[r] += int(o) - int(t)
    rng = random.Random(seed)
    differences = sorted(sum(rng.choice(per_record) for _ in per_record) for _ in range(resamples))
    return {"questions": len(rows), "margin": margin,
            "ours_flips_wide": sum(o for _, _, gap, o, _ in rows if gap > margin),
            "release_flips_wide": sum(t for _, _, gap, _, t in rows if gap > margin),
            "both": sum(o and t for *_, o, t in rows), "ours_only": ours_only, "release_only": release_only,
            "exact_p": round(min(1.0, 2 * tail), 4),
            "difference_95": [differences[int(0.025 * (resamples - 1))], differences[int(0.975 * (resamples - 1))]],
            "per_question": [{"record": r, "question": q, "truth_gap": gap, "ours_flips": o, "release_flips": t}
                             for r, q, gap, o, t in rows if o or t]}


def top_two_gaps(truth: list) -> list[float]:
    return sorted(round(q[0] - q[1], 4) for record in truth for q in (sorted(p, reverse=True) for p in record)
                  if len(q) > 1)


class _NoTF32:
    """TF32 off for float32 matmuls and cuDNN convolutions while the truth runs (cuDNN allows TF32 by default)."""

    def __enter__(self):
        self.saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False

    def __exit__(self, *exc):
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = self.saved


def release_path(model, head, encoder, dtype: torch.dtype, records: list, batch: int = 8) -> list:
    """The release code's answers: padded batches of `batch` records through the text model, then the loop head."""
    from clef_engine.model.reference import reference_decide

    runner = SimpleNamespace(model=model, head=head, pad_token_id=encoder.pad_token_id, dtype=dtype,
                             output_embeddings=model.lm_head.weight)
    out = []
    for start in range(0, len(records), batch):
        out += reference_decide(runner, records[start: start + batch])
    return out


def _variants(engine, encoded: list):
    """Ours again, one record at a time, with one of the engine's kernel choices put back to the plain one, where the
    engine chose otherwise: what that choice does to the distance (`PackedRunner.use_kernels` empties the prefill graphs
    and the state cache, which hold the default kernels' work, on the way in and out)."""
    from clef_engine.fast import kernels as K

    swaps = {"bf16_residual_projection": {"residual_projection": K.residual_projection_torch}}
    default = engine.runner.backbone.kernels
    for name, slots in swaps.items():
        if all(getattr(default, slot) is fn for slot, fn in slots.items()):
            continue
        engine.runner.use_kernels(replace(default, **slots))
        try:
            yield name, [engine.runner.forward([r])[0] for r in encoded]
        finally:
            engine.runner.use_kernels(default)


def fidelity(device: str | torch.device = "cuda", shape: str = "flash", records: int = 55, *, seed: int = 0,
             dtype: torch.dtype = torch.bfloat16, tiny_release: Path | None = None) -> dict:
    """Distances of our `dtype` answers and the release code's `dtype` answers from the release code in float32.

    With dtype=float32 the release path is the truth itself (distance exactly 0) and ours must be within 1e-5:
    the check of this comparison. Keys: ours_max_dp, ours_flips, ours_flip_margins (the truth's top-two gap of each
    flipped question), ours_mean_dp, the same for release_ and ours_packed_ (all records in one packed batch),
    questions, options, records, tokens, `paired` (`paired_flips`: ours' flips next to the release code's on the
    same questions, with the noise of their difference), and what ran."""
    import clef_engine
    from clef_engine.model.encoding import Encoder
    from clef_engine.model.release import Release, load_processor
    from clef_engine.protocol import prepare
    from clef_engine.tiny import build_tiny_release

    started = time.perf_counter()
    device = torch.device(device)
    if tiny_release is None:
        import tempfile

        tiny_release = build_tiny_release(Path(tempfile.mkdtemp(prefix="fidelity-tiny-")), seed=0)
    config = shape_config(shape, tiny_release)
    sizes = SHAPES[shape]
    model = build_model(config, device=str(device), seed=seed)
    head, head_config = build_head(sizes["hidden"], device=str(device), seed=seed + 1, width=sizes["head_width"])
    truth_model, truth_head = copy.deepcopy(model).float(), copy.deepcopy(head).float()
    if dtype != torch.bfloat16:
        model, head = model.to(dtype), head.to(dtype)
    checked = Release(path=tiny_release, source=f"{shape}-shaped-random", revision=None, config=config,
                      head_config=head_config, weight_files=())
    encoder = Encoder(load_processor(checked))

    rng = random.Random(seed)
    low, high = sizes["state_tokens"]
    requests = [varied_request(rng, rng.randint(low, high)) for _ in range(records)]
    encoded = [encoder.encode(prepare(r, max_length=2**31 - 1)) for r in requests]

    with _NoTF32():  # bf16 paths never use TF32; float32 ones (the truth, and all three with dtype=float32) must not
        truth = release_path(truth_model, truth_head, encoder, torch.float32, encoded)
        del truth_model, truth_head
        release = release_path(model, head, encoder, dtype, encoded)
        # fuses in place; the fast kernels chosen now (no background warm-up)
        engine = clef_engine.Engine(checked, model, head, encoder, device, dtype, packed=True, warm_up=False)
        try:
            with torch.inference_mode():
                ours = [engine.runner.forward([r])[0] for r in encoded]
                packed = engine.runner.forward(encoded)
                variants = {name: answers for name, answers in _variants(engine, encoded)}
            kernels = engine.runner.backbone.kernels.describe()
        finally:
            engine.close()

    out: dict = {"shape": shape, "device": str(device), "dtype": str(dtype).removeprefix("torch."),
                 "records": records, "questions": sum(len(r.questions) for r in encoded),
                 "options": sum(len(s) for r in encoded for s in r.option_spans),
                 "tokens": {"min": min(map(len, encoded)), "max": max(map(len, encoded)),
                            "mean": round(sum(map(len, encoded)) / records)}}
    for name, answers in (("ours", ours), ("release", release), ("ours_packed", packed)):
        for key, value in compare(answers, truth).items():
            out[f"{name}_{key}"] = value
    out["paired"] = paired_flips(ours, release, truth, seed=seed)
    out["variants"] = {}
    for name, answers in variants.items():
        out["variants"][name] = compare(answers, truth)
        out["variants"][name]["paired"] = {key: value for key, value in paired_flips(answers, release, truth,
                                                                                     seed=seed).items()
                                           if key != "per_question"}
    out["truth_top2_gap_smallest"] = top_two_gaps(truth)[:10]
    out["kernels"] = kernels
    out["seconds"] = round(time.perf_counter() - started, 1)
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--shape", default="flash", choices=sorted(SHAPES))
    parser.add_argument("--records", type=int, default=55)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    result = fidelity(args.device, args.shape, args.records, seed=args.seed)
    text = json.dumps(result, indent=1)
    if args.out:
        args.out.write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
