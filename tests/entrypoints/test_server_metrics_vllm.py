"""/metrics as vLLM's own server tests read it (tests/entrypoints/openai/test_metrics.py at vLLM
505805b6): the cache-config info with every label vLLM gives it, the deprecated series shown only
behind --show-hidden-metrics-for-version, and the token counters equal to what a request used."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from minivllm.engine.arg_utils import EngineArgs
from minivllm.engine.llm_engine import LLMEngine
from tests.utils.engine_utils import save_tiny_llama
from tests.utils.server_utils import InProcessServer, serve_in_process

# vLLM's CacheConfig.metrics_info() labels that its test asserts (EXPECTED_METRICS)
CACHE_CONFIG_LABELS = (
    "block_size", "cache_dtype", "cpu_offload_gb", "enable_prefix_caching",
    "gpu_memory_utilization", "num_cpu_blocks", "num_gpu_blocks", "num_gpu_blocks_override",
    "sliding_window", "swap_space_bytes",
)  # fmt: skip
HIDDEN = ("vllm:gpu_cache_usage_perc", "vllm:gpu_prefix_cache_queries")


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))


def serve(tiny_model: Path, **app_kwargs: object) -> Iterator[InProcessServer]:
    config = EngineArgs(
        model=str(tiny_model), max_model_len=256, block_size=4, num_gpu_blocks_override=64
    ).create_engine_config()
    with serve_in_process(LLMEngine(config), **app_kwargs) as s:
        yield s


def metrics_text(server: InProcessServer) -> str:
    return httpx.get(server.url + "/metrics", timeout=10).text


def sample(text: str, name: str) -> float:
    """The value of the one sample called `name` (labels ignored)."""
    values = [
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.split("{", 1)[0].split(" ", 1)[0] == name
    ]
    assert len(values) == 1, (name, values)
    return values[0]


def test_cache_config_info_carries_vllms_labels_and_hidden_series_stay_hidden(
    tiny_model: Path,
) -> None:
    for server in serve(tiny_model):
        text = metrics_text(server)
        info = next(line for line in text.splitlines() if line.startswith("vllm:cache_config_info"))
        for label in CACHE_CONFIG_LABELS:
            assert f'{label}="' in info, label
        assert 'num_gpu_blocks_override="64"' in info and 'block_size="4"' in info
        assert not any(name in text for name in HIDDEN)


def test_hidden_metrics_flag_shows_the_deprecated_names_with_the_current_values(
    tiny_model: Path,
) -> None:
    for server in serve(tiny_model, show_hidden_metrics=True):
        body = {"prompt": "Hello my name is", "max_tokens": 3, "ignore_eos": True}
        assert httpx.post(server.base_url + "/completions", json=body, timeout=60).is_success
        server.wait_idle()
        text = metrics_text(server)
        assert sample(text, "vllm:gpu_cache_usage_perc") == sample(text, "vllm:kv_cache_usage_perc")
        assert sample(text, "vllm:gpu_prefix_cache_queries_total") == sample(
            text, "vllm:prefix_cache_queries_total"
        )
        assert sample(text, "vllm:gpu_prefix_cache_queries_total") > 0


def test_token_counters_equal_what_the_requests_used(tiny_model: Path) -> None:
    for server in serve(tiny_model):
        prompt = [1, 2, 3, 4, 5, 6, 7]
        for _ in range(3):
            body = {"prompt": prompt, "max_tokens": 4, "ignore_eos": True}
            assert httpx.post(server.base_url + "/completions", json=body, timeout=60).is_success
        server.wait_idle()
        text = metrics_text(server)
        assert sample(text, "vllm:prompt_tokens_total") == 3 * len(prompt)
        assert sample(text, "vllm:generation_tokens_total") == 3 * 4
        assert sample(text, "vllm:request_generation_tokens_sum") == 3 * 4
        assert sample(text, "vllm:request_prompt_tokens_sum") == 3 * len(prompt)


def test_v0_s_name_for_kv_cache_usage_is_shown_under_vllm_use_v1_0(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from minivllm.entrypoints.metrics import show_hidden_metrics

    monkeypatch.delenv("VLLM_USE_V1", raising=False)
    assert not show_hidden_metrics(None) and show_hidden_metrics("0.10")
    monkeypatch.setenv("VLLM_USE_V1", "1")
    assert not show_hidden_metrics(None)
    monkeypatch.setenv("VLLM_USE_V1", "0")  # vLLM's tests of its V0 engine read the old gauge
    assert show_hidden_metrics(None)


def test_metrics_read_right_after_a_response_count_its_last_step(tiny_model: Path) -> None:
    """vLLM's test_metrics_counts reads /metrics as soon as its last response arrives: the step's
    stats are recorded before its outputs reach the request (no wait_idle here)."""
    for server in serve(tiny_model):
        for i in range(1, 6):
            prompt = [10 * i + t for t in range(5)]  # no prefix-cache hit between them
            body = {"prompt": prompt, "max_tokens": 3, "ignore_eos": True}
            assert httpx.post(server.base_url + "/completions", json=body, timeout=60).is_success
            text = metrics_text(server)
            assert sample(text, "vllm:iteration_tokens_total_sum") == i * (len(prompt) + 3)
            assert sample(text, "vllm:generation_tokens_total") == i * 3
