"""The engine end to end on the tiny release: loading, answers, batching, media, validation, the CLI."""

from __future__ import annotations

import base64
import dataclasses
import json
import re
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

import clef_engine
from clef_engine import ReleaseError, RequestError, TokenBudgetError
from clef_engine.protocol import data_url
from clef_engine.scheduler import Scheduler
from tests.support.bodies import REQUEST
from tests.support.media import mp4_bytes, png_bytes


def check_response(response: dict, request: dict) -> None:
    assert set(response["answers"]) == set(request["questions"])
    for question_id, answer in response["answers"].items():
        question = request["questions"][question_id]
        assert answer["type"] == question["type"]
        if answer["type"] == "noul":
            assert 0.0 <= answer["noul"] <= 1.0
        else:
            probabilities = answer["probabilities"]
            assert abs(sum(probabilities.values()) - 1.0) <= 1e-3
            assert answer["confidence"] == max(probabilities.values())
        if answer["type"] == "choice":
            assert list(probabilities) == list(question["criteria"])  # the caller's order
            assert answer["choice"] == max(probabilities, key=probabilities.get)
        if answer["type"] == "score":
            expected = sum(int(k) * p for k, p in probabilities.items())
            assert abs(answer["score"] - expected) <= 1e-3
            assert answer["legend"] == {str(i): d for i, d in enumerate(question["criteria"])}
    assert response["usage"]["input_tokens"] == response["x_token_counts"]["total"]
    assert response["usage"]["output_tokens"] == 0


def test_decide_answers_every_question(tiny_engine):
    response = tiny_engine.decide(dict(REQUEST, model="jev-latest"))
    assert response["model"] == "jev-latest"
    check_response(response, REQUEST)
    assert response["x_truncated_state_tokens"] == 0 and response["x_latency_ms"] > 0


def test_decide_many_equals_one_by_one(tiny_engine):
    requests = [dict(REQUEST, state=f"case {i}: " + "details " * (i * 7)) for i in range(6)]
    requests.append(dict(REQUEST, images=[data_url("image/png", png_bytes(64, 96, seed=5))]))
    batched = tiny_engine.decide_many(requests)
    for request, response in zip(requests, batched):
        single = tiny_engine.decide(request)
        for question_id, answer in response["answers"].items():
            other = single["answers"][question_id]
            for key in ("noul", "score", "confidence"):
                if key in answer:
                    assert abs(answer[key] - other[key]) <= 1e-4
            for option, p in answer.get("probabilities", {}).items():
                assert abs(p - other["probabilities"][option]) <= 1e-4


def test_image_forms_give_the_same_answer(tiny_engine, tmp_path):
    image = png_bytes(64, 64, seed=2)
    path = tmp_path / "evidence.png"
    path.write_bytes(image)
    forms = [data_url("image/png", image), {"content_type": "image/png", "base64": base64.b64encode(image).decode()},
             image, str(path)]
    answers = [tiny_engine.decide(dict(REQUEST, images=[form]))["answers"] for form in forms]
    assert all(a == answers[0] for a in answers)
    without = tiny_engine.decide(REQUEST)["answers"]
    assert answers[0] != without  # the image reaches the model


def test_video_file_is_decoded_at_its_real_fps(tiny_engine, tmp_path):
    video = mp4_bytes(frames=30, fps=15)  # 2 s at 15 fps → 4 frames at 2 fps
    record = tiny_engine.encode(dict(REQUEST, videos=[data_url("video/mp4", video)]))
    assert record.videos[0].fps == pytest.approx(15.0)
    assert record.videos[0].frame_indices == [0, 10, 19, 29]
    assert record.videos[0].frames.shape == (4, 64, 64, 3)
    response = tiny_engine.decide(dict(REQUEST, videos=[data_url("video/mp4", video)]))
    check_response(response, REQUEST)
    assert response["x_token_counts"]["media"] > 0


