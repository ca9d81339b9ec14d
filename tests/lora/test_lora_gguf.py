"""A llama.cpp GGUF LoRA file on a GGUF base gives peft's tokens; a wrong one is refused by name.

A tiny Llama and a PEFT adapter of every linear are written as llama.cpp's converters write them
(tests/utils/llama_cpp_convert.py: the base's q/k rows, and the adapter's B rows of q/k, permuted
for interleaved RoPE). Everything is F32, so the GGUF base is the transformers model exactly, and
one engine's greedy tokens under the GGUF adapter, under the same adapter's PEFT folder, and
peft's own on the transformers model are one list.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from minivllm.llm import LLM
from minivllm.lora.errors import LoRAFileError, LoRAShapeError, UnsupportedLoRAError
from minivllm.lora.gguf_loader import load_gguf_adapter
from minivllm.lora.request import LoRARequest
from tests.lora.lora_utils import ATTENTION, MLP, peft_greedy, save_adapter, save_base
from tests.lora.test_lora_engine import greedy, prompts_for
from tests.utils.engine_utils import checked_llm
from tests.utils.llama_cpp_convert import convert, convert_lora, use_own_cache

ALL_LINEARS = dict(r=8, lora_alpha=16, target_modules=ATTENTION + MLP)


def widened(peft: Path, folder: Path, hidden: int) -> Path:
    """The adapter as one of a model `hidden` wide would be: A of q/k/v and gate/up, B of o and
    down, padded with zeros to that width (the other shapes stay: only the shape check sees it)."""
    folder.mkdir()
    shutil.copy(peft / "adapter_config.json", folder)
    tensors = load_file(peft / "adapter_model.safetensors")
    for key, w in tensors.items():
        if ".lora_A." in key and w.shape[1] == 64:
            tensors[key] = torch.cat([w, w.new_zeros(w.shape[0], hidden - 64)], dim=1)
    save_file(tensors, folder / "adapter_model.safetensors")
    return folder


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The HF base and its GGUF, the adapter's PEFT folder and its GGUF, and a wider model's."""
    import transformers

    root = tmp_path_factory.mktemp("lora-gguf")
    base = save_base(root / "base", "llama")
    config = transformers.AutoConfig.from_pretrained(base)
    peft = save_adapter(base, root / "peft", seed=21, **ALL_LINEARS)
    wide_peft = widened(peft, root / "wide-peft", hidden=96)
    return {
        "base": base,
        "base.gguf": convert(config, base, root / "base.gguf", "llama"),
        "peft": peft,
        "adapter.gguf": convert_lora(config, peft, root / "adapter.gguf", "llama"),
        "qwen2-adapter.gguf": convert_lora(config, peft, root / "qwen2.gguf", "qwen2"),
        "wide-adapter.gguf": convert_lora(config, wide_peft, root / "wide.gguf", "llama"),
        "alora-adapter.gguf": convert_lora(
            config,
            peft,
            root / "alora.gguf",
            "llama",
            extra_fields={"adapter.alora.invocation_tokens": [5, 6]},
        ),
    }


@pytest.fixture(scope="module")
def llm(files: dict[str, Path]) -> Any:
    with pytest.MonkeyPatch.context() as monkeypatch:
        use_own_cache(files["base"].parent, monkeypatch)  # the converted base's folder
        with checked_llm(
            model=str(files["base.gguf"]), skip_tokenizer_init=True, max_model_len=64,
            cpu_kv_cache_space=0.01, enable_lora=True, max_loras=2, max_lora_rank=8,
        ) as llm:  # fmt: skip
            yield llm


def test_a_gguf_adapter_on_a_gguf_base_equals_its_peft_folder_and_peft_itself(
    files: dict[str, Path], llm: LLM
) -> None:
    gguf = LoRARequest("gguf", 1, str(files["adapter.gguf"]))
    folder = LoRARequest("folder", 2, str(files["peft"]))
    prompts = prompts_for(3, seed=5)
    expected = peft_greedy(files["base"], folder, prompts, [8, 8, 8])
    (plain,) = peft_greedy(files["base"], None, [prompts[2]], [8])
    assert expected[2] != plain  # the adapter changes the answer
    order: list[LoRARequest | None] = [gguf, folder, gguf, None]
    got = greedy(llm, [*prompts, prompts[2]], [8] * 4, order)
    assert got == [*expected, plain]
    assert greedy(llm, prompts[:2], [8, 8], [folder, gguf]) == expected[:2]


@pytest.mark.parametrize(
    ("adapter", "error", "match"),
    [
        ("qwen2-adapter.gguf", LoRAShapeError, "general.architecture is 'qwen2'"),
        ("wide-adapter.gguf", LoRAShapeError, r"blk\.0\.attn_k\.weight has lora_a \(8, 96\)"),
        ("base.gguf", LoRAFileError, "general.type is None, not 'adapter'"),
        ("alora-adapter.gguf", UnsupportedLoRAError, "adapter.alora.invocation_tokens is set"),
        ("missing.gguf", LoRAFileError, "cannot read GGUF file"),
    ],
)
def test_a_gguf_adapter_of_another_model_or_a_model_file_is_refused_by_name(
    files: dict[str, Path], llm: LLM, adapter: str, error: type[Exception], match: str
) -> None:
    path = files.get(adapter, files["base.gguf"].parent / adapter)
    with pytest.raises(error, match=match):
        llm.llm_engine.add_lora(LoRARequest("bad", 9, str(path)))
    assert len(greedy(llm, [[5, 6, 7]], [3], [None])[0]) == 3  # the engine serves on


def test_a_gguf_adapter_on_a_base_that_is_not_gguf_is_refused(
    files: dict[str, Path], llm: LLM
) -> None:
    manager = llm.llm_engine.runner.lora_manager
    assert manager is not None and manager.base_gguf is not None
    request = LoRARequest("gguf", 1, str(files["adapter.gguf"]))
    with pytest.raises(UnsupportedLoRAError, match="needs a GGUF base model"):
        load_gguf_adapter(request, manager.targets, 8, torch.float32, manager.model_config, None)
    with pytest.raises(UnsupportedLoRAError, match="r=8 is above max_lora_rank=1"):
        load_gguf_adapter(
            request, manager.targets, 1, torch.float32, manager.model_config, manager.base_gguf
        )
