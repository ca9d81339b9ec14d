"""Every adapter minivllm cannot serve is refused when its request is added, with a typed error
naming the field, module, file or shape at fault, and the engine serves on with nothing held."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from minivllm.llm import LLM
from minivllm.lora.errors import (
    LoRAError,
    LoRAFileError,
    LoRAShapeError,
    UnsupportedLoRAError,
)
from minivllm.lora.request import LoRARequest
from minivllm.sampling_params import SamplingParams
from tests.lora.lora_utils import ADAPTERS, ATTENTION, save_adapter, save_base
from tests.utils.engine_utils import assert_no_blocks_held


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("lora-errors")
    base = save_base(root / "base", "llama")
    save_adapter(base, root / "good", seed=1, **ADAPTERS["attn"])
    save_adapter(base, root / "rank16", seed=2, **ADAPTERS["all"])
    return root


@pytest.fixture(scope="module")
def llm(root: Path) -> Iterator[LLM]:
    llm = LLM(
        model=str(root / "base"),
        skip_tokenizer_init=True,
        max_model_len=64,
        cpu_kv_cache_space=0.01,
        attention_backend="reference",
        enable_lora=True,
        max_loras=2,
        max_lora_rank=8,
    )
    yield llm
    assert_no_blocks_held(llm)


def edited(root: Path, name: str, edit: Callable[[Path], None]) -> str:
    """A copy of the good adapter, edited."""
    folder = root / name
    if not folder.exists():
        shutil.copytree(root / "good", folder)
        edit(folder)
    return str(folder)


def set_config(**fields: Any) -> Callable[[Path], None]:
    def edit(folder: Path) -> None:
        path = folder / "adapter_config.json"
        path.write_text(json.dumps(json.loads(path.read_text()) | fields))

    return edit


def truncate(folder: Path) -> None:
    path = folder / "adapter_model.safetensors"
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def other_base_adapter(root: Path, name: str, **shape: Any) -> str:
    folder = root / name
    if not folder.exists():
        base = save_base(root / f"{name}-base", "llama", **shape)
        save_adapter(base, folder, seed=3, **ADAPTERS["attn"])
    return str(folder)


def peft_adapter(root: Path, name: str, **fields: Any) -> str:
    folder = root / name
    if not folder.exists():
        save_adapter(root / "base", folder, seed=4, **fields)
    return str(folder)


BAD: dict[str, tuple[Callable[[Path], str], type[LoRAError], str]] = {
    "modules_to_save": (
        lambda r: edited(r, "mts", set_config(modules_to_save=["lm_head"])),
        UnsupportedLoRAError,
        "modules_to_save=['lm_head'] is not supported",
    ),
    "embedding": (
        lambda r: peft_adapter(r, "emb", r=4, target_modules=["embed_tokens", "q_proj"]),
        UnsupportedLoRAError,
        "target_modules includes 'embed_tokens'",
    ),
    "dora": (
        lambda r: peft_adapter(r, "dora", r=4, target_modules=ATTENTION, use_dora=True),
        UnsupportedLoRAError,
        "use_dora=True (DoRA) is not supported",
    ),
    "rank": (
        lambda r: str(r / "rank16"),
        UnsupportedLoRAError,
        "rank r=16 is above max_lora_rank=8",
    ),
    "missing-target": (
        lambda r: other_base_adapter(r, "deeper", num_hidden_layers=3),
        UnsupportedLoRAError,
        "target module 'model.layers.2.self_attn.k_proj' is not a linear of this model",
    ),
    "shape": (
        lambda r: other_base_adapter(r, "narrower", hidden_size=32),
        LoRAShapeError,
        "model.layers.0.self_attn.k_proj has lora_A (8, 32) and lora_B (16, 8), but this model "
        "needs (8, 64) and (32, 8)",
    ),
    "missing-weights": (
        lambda r: edited(r, "noweights", lambda f: (f / "adapter_model.safetensors").unlink()),
        LoRAFileError,
        "adapter_model.safetensors is missing",
    ),
    "missing-config": (
        lambda r: edited(r, "noconfig", lambda f: (f / "adapter_config.json").unlink()),
        LoRAFileError,
        "adapter_config.json is missing",
    ),
    "truncated": (
        lambda r: edited(r, "truncated", truncate),
        LoRAFileError,
        "adapter_model.safetensors is truncated or corrupt",
    ),
    "not-a-folder": (lambda r: str(r / "nowhere"), LoRAFileError, "is not a folder"),
}


def generate(llm: LLM, lora: LoRARequest | None) -> list[int]:
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    (out,) = llm.generate(
        {"prompt_token_ids": [5, 6, 7, 8]}, params, use_tqdm=False, lora_request=lora
    )
    return list(out.outputs[0].token_ids)


@pytest.mark.parametrize("case", sorted(BAD))
def test_a_bad_adapter_is_refused_by_name_and_the_engine_serves_on(
    llm: LLM, root: Path, case: str
) -> None:
    make, error, message = BAD[case]
    bad = LoRARequest(case, 100 + sorted(BAD).index(case), make(root))
    with pytest.raises(error) as info:
        generate(llm, bad)
    assert message in str(info.value)
    assert bad.lora_int_id not in llm.llm_engine.lora_requests
    assert_no_blocks_held(llm)
    good = LoRARequest("good", 1, str(root / "good"))
    assert len(generate(llm, good)) == 4 and len(generate(llm, None)) == 4
    assert_no_blocks_held(llm)


def test_one_id_for_two_adapters_is_refused(llm: LLM, root: Path) -> None:
    generate(llm, LoRARequest("good", 1, str(root / "good")))
    with pytest.raises(LoRAError, match="lora_int_id 1 is already the adapter 'good'"):
        generate(llm, LoRARequest("other", 1, str(root / "rank16")))


def test_a_lora_request_must_have_a_positive_id_and_a_name() -> None:
    with pytest.raises(ValueError, match="lora_int_id must be >= 1, got 0"):
        LoRARequest("x", 0, "/tmp")
    with pytest.raises(ValueError, match="lora_name must be a non-empty string"):
        LoRARequest("", 1, "/tmp")