def test_text_image_and_video_records_in_one_batch(tiny_engine):
    frames = np.random.default_rng(3).integers(0, 256, (8, 32, 32, 3), dtype=np.uint8)
    requests = [REQUEST, dict(REQUEST, images=[png_bytes(32, 64)]), dict(REQUEST, videos=[{"frames": frames,
                                                                                           "fps": 4.0}])]
    responses = tiny_engine.decide_many(requests)
    assert len(responses) == 3
    for response in responses:
        check_response(response, REQUEST)
    assert responses[1]["x_token_counts"]["media"] > 0 and responses[2]["x_token_counts"]["media"] > 0


def test_overflow_policies_through_decide(tiny_engine):
    request = dict(REQUEST, state="lorem ipsum " * 2000)
    with pytest.raises(TokenBudgetError) as caught:
        tiny_engine.decide(request, max_length=2000)
    assert caught.value.part == "state" and caught.value.over_by > 0
    response = tiny_engine.decide(request, max_length=2000, overflow="truncate_state")
    assert response["usage"]["input_tokens"] == 2000
    assert response["x_truncated_state_tokens"] == caught.value.over_by
    counts = tiny_engine.count_tokens(request, max_length=2000)
    assert counts["state_tokens_over"] == caught.value.over_by


def test_max_length_can_be_raised(tiny_engine):
    request = dict(REQUEST, state="lorem ipsum " * 1700)
    assert tiny_engine.count_tokens(request)["total"] > clef_engine.DEFAULT_MAX_LENGTH
    with pytest.raises(TokenBudgetError):
        tiny_engine.decide(request)
    response = tiny_engine.decide(request, max_length=20_000)
    assert response["x_truncated_state_tokens"] == 0


BAD_REQUESTS = [
    ({"questions": {"a": {"type": "noul"}}}, ("state",), "field required"),
    ({"state": "x"}, ("questions",), "field required"),
    ({"state": "x", "questions": {}}, ("questions",), "at least one question"),
    ({"state": "x", "questions": {"": {"type": "noul"}}}, ("questions", ""), "non-empty"),
    ({"state": "x", "questions": {"a": {"type": "choice", "criteria": {}}}},
     ("questions", "a", "criteria"), "at least one option"),
    ({"state": "x", "questions": {"a": {"type": "score", "criteria": []}}},
     ("questions", "a", "criteria"), "at least one level"),
    ({"state": "x", "questions": {"a": {"type": "maybe"}}}, ("questions", "a", "type"), "noul, choice, score"),
    ({"state": "x", "questions": {"a": {"type": "choice", "criteria": ["x", "y"]}}},
     ("questions", "a", "criteria"), "map option id"),
    ({"state": "x", "questions": {"a": {"type": "score", "criteria": {"0": "x"}}}},
     ("questions", "a", "criteria"), "list of level"),
    ({"state": "x", "questions": {"a": {"type": "noul", "criteria": {"maybe": "x"}}}},
     ("questions", "a", "criteria", "maybe"), "'true' or 'false'"),
    ({"state": "x", "questions": {"a": {"type": "noul", "criteria": ["yes", "no"]}}},
     ("questions", "a", "criteria"), "null or a map"),
    ({"state": "x", "questions": {"a": {"type": "noul"}}, "images": ["data:image/gif;base64,R0lG"]},
     ("images", 0), "not accepted"),
    ({"state": "x", "questions": {"a": {"type": "noul"}}, "images": ["data:image/png;base64,!!!"]},
     ("images", 0), "invalid base64"),
    ({"state": "x", "questions": {"a": {"type": "noul"}}, "images": [data_url("image/png", b"not a png")]},
     ("images", 0), "not a readable image"),
    ({"state": "x", "questions": {"a": {"type": "noul"}}, "videos": [data_url("video/mp4", b"garbage")]},
     ("videos", 0), "not a readable video"),
    ({"state": float("nan"), "questions": {"a": {"type": "noul"}}}, ("state",), "NaN"),
    ("not an object", (), "JSON object"),
    ({"state": "bad \ud800 text", "questions": {"a": {"type": "noul"}}}, ("state",), "unpaired surrogates"),
    ({"state": "x", "questions": {"a": {"type": "score", "criteria": ["low", None]}}},
     ("questions", "a", "criteria", 1), "level description"),
]


