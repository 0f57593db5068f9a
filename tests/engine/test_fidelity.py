"""bench/fidelity.py: the comparison with the float32 truth, checked where the answer is known."""

from __future__ import annotations

import torch

from bench.fidelity import compare, fidelity, paired_flips


def test_compare_counts_distance_flips_and_their_margins():
    truth = [[[0.6, 0.4], [0.2, 0.3, 0.5]], [[0.9, 0.1]]]
    answers = [[[0.45, 0.55], [0.2, 0.3, 0.5]], [[0.88, 0.12]]]
    result = compare(answers, truth)
    assert result["max_dp"] == 0.15
    assert result["flips"] == 1 and result["flip_margins"] == [0.2]  # the truth's top-two gap of the flipped one
    assert result["mean_dp"] == round((0.15 * 2 + 0.02 * 2) / 7, 7)
    assert compare(truth, truth) == {"max_dp": 0.0, "mean_dp": 0.0, "flips": 0, "flip_margins": []}


def test_paired_flips_pairs_the_two_sides_question_by_question():
    """Ours flips a near tie and a wide gap, the release code a near tie elsewhere and the same wide gap: the paired
    counts, the flips on wide gaps only, and a sign test that finds no difference in 1 vs 1 discordant questions."""
    truth = [[[0.505, 0.495], [0.9, 0.1]], [[0.502, 0.498], [0.3, 0.7]]]
    ours = [[[0.49, 0.51], [0.4, 0.6]], [[0.502, 0.498], [0.3, 0.7]]]
    release = [[[0.505, 0.495], [0.45, 0.55]], [[0.497, 0.503], [0.3, 0.7]]]
    result = paired_flips(ours, release, truth, resamples=200)
    assert (result["questions"], result["both"], result["ours_only"], result["release_only"]) == (4, 1, 1, 1)
    assert (result["ours_flips_wide"], result["release_flips_wide"]) == (1, 1)  # the 0.9 / 0.1 question only
    assert result["exact_p"] == 1.0
    low, high = result["difference_95"]
    assert low <= 0 <= high and low >= -2 and high <= 2
    assert [(q["record"], q["question"], q["ours_flips"], q["release_flips"]) for q in result["per_question"]] == [
        (0, 0, True, False), (0, 1, True, True), (1, 0, False, True)]
    lopsided = paired_flips([[[0.0, 1.0]]] * 8, [[[1.0, 0.0]]] * 8, [[[0.9, 0.1]]] * 8, resamples=200)
    assert lopsided["ours_only"] == 8 and lopsided["exact_p"] == round(2 / 2**8, 4)
    assert lopsided["difference_95"] == [8, 8]


def test_float32_everywhere_puts_the_release_path_on_the_truth_and_ours_within_1e5(tiny_release):
    """In float32 the release path is the truth's own computation (distance exactly 0) and ours is the release
    path's math (≤ 1e-5): anything else is a defect of the comparison or of the runs it feeds."""
    result = fidelity("cpu", "tiny", records=3, dtype=torch.float32, tiny_release=tiny_release)
    assert result["records"] == 3 and result["questions"] >= 3 and result["options"] >= 6
    assert result["release_max_dp"] == 0.0 and result["release_flips"] == 0
    assert result["ours_max_dp"] <= 1e-5 and result["ours_flips"] == 0
    assert result["ours_packed_max_dp"] <= 1e-5 and result["ours_packed_flips"] == 0
    for key in ("ours_flip_margins", "release_flip_margins", "ours_mean_dp", "release_mean_dp", "tokens",
                "truth_top2_gap_smallest", "paired"):
        assert key in result


def test_a_kernel_choice_is_measured_against_the_plain_one_with_nothing_left_from_the_default_run():
    """The fidelity run measures ours again with a non-plain kernel choice put back to the plain one (here a float32
    residual projection, which the CPU engine does not choose by itself); the state cache holds nothing of the
    default run when the variant runs, and the engine keeps its own kernels afterwards."""
    import torch.nn.functional as F

    import clef_engine
    from bench.fidelity import _variants
    from clef_engine.fast import kernels

    engine = clef_engine.load(clef_engine.demo_release(), device="cpu", dtype=torch.bfloat16)
    wide = kernels.Kernels(residual_projection=lambda x, weight: F.linear(x.float(), weight.float()))
    engine.runner.backbone.kernels = wide
    records = [engine.encode({"state": "the invoice is late " * n, "questions": {
        "late": {"type": "noul", "instructions": "Is it late?"}}}) for n in (3, 700)]
    default = [engine.runner.forward([r])[0] for r in records]
    assert engine.runner.state_cache.stats()["stored"] == 1  # the long record's state, from the default kernels
    hits = engine.runner.state_cache.stats()["hits"]
    variants = dict(_variants(engine, records))
    assert list(variants) == ["bf16_residual_projection"]
    assert engine.runner.state_cache.stats()["hits"] == hits  # the variant computed its own states
    assert engine.runner.backbone.kernels is wide
    engine.runner.backbone.kernels = kernels.Kernels()
    assert variants["bf16_residual_projection"] == [engine.runner.forward([r])[0] for r in records] != default
