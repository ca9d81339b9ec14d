"""LoRA adapters through the OpenAI-compatible server (minivllm/entrypoints/serving_models.py).

One in-process server on a tiny Llama with two adapters from `--lora-modules` (attention-only
r=8, MLP-only r=4) and `VLLM_ALLOW_RUNTIME_LORA_UPDATING` on: the `openai` client picks an
adapter by its model name and gets transformers + peft's greedy tokens for it; /v1/models lists
each adapter under its parent; an unknown model is OpenAI's 404; an adapter loaded at run time
and unloaded while a stream runs under it leaves that stream on its adapter to the end, refuses
new requests at once, and leaves no KV block, slot or host copy behind; every bad adapter is a
400 naming what is wrong, and the server answers on.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import torch
from safetensors.torch import load_file, save_file

from minivllm.core.scheduler import SchedulerOutput
from minivllm.engine.arg_utils import EngineArgs
from minivllm.engine.core_client import AsyncMPClient, EngineCoreClient
from minivllm.entrypoints.cli import main
from minivllm.entrypoints.cli_args import LoRAModulePath
from minivllm.lora.errors import UnsupportedLoRAError
from minivllm.lora.request import LoRARequest
from minivllm.sampling_params import SamplingParams
from tests.lora.lora_utils import ATTENTION, MLP, peft_greedy, save_adapter
from tests.utils.engine_utils import save_tiny_llama
from tests.utils.server_utils import InProcessServer, serve_tiny_model

LORA = dict(enable_lora=True, max_loras=2, max_lora_rank=16, max_cpu_loras=2)
FIELDS = {
    "attn": dict(r=8, lora_alpha=16, target_modules=ATTENTION),
    "mlp": dict(r=4, lora_alpha=8, target_modules=MLP),
    "all": dict(r=16, lora_alpha=32, target_modules=ATTENTION + MLP, use_rslora=True),
}
PROMPTS = [[1, 504, 3458, 282, 4649, 314], [1, 9519, 2402, 253]]
MAX_TOKENS = 6
GREEDY = {"temperature": 0, "max_tokens": MAX_TOKENS}
EXTRA = {"ignore_eos": True, "return_token_ids": True}


class Gate:
    """A step listener that holds the engine thread after the second step that carries adapter
    `lora_int_id` (its prefill and first decode are committed and published), until released."""

    def __init__(self, lora_int_id: int) -> None:
        self.lora_int_id = lora_int_id
        self.steps = 0
        self.held = threading.Event()
        self.release = threading.Event()

    def on_step(self, sched: SchedulerOutput, *_: Any) -> None:
        if any(s.lora_request and s.lora_request.lora_int_id == self.lora_int_id
               for s in sched.scheduled):  # fmt: skip
            self.steps += 1
            if self.steps == 2:
                self.held.set()
                assert self.release.wait(timeout=60), "the test never released the engine"


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("server-lora")
    base = save_tiny_llama(root / "base")
    out = {"base": base}
    for i, (name, fields) in enumerate(FIELDS.items()):
        out[name] = save_adapter(base, root / name, seed=10 + i, **fields)
    return out


@pytest.fixture(scope="module")
def server(folders: dict[str, Path]) -> Iterator[InProcessServer]:
    modules = [LoRAModulePath("attn", str(folders["attn"])),
               LoRAModulePath("mlp", str(folders["mlp"]))]  # fmt: skip
    with pytest.MonkeyPatch.context() as env:
        env.setenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "true")
        with serve_tiny_model(folders["base"], LORA, lora_modules=modules) as s:
            yield s


@pytest.fixture(scope="module")
def client(server: InProcessServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0)


def base_name(server: InProcessServer) -> str:
    return str(server.engine.source.name)


def lora(folders: dict[str, Path], name: str) -> LoRARequest:
    return LoRARequest(name, 1, str(folders[name]))


def completion_ids(client: openai.OpenAI, model: str, prompt: list[int]) -> list[int]:
    out = client.completions.create(model=model, prompt=prompt, extra_body=EXTRA, **GREEDY)
    assert out.model == model
    return list(out.choices[0].model_extra["token_ids"])


def test_each_adapter_answers_as_peft_does_picked_by_model_name(
    server: InProcessServer, client: openai.OpenAI, folders: dict[str, Path]
) -> None:
    chat_prompt: list[int] = []
    for name in ("attn", "mlp", None):
        model = name or base_name(server)
        got = [completion_ids(client, model, p) for p in PROMPTS]
        chat = client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "Hi"}], extra_body=EXTRA, **GREEDY
        )
        chat_prompt = chat.model_extra["prompt_token_ids"]
        got.append(list(chat.choices[0].model_extra["token_ids"]))
        adapter = lora(folders, name) if name else None
        want = peft_greedy(folders["base"], adapter, [*PROMPTS, chat_prompt], [MAX_TOKENS] * 3)
        assert got == want, model
        # The Responses API takes `model` too: the same prompt as the chat's, the same answer.
        response = client.responses.create(
            model=model, input="Hi", temperature=0, max_output_tokens=MAX_TOKENS
        )
        assert response.model == model
        assert response.output_text == server.engine.tokenizer.decode(
            want[-1], skip_special_tokens=True
        )


def test_v1_models_lists_each_adapter_with_its_parent_and_root(
    server: InProcessServer, client: openai.OpenAI, folders: dict[str, Path]
) -> None:
    cards = {m.id: m for m in client.models.list().data}
    base = base_name(server)
    assert list(cards)[:3] == [base, "attn", "mlp"]
    assert cards[base].model_extra["parent"] is None
    for name in ("attn", "mlp"):
        assert cards[name].model_extra["parent"] == base
        assert cards[name].model_extra["root"] == str(folders[name])
        assert cards[name].object == "model"


def test_an_unknown_model_is_openai_s_404(client: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError) as exc:
        client.completions.create(model="nope", prompt=PROMPTS[0], **GREEDY)
    assert exc.value.status_code == 404
    assert exc.value.body["message"] == "The model `nope` does not exist."  # type: ignore[index]
    assert exc.value.body["param"] == "model"  # type: ignore[index]
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="nope", messages=[{"role": "user", "content": "x"}])


def stream_token_ids(url: str, body: dict[str, Any], out: list[int]) -> None:
    with httpx.stream("POST", url + "/completions", json=body, timeout=60) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                out += json.loads(line[6:])["choices"][0]["token_ids"]


def test_an_adapter_unloaded_while_a_stream_runs_under_it_finishes_it_and_leaves_nothing(
    server: InProcessServer, folders: dict[str, Path]
) -> None:
    url, engine = server.base_url, server.engine
    r = httpx.post(
        url + "/load_lora_adapter", json={"lora_name": "all", "lora_path": str(folders["all"])}
    )
    assert r.status_code == 200, r.text
    assert r.text == "Success: LoRA adapter 'all' added successfully."
    lora_id = next(x.lora_int_id for x in engine.list_loras() if x.lora_name == "all")
    gate = Gate(lora_id)
    engine.add_step_listener(gate)
    max_tokens = 12
    tokens: list[int] = []
    body = {"model": "all", "prompt": PROMPTS[0], "stream": True, **GREEDY, **EXTRA}
    body["max_tokens"] = max_tokens
    stream = threading.Thread(target=stream_token_ids, args=(url, body, tokens))
    unload: list[httpx.Response] = []

    def unload_all() -> None:
        body = {"lora_name": "all"}  # answered once the engine thread is released
        unload.append(httpx.post(url + "/unload_lora_adapter", json=body, timeout=60))

    unloader = threading.Thread(target=unload_all)
    try:
        stream.start()
        assert gate.held.wait(timeout=60)
        metrics = httpx.get(server.url + "/metrics").text  # published after the prefill
        assert 'vllm:lora_requests_info{max_lora="2",' in metrics
        assert 'running_lora_adapters="all"' in metrics
        unloader.start()  # its engine call waits for the held engine thread
        deadline = time.monotonic() + 60
        while "all" in [m["id"] for m in httpx.get(url + "/models").json()["data"]]:
            assert time.monotonic() < deadline, "the unload never took the name away"
            time.sleep(0.05)  # the name goes at once, before the engine hears of it
        late = httpx.post(url + "/completions", json={**body, "stream": False})
        assert late.status_code == 404 and late.json()["error"]["param"] == "model"
    finally:
        gate.release.set()
        stream.join(timeout=60)
        unloader.join(timeout=60)
        engine.remove_step_listener(gate)
    assert unload[0].status_code == 200, unload[0].text
    # The running request kept its adapter to the end: peft's tokens for it.
    assert (
        tokens == peft_greedy(folders["base"], lora(folders, "all"), [PROMPTS[0]], [max_tokens])[0]
    )
    stats = server.wait_idle()
    assert stats.num_free_kv_blocks == stats.num_kv_blocks, stats
    manager = engine.runner.lora_manager
    assert lora_id not in manager.slots and lora_id not in manager.cpu_loras
    assert "all" not in [x.lora_name for x in engine.list_loras()]
    assert len(manager.slots) <= LORA["max_loras"]
    # Unloading it again: it is gone (vLLM's 404).
    again = httpx.post(url + "/unload_lora_adapter", json={"lora_name": "all"})
    assert again.status_code == 404 and again.json()["error"]["type"] == "NotFoundError"


def bad_adapters(folders: dict[str, Path], root: Path) -> dict[str, tuple[str, str]]:
    """name -> (its folder, what the 400 must say)."""

    def copy(name: str) -> Path:
        return Path(shutil.copytree(folders["attn"], root / name))

    rank = copy("rank")
    config = json.loads((rank / "adapter_config.json").read_text())
    (rank / "adapter_config.json").write_text(json.dumps({**config, "r": 32}))
    module, shape, truncated = copy("module"), copy("shape"), copy("truncated")
    tensors = load_file(folders["attn"] / "adapter_model.safetensors")
    save_file({k.replace("layers.1.", "layers.7."): v for k, v in tensors.items()},
              module / "adapter_model.safetensors")  # fmt: skip
    other = {k: torch.zeros(v.shape[0], 32) if "lora_A" in k else v for k, v in tensors.items()}
    save_file(other, shape / "adapter_model.safetensors")
    weights = truncated / "adapter_model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    return {
        "missing": (str(root / "no-such-folder"), "is not a folder"),
        "rank": (str(rank), "r=32 is above max_lora_rank=16"),
        "module": (str(module), "model.layers.7."),
        "shape": (str(shape), "another base model"),
        "truncated": (str(truncated), "truncated or corrupt"),
        "attn": (str(folders["attn"]), "has already been loaded"),  # a duplicate name
    }


def test_each_bad_adapter_is_a_400_naming_what_is_wrong_and_the_server_serves_on(
    server: InProcessServer, client: openai.OpenAI, folders: dict[str, Path], tmp_path: Path
) -> None:
    url = server.base_url
    for name, (path, says) in bad_adapters(folders, tmp_path).items():
        r = httpx.post(url + "/load_lora_adapter", json={"lora_name": name, "lora_path": path})
        assert r.status_code == 400, (name, r.text)
        assert says in r.json()["error"]["message"], (name, r.text)
    for body, param in (
        ({"lora_name": "x"}, "lora_path"),
        ({"lora_name": "x", "lora_path": 3}, "lora_path"),
    ):
        r = httpx.post(url + "/load_lora_adapter", json=body)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    r = httpx.post(url + "/unload_lora_adapter", json={"lora_name": "never-loaded"})
    assert r.status_code == 404, r.text
    assert [m.id for m in client.models.list().data][1:] == ["attn", "mlp"]
    assert len(completion_ids(client, "mlp", PROMPTS[1])) == MAX_TOKENS


def test_adapters_and_their_errors_cross_to_the_engine_core_process(
    folders: dict[str, Path], tmp_path: Path
) -> None:
    """The same calls through the engine-core process's pipe (`AsyncMPClient`): a bad adapter's
    `LoRAError` comes back as itself, a request runs under its adapter, and removal answers."""
    config = EngineArgs(
        model=str(folders["base"]), max_model_len=64, block_size=4, num_gpu_blocks_override=32,
        **LORA,
    ).create_engine_config()  # type: ignore[arg-type]  # fmt: skip
    client = AsyncMPClient(EngineCoreClient(config, torch_threads=1))
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    mlp = lora(folders, "mlp")
    rank = Path(shutil.copytree(folders["attn"], tmp_path / "rank"))
    (rank / "adapter_config.json").write_text(json.dumps({"r": 32, "target_modules": ATTENTION}))

    async def run() -> list[int]:
        client.start()
        with pytest.raises(UnsupportedLoRAError, match="max_lora_rank=16"):
            await client.add_lora(LoRARequest("rank", 2, str(rank)))
        assert await client.add_lora(mlp)
        out: asyncio.Queue[Any] = asyncio.Queue()
        client.add_request("r", {"prompt_token_ids": PROMPTS[1]}, params, out, mlp)
        while not (item := await out.get()).finished:
            pass
        assert await client.remove_lora(mlp.lora_int_id)
        assert not await client.remove_lora(mlp.lora_int_id)
        return list(item.outputs[0].token_ids)

    try:
        tokens = asyncio.run(run())
    finally:
        client.shutdown()
    assert tokens == peft_greedy(folders["base"], mlp, [PROMPTS[1]], [MAX_TOKENS])[0]


def test_lora_modules_without_enable_lora_is_refused_by_name(
    folders: dict[str, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["serve", str(folders["base"]), "--lora-modules", f"a={folders['attn']}",
              f'{{"name": "b", "path": "{folders["mlp"]}"}}'])  # fmt: skip
    assert exc.value.code == 2
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert "--lora-modules needs --enable-lora" in line, line
