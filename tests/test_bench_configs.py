"""The benchmark builds the published architectures: parameter counts equal the spec's, to the parameter."""

from __future__ import annotations

import pytest
import torch

from bench.build import clef_config


@pytest.mark.parametrize(("name", "parameters"), [("clef", 27_356_728_560), ("clef-flash", 9_409_813_744)])
def test_benchmark_architecture_matches_the_release(tiny_release, name, parameters):
    from transformers import Qwen3_5Config, Qwen3_5ForConditionalGeneration

    with torch.device("meta"):
        model = Qwen3_5ForConditionalGeneration(Qwen3_5Config(**clef_config(name, tiny_release)))
    assert sum(p.numel() for p in model.parameters()) == parameters
    assert not model.config.tie_word_embeddings
