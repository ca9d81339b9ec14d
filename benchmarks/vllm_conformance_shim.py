"""A stand-in for vLLM's `tests/utils.py`, so that vLLM's own OpenAI-server tests run against
`minivllm serve`.

`benchmarks/vllm_openai_conformance.py` copies this file over `tests/utils.py` of the vLLM test
tree it extracts; nothing here is imported by minivllm or its own tests. It runs in the
conformance virtual environment, which has no `vllm`: importing it puts a few small stand-ins for
the `vllm` modules the server tests name (`vllm.version`, `vllm.transformers_utils.tokenizer`,
`vllm.config.ModelConfig`, `vllm.entrypoints.renderer.BaseRenderer`, `vllm.assets.audio`, ...)
into `sys.modules`. A test module that needs more of vLLM than that fails to import, and the runner
classifies it as a test of vLLM's internals.

`RemoteOpenAIServer` keeps vLLM's interface (`url_for`, `get_client`, `get_async_client`,
`show_hidden_metrics`, a context manager) and starts `minivllm serve` with the bundled model,
whatever model the test names: the server runs in a folder of the run where the test's model name
(`HuggingFaceH4/zephyr-7b-beta`) is a local folder holding the bundled GGUF file, and is started
with that name as its model, as vLLM's test starts vLLM: requests that name it are answered, and
`/v1/models` reports it as vLLM would (`id`, and `root`: the model argument). Flags minivllm lacks
are dropped and logged (to the server's log file and to `dropped_flags.jsonl` in the run folder),
never silently.

Environment (set by the runner):
  MINIVLLM_PYTHON                    the project's python, which runs `minivllm serve`
  MINIVLLM_ROOT                      the minivllm tree the server imports (on its PYTHONPATH)
  MINIVLLM_CONFORMANCE_RUN           the run folder: server logs, dropped flags
  MINIVLLM_CONFORMANCE_TOKENIZER     the bundled model's tokenizer, saved as a folder
  MINIVLLM_CONFORMANCE_FLAGS         minivllm's serve flags as JSON: {flag: takes_value, ...}
  MINIVLLM_CONFORMANCE_VERSION       minivllm's version (what `/version` answers)
  MINIVLLM_CONFORMANCE_GGUF          the bundled model's GGUF file
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import socket
import subprocess
import sys
import time
import types
from pathlib import Path
from typing import Any

import httpx
import openai
import requests

VLLM_PATH = Path(__file__).parent.parent
"""vLLM's tests name files relative to the checkout's root; here, the extracted tree's."""


# --------------------------------------------------------------------------- vllm stand-ins


