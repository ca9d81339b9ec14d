"""Servers for the server tests, on a free loopback port: `minivllm serve` as a subprocess
(`run_server`), or `build_app` under uvicorn in a thread of the test process (`serve_in_process`),
when a test must reach the engine itself (fault injection, KV block accounting). Also a tiny random
Llama, for tests that need a model but not its answers to make sense."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import httpx

from minivllm.benchmarks import server_process

STARTUP_TIMEOUT_S = 180.0  # model load on a contended 2-CPU machine


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class RemoteServer:
    url: str  # http://127.0.0.1:PORT
    process: subprocess.Popen
    log_path: str
    api_key: str | None = None

    @property
    def base_url(self) -> str:
        return self.url + "/v1"

    def log(self) -> str:
        with open(self.log_path, encoding="utf-8", errors="replace") as f:
            return f.read()

    def metrics(self) -> dict[str, float]:
        """/metrics as {sample name with labels: value}, e.g. 'vllm:num_preemptions_total'."""
        text = httpx.get(self.url + "/metrics", timeout=10).text
        values: dict[str, float] = {}
        for line in text.splitlines():
            if line and not line.startswith("#"):
                name, value = line.rsplit(" ", 1)
                values[name] = float(value)
        return values

    def metric(self, name: str, **labels: str) -> float:
        """Sum of the samples called `name` whose labels include `labels`."""
        total = 0.0
        for key, value in self.metrics().items():
            base = key.split("{", 1)[0]
            if base == name and all(f'{k}="{v}"' in key for k, v in labels.items()):
                total += value
        return total


def wait_until_healthy(url: str, proc: subprocess.Popen[Any], log: Callable[[], str]) -> None:
    """Wait until the server `proc` runs answers /health with a 200; fail with its `log()` if it
    exits first or does not start in STARTUP_TIMEOUT_S."""
    server_process.wait_until_healthy(
        url + "/health", proc, STARTUP_TIMEOUT_S, details=lambda: f":\n{log()}"
    )


@contextmanager
def run_server(
    args: Sequence[str] = (), api_key: str | None = None, env: Mapping[str, str] | None = None
) -> Iterator[RemoteServer]:
    port = free_port()
    cmd = [sys.executable, "-m", "minivllm.entrypoints.cli", "serve", "--port", str(port)]
    cmd += ["--log-stats-interval", "2", "--uvicorn-log-level", "warning", *args]
    if api_key:
        cmd += ["--api-key", api_key]
    # Closed in the finally below; kept after the test for reading failures.
    log = tempfile.NamedTemporaryFile("w", prefix="minivllm-serve-", suffix=".log", delete=False)  # noqa: SIM115
    environ = {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
        **(env or {}),
    }
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=environ)
    server = RemoteServer(f"http://127.0.0.1:{port}", proc, log.name, api_key)
    try:
        wait_until_healthy(server.url, proc, server.log)
        yield server
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()


@dataclass
class InProcessServer:
    url: str  # http://127.0.0.1:PORT
    engine: Any  # the LLMEngine the app serves (stepped by the app's engine thread), or its core's client
    app: Any

    @property
    def base_url(self) -> str:
        return self.url + "/v1"

    def wait_idle(self, timeout: float = 60.0) -> Any:
        """The engine thread's published stats, once no request runs or waits."""
        deadline = time.monotonic() + timeout
        while True:
            stats = self.app.state.engine_client.stats
            busy = getattr(self.engine, "requests", None)  # an engine-core client has none here
            if stats.num_running == 0 and stats.num_waiting == 0 and not busy:
                return stats
            assert time.monotonic() < deadline, f"the engine did not go idle: {stats}"
            time.sleep(0.05)


@contextmanager
def serve_in_process(engine: Any, **app_kwargs: Any) -> Iterator[InProcessServer]:
    """`build_app(engine)` served by uvicorn in a daemon thread; stopped (engine thread included)
    on exit, pass or fail."""
    import uvicorn

    from minivllm.entrypoints.api_server import build_app

    app = build_app(engine, **app_kwargs)
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, name="uvicorn", daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 60
        while not server.started:
            assert thread.is_alive(), "uvicorn exited during startup"
            assert time.monotonic() < deadline, "uvicorn did not start in time"
            time.sleep(0.05)
        yield InProcessServer(f"http://127.0.0.1:{port}", engine, app)
    finally:
        server.should_exit = True
        thread.join(timeout=30)


@contextmanager
def serve_tiny_model(
    model: Any,
    engine_args: dict[str, Any] | None = None,
    engine_core_process: bool = False,
    **app_kwargs: Any,
) -> Iterator[InProcessServer]:
    """The in-process server on a tiny model folder: 256 positions, 256 blocks of 4 tokens;
    `engine_args`: more engine options (EngineArgs fields); `engine_core_process`: the engine in
    a process of its own (`minivllm serve --engine-core-process`), killed on exit if still alive."""
    from minivllm.engine.arg_utils import EngineArgs
    from minivllm.engine.core_client import EngineCoreClient
    from minivllm.engine.llm_engine import LLMEngine

    config = EngineArgs(
        model=str(model),
        max_model_len=256,
        block_size=4,
        num_gpu_blocks_override=256,
        **(engine_args or {}),
    ).create_engine_config()
    engine = EngineCoreClient(config, torch_threads=1) if engine_core_process else LLMEngine(config)
    try:
        with serve_in_process(engine, **app_kwargs) as s:
            yield s
    finally:
        if isinstance(engine, EngineCoreClient) and engine.process.is_alive():
            engine.process.kill()


# ---------------------------------------------------------------------------------- processes
def is_gone(pid: int) -> bool:
    """Whether process `pid` has exited (a zombie counts: it holds no resources)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def wait_gone(pid: int, timeout: float = 5.0) -> bool:
    """Whether process `pid` exits within `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while not is_gone(pid):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)
    return True
