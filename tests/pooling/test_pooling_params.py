"""`PoolingParams` and the model's `PoolerConfig`: validated fields, errors that name them, and
the pooler read from sentence-transformers' files (minivllm/pooling/)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from minivllm.pooling.config import PoolerConfig, resolve_pooler_config, resolve_runner
from minivllm.pooling.pooler import finish_embedding, pool
from minivllm.pooling.pooling_params import PoolingParams
from minivllm.sampling_params import InvalidParamError


@pytest.mark.parametrize(
    ("kwargs", "param"),
    [
        ({"dimensions": 0}, "dimensions"),
        ({"dimensions": True}, "dimensions"),
        ({"dimensions": "8"}, "dimensions"),
        ({"normalize": 1}, "normalize"),
        ({"truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
        ({"task": "generate"}, "task"),
    ],
)
def test_invalid_pooling_params_name_their_field(kwargs: dict[str, object], param: str) -> None:
    with pytest.raises(InvalidParamError, match=param) as err:
        PoolingParams(**kwargs)  # type: ignore[arg-type]
    assert err.value.param == param


def test_pool_takes_the_last_the_mean_or_the_first_row() -> None:
    hidden = torch.arange(12, dtype=torch.float32).view(3, 4)
    assert pool(hidden, "LAST").tolist() == [8, 9, 10, 11]
    assert pool(hidden, "MEAN").tolist() == [4, 5, 6, 7]
    assert pool(hidden, "CLS").tolist() == [0, 1, 2, 3]


def test_finish_embedding_truncates_then_normalizes() -> None:
    config = PoolerConfig("LAST", normalize=True, task="embed", hidden_size=4, is_matryoshka=True)
    vec = torch.tensor([3.0, 4.0, 100.0, 100.0])
    cut = finish_embedding(vec, PoolingParams(dimensions=2), config)
    torch.testing.assert_close(cut, torch.tensor([0.6, 0.8]))
    raw = finish_embedding(vec, PoolingParams(normalize=False), config)
    assert raw.tolist() == vec.tolist()


def write(path: Path, name: str, value: object) -> None:
    (path / name).parent.mkdir(parents=True, exist_ok=True)
    (path / name).write_text(json.dumps(value))


def st_folder(tmp_path: Path, pooling: dict[str, object], normalize: bool) -> Path:
    modules = [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {
            "idx": 1,
            "name": "1",
            "path": "1_Pooling",
            "type": "sentence_transformers.models.Pooling",
        },
    ]
    if normalize:
        modules.append(
            {
                "idx": 2,
                "name": "2",
                "path": "2_Normalize",
                "type": "sentence_transformers.models.Normalize",
            }
        )
    write(tmp_path, "modules.json", modules)
    write(tmp_path, "1_Pooling/config.json", pooling)
    return tmp_path


@pytest.mark.parametrize(
    ("pooling", "expected"),
    [
        ({"pooling_mode": "mean"}, "MEAN"),  # sentence-transformers 6
        ({"pooling_mode_cls_token": True, "pooling_mode_mean_tokens": False}, "CLS"),  # < 6
        ({"pooling_mode_lasttoken": True}, "LAST"),
    ],
)
def test_sentence_transformers_files_choose_the_pooler(
    tmp_path: Path, pooling: dict[str, object], expected: str
) -> None:
    folder = st_folder(tmp_path, pooling, normalize=True)
    config = resolve_pooler_config("auto", "auto", None, {}, folder, "BertModel", 32, causal=False)
    assert config is not None and (config.pooling_type, config.normalize) == (expected, True)


def test_unsupported_sentence_transformers_pooling_is_refused_by_name(tmp_path: Path) -> None:
    folder = st_folder(tmp_path, {"pooling_mode": "max"}, normalize=False)
    with pytest.raises(ValueError, match=r"pooling \['max'\] is not supported"):
        resolve_pooler_config("auto", "auto", None, {}, folder, "Qwen3Model", 32)


def test_the_runner_follows_the_checkpoint_unless_told(tmp_path: Path) -> None:
    assert resolve_pooler_config("auto", "auto", None, {}, tmp_path, "LlamaForCausalLM", 8) is None
    bare = resolve_pooler_config("auto", "auto", None, {}, tmp_path, "Qwen3Model", 8)
    assert bare is not None and (bare.pooling_type, bare.normalize, bare.task) == (
        "LAST",
        True,
        "embed",
    )
    assert resolve_runner("auto", "auto", "embed") == ("pooling", "embed")
    with pytest.raises(ValueError, match="convert='embed' needs runner='pooling'"):
        resolve_runner("generate", "embed", None)
    with pytest.raises(ValueError, match="task='embed' asks for runner='pooling'"):
        resolve_runner("generate", "auto", "embed")