@pytest.mark.parametrize(("request_body", "loc", "message"), BAD_REQUESTS)
def test_bad_requests_name_the_field(tiny_engine, request_body, loc, message):
    with pytest.raises(RequestError) as caught:
        tiny_engine.decide(request_body)
    problems = caught.value.problems
    assert any(p.loc == loc and message in p.msg for p in problems), problems
    assert all(set(p.as_dict()) == {"loc", "msg", "type"} for p in problems)


def test_every_problem_is_reported_at_once(tiny_engine):
    with pytest.raises(RequestError) as caught:
        tiny_engine.validate({"state": "x", "questions": {"a": {"type": "maybe"}, "": {"type": "noul"}}})
    assert {p.loc for p in caught.value.problems} == {("questions", "a", "type"), ("questions", "")}


def test_engine_keeps_working_after_bad_requests(tiny_engine):
    for body, _, _ in BAD_REQUESTS[:5]:
        with pytest.raises(RequestError):
            tiny_engine.decide(body)
    check_response(tiny_engine.decide(REQUEST), REQUEST)


def test_release_checks_fail_fast_with_clear_messages(tiny_release, tmp_path):
    broken = tmp_path / "broken"
    shutil.copytree(tiny_release, broken)
    (broken / "joint_head.safetensors").unlink()
    with pytest.raises(ReleaseError, match="missing joint_head.safetensors"):
        clef_engine.load(broken, device="cpu")

    wrong_width = tmp_path / "wrong-width"
    shutil.copytree(tiny_release, wrong_width)
    head_config = json.loads((wrong_width / "joint_head_config.json").read_text())
    head_config["hidden_size"] = 128
    (wrong_width / "joint_head_config.json").write_text(json.dumps(head_config))
    with pytest.raises(ReleaseError, match="head hidden_size 128 != backbone hidden_size 64"):
        clef_engine.load(wrong_width, device="cpu")

    wrong_class = tmp_path / "wrong-class"
    shutil.copytree(tiny_release, wrong_class)
    config = json.loads((wrong_class / "config.json").read_text())
    config["architectures"] = ["LlamaForCausalLM"]
    (wrong_class / "config.json").write_text(json.dumps(config))
    with pytest.raises(ReleaseError, match="expected Qwen3_5ForConditionalGeneration"):
        clef_engine.load(wrong_class, device="cpu")

    missing_shard = tmp_path / "missing-shard"
    shutil.copytree(tiny_release, missing_shard)
    next(missing_shard.glob("model-00002-of-*.safetensors")).unlink()
    with pytest.raises(ReleaseError, match="shards that are missing"):
        clef_engine.load(missing_shard, device="cpu")


def test_head_file_that_does_not_match_is_refused(tiny_release, tmp_path):
    from safetensors.torch import load_file, save_file

    changed = tmp_path / "changed-head"
    shutil.copytree(tiny_release, changed)
    state = load_file(changed / "joint_head.safetensors")
    state["extra.weight"] = state["residual_gate"].clone()
    save_file(state, str(changed / "joint_head.safetensors"))
    with pytest.raises(ReleaseError, match="does not match the head"):
        clef_engine.load(changed, device="cpu")


