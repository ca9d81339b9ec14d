"""The network arithmetic of tensor, pipeline and data parallelism (minivllm/experiments/
parallel_network.py): its bytes agree with the pipeline section's SmolLM2 table, which counts the
tensors the engine sends, and the distributed page prints the module's own table."""

from __future__ import annotations

from pathlib import Path

from minivllm.experiments.parallel_network import (
    GPUS,
    MODELS,
    DenseModel,
    bytes_per_token,
    step_time_s,
    table,
)

PAGE = Path(__file__).resolve().parents[2] / "docs" / "distributed.md"
SMOLLM2 = DenseModel("SmolLM2-135M", 30, 576, 1.35e8, "HuggingFaceTB/SmolLM2-135M config.json")


def test_bytes_per_token_are_the_pipeline_sections_in_float32() -> None:
    assert bytes_per_token(SMOLLM2, "TP 2", dtype_bytes=4) == 140_544
    assert bytes_per_token(SMOLLM2, "PP 2", dtype_bytes=4) == 4_608
    assert bytes_per_token(SMOLLM2, "DP 2") == 0


def test_the_network_ranks_the_layouts_as_the_page_says() -> None:
    gpu = GPUS["h200"]
    for model in MODELS:
        for link in (1, 10, 25):
            tp, pp = (step_time_s(model, layout, 32, link, gpu) for layout in ("TP 2", "PP 2"))
            assert pp < tp  # a pipeline's one message beats 2·layers + 1 all-reduces
    # a faster link always helps tensor parallelism more than the pipeline
    seven_b = MODELS[0]
    tp_gain = step_time_s(seven_b, "TP 2", 32, 1, gpu) - step_time_s(seven_b, "TP 2", 32, 25, gpu)
    pp_gain = step_time_s(seven_b, "PP 2", 32, 1, gpu) - step_time_s(seven_b, "PP 2", 32, 25, gpu)
    assert tp_gain > pp_gain > 0


def test_the_distributed_page_prints_the_modules_table() -> None:
    assert table() in PAGE.read_text()