def _get_tokenizer(tokenizer_name: str = "", *args: Any, **kwargs: Any) -> Any:
    """Every model a test names is served by the bundled model, so this is its tokenizer."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(os.environ["MINIVLLM_CONFORMANCE_TOKENIZER"])


class _ModelConfig:
    """What the server tests ask of vLLM's `ModelConfig`: the (bundled) model's vocabulary size."""

    def __init__(self, model: str = "", **kwargs: Any) -> None:
        self.model = model

    def get_vocab_size(self) -> int:
        return int(_model_config()["vocab_size"])


def _model_config() -> dict[str, Any]:
    folder = Path(os.environ["MINIVLLM_CONFORMANCE_TOKENIZER"])
    return dict(json.loads((folder / "model_config.json").read_text()))


class _BaseRenderer:
    """vLLM's prompt renderer, which `test_prompt_validation` imports for its unit test of
    `load_prompt_embeds` (vLLM's tensor decoding: classified as internals); the module's server
    tests need only the name to be importable."""

    @staticmethod
    def load_prompt_embeds(*args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError("vLLM's BaseRenderer is a stand-in here: prompt embeddings")


class _AudioAsset:
    def __init__(self, name: str) -> None:
        self.name = name

    def get_local_path(self) -> Path:
        raise RuntimeError("vllm.assets.audio is a stand-in: audio tests need vLLM's assets")


def _version_module() -> types.ModuleType:
    module = types.ModuleType("vllm.version")
    version = os.environ.get("MINIVLLM_CONFORMANCE_VERSION", "0.0.0")
    parts = tuple(int(p) if p.isdigit() else p for p in version.split("."))
    module.__dict__.update(
        __version__=version,
        __version_tuple__=parts,
        # vLLM's `_prev_minor_version()`: the value --show-hidden-metrics-for-version is given.
        _prev_minor_version=lambda: f"{parts[0]}.{int(parts[1]) - 1}",
    )
    return module


def install_vllm_stand_ins() -> None:
    """Registers the stand-in `vllm` modules; a module a test imports that is not here is missing."""
    if "vllm" in sys.modules:
        return
    modules: dict[str, dict[str, Any]] = {
        "vllm": {},
        "vllm.transformers_utils": {},
        "vllm.transformers_utils.tokenizer": {"get_tokenizer": _get_tokenizer},
        "vllm.config": {"ModelConfig": _ModelConfig},
        "vllm.entrypoints": {},
        "vllm.entrypoints.renderer": {"BaseRenderer": _BaseRenderer},
        "vllm.assets": {},
        "vllm.assets.audio": {"AudioAsset": _AudioAsset},
    }
    for name, attributes in modules.items():
        module = types.ModuleType(name)
        module.__path__ = []  # a package: submodules may exist
        module.__dict__.update(attributes)
        sys.modules[name] = module
    sys.modules["vllm.version"] = _version_module()
    sys.modules["vllm"].version = sys.modules["vllm.version"]  # type: ignore[attr-defined]
    for name in modules:
        parent, _, child = name.rpartition(".")
        if parent:
            setattr(sys.modules[parent], child, sys.modules[name])


def redirect_hub_tokenizers() -> None:
    """`AutoTokenizer.from_pretrained("any/hub-id")` in a test means the served model's tokenizer,
    which is the bundled model's here (the tests compare token ids with the server's)."""
    import transformers

    original = transformers.AutoTokenizer.from_pretrained

    def from_pretrained(name: Any, *args: Any, **kwargs: Any) -> Any:
        if not Path(str(name)).exists():
            name = os.environ["MINIVLLM_CONFORMANCE_TOKENIZER"]
        return original(name, *args, **kwargs)

    setattr(transformers.AutoTokenizer, "from_pretrained", from_pretrained)  # noqa: B010


install_vllm_stand_ins()
redirect_hub_tokenizers()


# --------------------------------------------------------------------------- the server


def get_open_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@functools.cache
def _minivllm_flags() -> dict[str, Any]:
    return dict(json.loads(os.environ["MINIVLLM_CONFORMANCE_FLAGS"]))


# Flags the tests set for a GPU's sake ("half precision for speed and memory savings in CI"):
# dropped, so the bundled model runs at its CPU default (float32, the C++ decode loop), the fast
# path here; float16 activations run the Python loop at a tenth of the speed.
CPU_DEFAULTS = ("--dtype",)


def translate_args(args: list[str]) -> tuple[list[str], list[str]]:
    """vLLM serve arguments -> (minivllm's, the dropped ones). A dropped flag takes the next
    argument with it when that argument is not a flag (vLLM's value-taking flags)."""
    flags = {k: v for k, v in _minivllm_flags().items() if k not in CPU_DEFAULTS}
    kept: list[str] = []
    dropped: list[str] = []
    i = 0
    while i < len(args):
        arg = args[i]
        name, eq, value = arg.partition("=")
        takes_value = i + 1 < len(args) and not args[i + 1].startswith("-")
        if name.startswith("--") and name in flags:
            spec = flags[name]
            n = 1 if eq or not spec["takes_value"] else 1 + spec.get("nargs", 1)
            if spec.get("nargs") == "+" and not eq:
                n = 1
                while i + n < len(args) and not args[i + n].startswith("-"):
                    n += 1
            chunk = args[i : i + n]
            choices = spec.get("choices")
            chosen = value if eq else (chunk[1] if len(chunk) > 1 else None)
            if choices and chosen is not None and chosen not in choices:
                dropped += chunk
            else:
                kept += chunk
            i += n
            continue
        n = 1 if eq or not takes_value else 2
        dropped += args[i : i + n]
        i += n
    # The bundled model has fewer positions than some tests' models: clamp, and say so.
    positions = int(_model_config()["max_position_embeddings"])
    for i, arg in enumerate(kept[:-1]):
        if arg == "--max-model-len" and kept[i + 1].isdigit() and int(kept[i + 1]) > positions:
            dropped.append(f"--max-model-len {kept[i + 1]} (clamped to {positions})")
            kept[i + 1] = str(positions)
    # A tool parser minivllm does not have leaves auto tool choice without one: drop both.
    if "--enable-auto-tool-choice" in kept and "--tool-call-parser" not in kept:
        kept.remove("--enable-auto-tool-choice")
        dropped.append("--enable-auto-tool-choice")
    return kept, dropped


class RemoteOpenAIServer:
    DUMMY_API_KEY = "token-abc123"  # vLLM's OpenAI server does not need an API key

    def __init__(
        self,
        model: str,
        vllm_serve_args: list[str],
        *,
        env_dict: dict[str, str] | None = None,
        seed: int | None = 0,
        auto_port: bool = True,
        max_wait_seconds: float | None = None,
        override_hf_configs: dict[str, Any] | None = None,
    ) -> None:
        args = list(vllm_serve_args)
        if auto_port and "--uds" not in args:
            if "-p" in args or "--port" in args:
                raise ValueError("You have manually specified the port when `auto_port=True`.")
            args += ["--port", str(get_open_port())]
        if seed is not None:
            if "--seed" in args:
                raise ValueError(f"You have manually specified the seed when `seed={seed}`.")
            args += ["--seed", str(seed)]
        if override_hf_configs is not None:
            args += ["--hf-overrides", json.dumps(override_hf_configs)]
        kept, dropped = translate_args(args)
        model_arg = _bundled_model_as(model)
        if model_arg is None and "--served-model-name" not in kept:
            kept += ["--served-model-name", model]  # a path of the test's own: served by name
        kept = ([model_arg] if model_arg else []) + kept
        self.show_hidden_metrics = any(
            a.startswith("--show-hidden-metrics-for-version") for a in kept
        )
        self.uds = _value_of(kept, "--uds")
        self.host = None if self.uds else (_value_of(kept, "--host") or "127.0.0.1")
        self.port = None if self.uds else int(_value_of(kept, "--port") or 8000)
        self._log_dropped(model, args, dropped)
        self._start_server(kept, env_dict)
        self._wait_for_server(url=self.url_for("health"), timeout=max_wait_seconds or 240)

    def _log_dropped(self, model: str, args: list[str], dropped: list[str]) -> None:
        run = Path(os.environ["MINIVLLM_CONFORMANCE_RUN"])
        test = os.environ.get("PYTEST_CURRENT_TEST", "").split(" ")[0]
        record = {"test": test, "model": model, "args": args, "dropped": dropped}
        with (run / "dropped_flags.jsonl").open("a") as f:
            f.write(json.dumps(record) + "\n")
        self._log_path = run / "servers" / f"{int(time.time() * 1000)}.log"
        self._log_path.parent.mkdir(exist_ok=True)
        self._log_path.write_text(f"# {json.dumps(record)}\n")

    def _start_server(self, args: list[str], env_dict: dict[str, str] | None) -> None:
        env = os.environ.copy()
        env.update(env_dict or {})
        # The minivllm tree on the path (a fixed commit's, with --minivllm); the models' folder as
        # the working directory, where the test's model name is a folder of the bundled model.
        env["PYTHONPATH"] = os.pathsep.join(
            p for p in (os.environ["MINIVLLM_ROOT"], env.get("PYTHONPATH")) if p
        )
        log = self._log_path.open("a")
        self.proc = subprocess.Popen(
            [os.environ["MINIVLLM_PYTHON"], "-m", "minivllm.entrypoints.cli", "serve", *args],
            cwd=_models_dir(),
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
        )

    def __enter__(self) -> RemoteOpenAIServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(15)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()

    def _wait_for_server(self, *, url: str, timeout: float) -> None:
        start = time.time()
        client: Any = (
            httpx.Client(transport=httpx.HTTPTransport(uds=self.uds)) if self.uds else requests
        )
        while True:
            with contextlib.suppress(Exception):
                if client.get(url).status_code == 200:
                    return
            if self.proc.poll() is not None:
                raise RuntimeError(f"Server exited unexpectedly (log: {self._log_path}).")
            if time.time() - start > timeout:
                self.__exit__()
                raise RuntimeError("Server failed to start in time.")
            time.sleep(0.5)

    @property
    def url_root(self) -> str:
        return (
            f"http://{self.uds.split('/')[-1]}" if self.uds else f"http://{self.host}:{self.port}"
        )

    def url_for(self, *parts: str) -> str:
        return self.url_root + "/" + "/".join(parts)

    def get_client(self, **kwargs: Any) -> openai.OpenAI:
        kwargs.setdefault("timeout", 600)
        return openai.OpenAI(
            base_url=self.url_for("v1"), api_key=self.DUMMY_API_KEY, max_retries=0, **kwargs
        )

    def get_async_client(self, **kwargs: Any) -> openai.AsyncOpenAI:
        kwargs.setdefault("timeout", 600)
        return openai.AsyncOpenAI(
            base_url=self.url_for("v1"), api_key=self.DUMMY_API_KEY, max_retries=0, **kwargs
        )


def _models_dir() -> Path:
    return Path(os.environ["MINIVLLM_CONFORMANCE_RUN"]) / "models"


def _bundled_model_as(model: str) -> str | None:
    """`model` (a hub id or a plain name) as a folder under the models' folder that holds the
    bundled GGUF file; None for a path (absolute, or with '..'), which is served by name."""
    if Path(model).is_absolute() or ".." in Path(model).parts or model.startswith("~"):
        return None
    gguf = Path(os.environ["MINIVLLM_CONFORMANCE_GGUF"])
    folder = _models_dir() / model
    folder.mkdir(parents=True, exist_ok=True)
    link = folder / gguf.name
    if not link.exists():
        link.symlink_to(gguf)
    return model


def _value_of(args: list[str], flag: str) -> str | None:
    for i, arg in enumerate(args):
        if arg == flag and i + 1 < len(args):
            return args[i + 1]
        if arg.startswith(flag + "="):
            return arg.split("=", 1)[1]
    return None


class RemoteOpenAIServerCustom(RemoteOpenAIServer):
    """vLLM's in-process variant; here it is the same subprocess server."""


def get_client_text_generations(completions: list[Any]) -> list[str]:
    return [x.text for completion in completions for x in completion.choices]