def test_missing_hub_model_says_what_to_download(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_OFFLINE", True)
    with pytest.raises(ReleaseError) as caught:
        clef_engine.load("Cloudflare/clef-flash", revision="17f0b0ad64efb65d273590632833508766b2aae6", device="cpu")
    message = str(caught.value)
    command = re.search(r"`(\S+) download Cloudflare/clef-flash --revision 17f0b0ad\w+`", message)
    assert command and Path(command[1]).name == "hf" and Path(command[1]).is_file()  # a command that exists
    assert str(tmp_path / "hub") in message


def test_hub_repo_in_the_local_cache_loads_offline(tiny_release, monkeypatch, tmp_path):
    """A repo id resolves through huggingface_hub's cache layout (snapshots/<revision>) with no network."""
    cache = tmp_path / "hub"
    revision = "0123456789abcdef0123456789abcdef01234567"
    snapshot = cache / "models--Cloudflare--clef-flash" / "snapshots" / revision
    shutil.copytree(tiny_release, snapshot)
    (cache / "models--Cloudflare--clef-flash" / "refs").mkdir()
    (cache / "models--Cloudflare--clef-flash" / "refs" / "main").write_text(revision)
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_CACHE", str(cache))
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_OFFLINE", True)
    engine = clef_engine.load("Cloudflare/clef-flash", device="cpu")
    try:
        assert engine.info()["model"] == "Cloudflare/clef-flash"
        check_response(engine.decide(REQUEST), REQUEST)
    finally:
        engine.close()


@pytest.mark.slow  # child processes that each import torch
def test_cli_tiny_and_info(tmp_path):
    target = tmp_path / "cli-tiny"
    done = subprocess.run([sys.executable, "-m", "clef_engine", "tiny", str(target), "--seed", "3"],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    info = subprocess.run([sys.executable, "-m", "clef_engine", "info", str(target)], capture_output=True, text=True,
                          timeout=300)
    assert info.returncode == 0, info.stderr
    described = json.loads(info.stdout)
    assert described["architecture"] == "Qwen3_5ForConditionalGeneration"
    assert described["layer_types"] == {"linear_attention": 3, "full_attention": 1}
    assert "flash-linear-attention" in described["fast_kernels_importable"]
    assert described["parameters"]["head"] > 0 and described["parameters"]["vision"] > 0
    expected = {"config.json", "generation_config.json", "model.safetensors.index.json", "joint_head.safetensors",
                "joint_head_config.json", "joint_schema_model.py", "tokenizer.json", "tokenizer_config.json",
                "processor_config.json", "chat_template.jinja", "README.md", "LICENSE"}
    assert expected <= set(described["files"])
    assert len(described["weight_shards"]) >= 2
    missing = subprocess.run([sys.executable, "-m", "clef_engine", "info", str(tmp_path / "nope")],
                             capture_output=True, text=True, timeout=120)
    assert missing.returncode == 2 and "does not exist" in missing.stderr
    onto_a_file = subprocess.run([sys.executable, "-m", "clef_engine", "tiny", str(target / "config.json")],
                                 capture_output=True, text=True, timeout=300)
    assert onto_a_file.returncode == 2 and "Traceback" not in onto_a_file.stderr
    assert f"cannot write the release to {target / 'config.json'}" in onto_a_file.stderr
    bad_port = subprocess.run([sys.executable, "-m", "clef_engine", "serve", "--model", str(target), "--port",
                               "99999"], capture_output=True, text=True, timeout=120)
    assert bad_port.returncode == 2 and "'99999' is not a port (0 to 65535)" in bad_port.stderr


def test_tiny_release_processor_has_both_blocks(tiny_release):
    processor_config = json.loads((tiny_release / "processor_config.json").read_text())
    assert processor_config["image_processor"]["patch_size"] == 16
    assert processor_config["video_processor"]["fps"] == 2
    assert not (tiny_release / "preprocessor_config.json").exists()
    tokenizer = json.loads((tiny_release / "tokenizer.json").read_text())
    added = {t["content"] for t in tokenizer["added_tokens"]}
    assert {"<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>", "<|image_pad|>",
            "<|video_pad|>", "<think>", "</think>"} <= added


def test_scheduler_serves_interactive_before_bulk_and_bounds_the_queue():
    release = threading.Event()
    order: list[str] = []

    def run_batch(records, steps):
        release.wait(5)
        order.extend(records)
        return records

    scheduler = Scheduler(run_batch, token_budget=1, max_queued_records=3)
    first = scheduler.submit(["first"], priority="bulk", tokens=1)
    while scheduler.queue_depth():  # wait until the worker holds "first"
        pass
    bulk = scheduler.submit(["bulk"], priority="bulk", tokens=1)
    cancelled = scheduler.submit(["cancelled"], priority="bulk", tokens=1)
    interactive = scheduler.submit(["interactive"], priority="interactive", tokens=1)
    with pytest.raises(clef_engine.BusyError, match="queue is full"):
        scheduler.submit(["overflow"], priority="bulk", tokens=1)
    assert scheduler.position(interactive) == 0
    assert cancelled.cancel()
    release.set()
    assert interactive.result(5) == ["interactive"] and bulk.result(5) == ["bulk"] and first.result(5) == ["first"]
    assert order == ["first", "interactive", "bulk"]
    scheduler.close()


def test_a_call_runs_alone_on_the_worker_thread_between_batches():
    """`Scheduler.call` runs a function where requests run (state a library keeps per thread is made there), alone in
    its batch, returning what it returns and raising what it raises; the worker keeps serving afterwards."""
    release = threading.Event()
    batches: list[list] = []

    def run_batch(records, steps):
        release.wait(60)
        batches.append([threading.current_thread().name, *records])
        return records

    scheduler = Scheduler(run_batch, token_budget=10, name="gpu-worker-under-test")
    first = scheduler.submit(["a"], tokens=1)
    called = {}

    def on_worker():
        called["thread"] = threading.current_thread().name
        return 42

    caller = threading.Thread(target=lambda: called.setdefault("result", scheduler.call(on_worker)))
    caller.start()
    waited = time.perf_counter()
    while scheduler.queue_depth() < 1 and time.perf_counter() - waited < 60:  # the call queues behind "a"'s batch
        time.sleep(0.001)
    second = scheduler.submit(["b"], tokens=1)
    release.set()
    caller.join(60)
    assert first.result(60) == ["a"] and second.result(60) == ["b"]
    assert called == {"thread": "gpu-worker-under-test", "result": 42}
    assert batches == [["gpu-worker-under-test", "a"], ["gpu-worker-under-test", "b"]]  # "b" not in the call's batch
    assert scheduler.stats.batches == 2  # a call is no batch of records

    def broken():
        raise RuntimeError("no plan")

    with pytest.raises(RuntimeError, match="no plan"):
        scheduler.call(broken)
    assert scheduler.submit(["c"], tokens=1).result(60) == ["c"]
    scheduler.close()


def test_warm_up_builds_cudnns_attention_plans_on_the_thread_that_answers_requests(tiny_engine, monkeypatch):
    """torch keeps cuDNN's attention plans per thread: built on the loading thread, every first long record of a
    new padded length paid for its plan again on the worker (+80-90 ms at 4,339 and 4,440 tokens on the H200). A
    record a little over a prefill chunk ends in a short chunk whose plans were new too (+100-200 ms at 16,414
    and 16,659 tokens on Clef-Flash): the warm-up builds one per padded length of a second chunk."""
    from clef_engine.fast import attention

    built = []
    monkeypatch.setattr(attention, "warm_long_attention",
                        lambda *args: built.append(("long", args[-1], threading.current_thread())))
    monkeypatch.setattr(attention, "warm_chunk_attention",
                        lambda *args: built.append(("chunk", args[-1], threading.current_thread())))
    kernels = tiny_engine.runner.backbone.kernels
    monkeypatch.setattr(kernels, "attention", attention.attention_varlen_cudnn_long)
    monkeypatch.setattr(kernels, "attention_chunk", attention.attention_chunk_cudnn)
    monkeypatch.setattr(tiny_engine.runner, "config", dataclasses.replace(
        tiny_engine.runner.config, prefill_chunk_tokens=4 * attention.CUDNN_LENGTH_STEP))
    monkeypatch.setattr(tiny_engine, "decide", lambda *args, **kwargs: None)  # the rest of the warm-up
    monkeypatch.setattr(tiny_engine, "decide_many", lambda *args, **kwargs: None)
    tiny_engine.warm_up()
    worker = tiny_engine.scheduler._thread
    step = attention.CUDNN_LENGTH_STEP
    # a record's longest chunk is 1,024 + 127 tokens (a last one shorter than an eighth joins it): 1,280 padded
    assert built == [("long", 6 * step, worker), *[("chunk", n * step, worker) for n in (5, 4, 3, 2, 1)]]


def test_concurrent_callers_share_batches(tiny_engine):
    requests = [dict(REQUEST, state=f"caller {i}") for i in range(8)]
    expected = [tiny_engine.decide(r)["answers"] for r in requests]
    before = tiny_engine.scheduler.stats.batches
    results: dict[int, dict] = {}
    barrier = threading.Barrier(8)

    def call(i):
        barrier.wait()
        results[i] = tiny_engine.decide(requests[i])["answers"]

    threads = [threading.Thread(target=call, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert tiny_engine.scheduler.stats.batches - before < 8  # some callers rode in the same batch
    for i in range(8):
        for question_id, answer in results[i].items():
            for key, value in answer.items():
                if isinstance(value, float):
                    assert abs(value - expected[i][question_id][key]) <= 1e-4


@pytest.mark.slow  # loads the release again and warms every bucket up
def test_warm_up_answers_before_any_user_request(tiny_release):
    engine = clef_engine.load(tiny_release, device="cpu")
    try:
        records_before = engine.scheduler.stats.records
        assert engine.warm_up() > 0
        assert engine.scheduler.stats.records == records_before + 7  # alone, a pack of 4, a long state twice
        info = engine.info()
        assert info["warm_up_seconds"] > 0
        assert info["state_cache"]["entries"] == 0 and info["state_cache"]["hits"] == 0  # nothing left behind
    finally:
        engine.close()


def test_plain_path_answers_like_the_packed_default(tiny_release, tiny_engine):
    """packed=False runs the release's own padded call for whole scheduler batches (text and media mixed)."""
    plain = clef_engine.load(tiny_release, device="cpu", packed=False)
    try:
        assert plain.info()["kernels"]["path"] == "forward_plain"
        requests = [REQUEST, dict(REQUEST, state="short"), dict(REQUEST, images=[png_bytes(32, 64)]),
                    dict(REQUEST, state="word " * 300)]
        for ours, theirs in zip(plain.decide_many(requests), tiny_engine.decide_many(requests)):
            for question_id, answer in ours["answers"].items():
                for option, p in answer.get("probabilities", {"true": answer.get("noul")}).items():
                    other = theirs["answers"][question_id]
                    assert abs(p - other.get("probabilities", {"true": other.get("noul")})[option]) <= 1e-4
    finally:
        plain.close()


def test_a_bulk_job_is_split_into_batches_and_an_interactive_request_waits_for_one_at_most():
    """The scheduler is the one place that sizes GPU batches: a bulk job larger than the bulk batch runs in pieces,
    and an interactive job submitted while the first piece runs goes next, before the rest of the bulk job."""
    first_running = threading.Event()
    release = threading.Event()
    batches: list[list[str]] = []

    def run_batch(records, steps):
        batches.append(list(records))
        if len(batches) == 1:
            first_running.set()
            release.wait(5)
        return [r.upper() for r in records]

    scheduler = Scheduler(run_batch, token_budget=100, bulk_batch_tokens=10)
    bulk = scheduler.submit(["aaaa", "bbbb", "cccc", "dddd", "eeee"], priority="bulk")  # 4 tokens each
    assert first_running.wait(5)
    interactive = scheduler.submit(["xx", "yy"], priority="interactive")
    release.set()
    assert bulk.result(5) == ["AAAA", "BBBB", "CCCC", "DDDD", "EEEE"]  # in order, once whole
    assert interactive.result(5) == ["XX", "YY"]
    assert batches == [["aaaa", "bbbb"], ["xx", "yy"], ["cccc", "dddd"], ["eeee"]]
    scheduler.close()


def test_engine_config_reads_every_knob_from_arguments_then_environment_then_defaults():
    from clef_engine import EngineConfig

    env = {"CLEF_TOKEN_BUDGET": "4096", "CLEF_BULK_BATCH_TOKENS": "1_024", "CLEF_STATE_CACHE_BYTES": "0",
           "CLEF_CUDA_GRAPHS": "1", "CLEF_DTYPE": "bf16"}
    config = EngineConfig.resolve(device="cpu", env=env)
    assert (config.token_budget, config.bulk_batch_tokens, config.state_cache_bytes) == (4096, 1024, 0)
    assert str(config.dtype) == "torch.bfloat16"
    assert not config.cuda_graphs and not config.warm_up  # CUDA-only features stay off on the CPU
    assert EngineConfig.resolve(device="cpu", env=env, token_budget=512).bulk_batch_tokens == 512  # never above
    assert EngineConfig.resolve(device="cpu", dtype="float32", env=env).dtype.is_floating_point
    with pytest.raises(ReleaseError, match="CLEF_TOKEN_BUDGET='lots'"):
        EngineConfig.resolve(device="cpu", env={"CLEF_TOKEN_BUDGET": "lots"})
    with pytest.raises(ReleaseError, match="CLEF_CUDA_GRAPHS='maybe'"):
        EngineConfig.resolve(device="cpu", env={"CLEF_CUDA_GRAPHS": "maybe"})
    with pytest.raises(TypeError, match="tokens_budget"):
        EngineConfig.resolve(device="cpu", env={}, tokens_budget=1)
    with pytest.raises(ReleaseError, match="unknown device 'tpu'; use cpu, cuda or cuda:N"):  # serve: exit 2
        EngineConfig.resolve(device="tpu", env={})


def test_load_takes_its_config_from_the_environment(tiny_release, monkeypatch):
    monkeypatch.setenv("CLEF_STATE_CACHE_BYTES", "0")
    monkeypatch.setenv("CLEF_TOKEN_BUDGET", "3000")
    engine = clef_engine.load(tiny_release, device="cpu")
    try:
        assert engine.config.token_budget == engine.scheduler.token_budget == 3000
        assert engine.info()["state_cache"]["enabled"] is False
        check_response(engine.decide(REQUEST), REQUEST)
    finally:
        engine.close()


def test_interactive_work_runs_between_the_steps_of_a_bulk_batch():
    """A long bulk batch lets interactive requests that arrive meanwhile run between its steps (the engine calls
    steps.let_interactive_in() between layers): the interactive answer comes before the bulk batch ends."""
    submitted = threading.Event()
    order: list[str] = []
    scheduler: Scheduler

    def run_batch(records, steps):
        if records[0].startswith("bulk"):
            order.append("bulk starts")
            assert submitted.wait(5)
            steps.let_interactive_in()  # a step boundary of the bulk batch
            order.append("bulk ends")
        else:
            order.append("interactive")
        return records

    scheduler = Scheduler(run_batch, token_budget=100)
    bulk = scheduler.submit(["bulk"], priority="bulk")
    while scheduler.queue_depth():  # the bulk batch is on the worker
        pass
    interactive = scheduler.submit(["now"], priority="interactive")
    submitted.set()
    assert interactive.result(5) == ["now"] and bulk.result(5) == ["bulk"]
    assert order == ["bulk starts", "interactive", "bulk ends"]
    scheduler.close()


def test_a_decide_during_a_bulk_batch_gets_the_answer_it_gets_alone(tiny_engine):
    """The engine's between-layer hook on the real path: interactive requests answered inside a running bulk batch
    get the same answers as alone, and the bulk batch's answers do not change either."""
    bulk_requests = [dict(REQUEST, state=f"bulk ticket {i} " * 200) for i in range(6)]
    alone = tiny_engine.decide(dict(REQUEST, state="interactive"))["answers"]
    bulk_alone = [r["answers"] for r in tiny_engine.decide_many(bulk_requests)]
    ran_inside: list[bool] = []
    original = tiny_engine.scheduler.run_waiting_interactive

    def recording():
        ran_inside.append(tiny_engine.scheduler.interactive_waiting())
        original()

    tiny_engine.scheduler.run_waiting_interactive = recording
    try:
        future = tiny_engine.submit(bulk_requests, priority="bulk")
        answers = [tiny_engine.decide(dict(REQUEST, state="interactive"))["answers"] for _ in range(3)]
        bulk_answers = [r["answers"] for r in future.result(120)]
    finally:
        del tiny_engine.scheduler.run_waiting_interactive
    for got in answers:
        for question_id, answer in got.items():
            for key, value in answer.items():
                if isinstance(value, float):
                    assert abs(value - alone[question_id][key]) <= 1e-4
    for got, want in zip(bulk_answers, bulk_alone):
        assert json.dumps(got, sort_keys=True) == json.dumps(want, sort_keys=True)
    assert any(ran_inside)  # at least one decide ran inside the bulk batch


def test_a_release_says_whether_its_weights_are_random(tiny_release, tiny_engine, tmp_path):
    """Issue 23 point 3: the tiny builder marks its config.json, the loader reads the mark, and info() reports it,
    so a tiny release loaded by path is flagged like the demo; a release without the mark is not."""
    from clef_engine.model import release

    assert json.loads((tiny_release / "config.json").read_text())["random_weights"] is True
    assert release.check(tiny_release).random_weights and tiny_engine.info()["random_weights"] is True
    trained = tmp_path / "trained"
    shutil.copytree(tiny_release, trained)
    config = json.loads((trained / "config.json").read_text())
    del config["random_weights"]
    (trained / "config.json").write_text(json.dumps(config))
    assert not release.check(trained).random_weights


def test_a_failing_record_of_a_per_record_job_gets_its_own_error_and_the_others_their_answers():
    """The scheduler is the one place that isolates a record a batch fails on: a per-record job is halved until the
    failing record is alone; a job that is not per record fails whole."""
    batches: list[list[str]] = []

    def run_batch(records, steps):
        batches.append(list(records))
        if "bad" in records:
            raise RuntimeError("cannot run 'bad'")
        return [r.upper() for r in records]

    scheduler = Scheduler(run_batch, token_budget=100)
    records = ["a", "b", "c", "bad", "d", "e"]
    outcomes = scheduler.submit(records, priority="bulk", tokens=6, per_record=True).result(5)
    assert outcomes[:3] == ["A", "B", "C"] and outcomes[4:] == ["D", "E"]
    assert isinstance(outcomes[3], RuntimeError) and "'bad'" in str(outcomes[3])
    assert batches[0] == records and ["a", "b", "c"] in batches and ["bad"] in batches
    with pytest.raises(RuntimeError, match="'bad'"):
        scheduler.submit(records, priority="bulk", tokens=6).result(5)
    scheduler.close()


def test_decide_many_can_return_an_error_per_request(tiny_engine):
    good = {"state": "a short ticket", "questions": {"q": {"type": "noul", "instructions": "Urgent?"}}}
    too_long = dict(good, state="word " * 400)
    invalid = dict(good, questions={"q": {"type": "maybe"}})
    outcomes = tiny_engine.decide_many([good, too_long, invalid, good], max_length=400, errors="return")
    assert isinstance(outcomes[1], clef_engine.TokenBudgetError) and isinstance(outcomes[2], clef_engine.RequestError)
    assert outcomes[0]["answers"] == outcomes[3]["answers"] == tiny_engine.decide(good)["answers"]
    with pytest.raises(clef_engine.TokenBudgetError):
        tiny_engine.decide_many([good, too_long], max_length=400)
