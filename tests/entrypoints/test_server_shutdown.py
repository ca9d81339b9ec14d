"""`minivllm serve` stops on SIGTERM within its drain time (`--shutdown-timeout`), whatever it
is generating: it stops accepting, lets the requests in flight run for the drain, then aborts
them through the engine (each stream then ends as an aborted request's does), stops the engine (its core process too) and exits, leaving no process
behind. Before, uvicorn waited for every open connection, for ever: one long stream kept the
server up until it was killed.
"""

from __future__ import annotations

import json
import signal
import subprocess
import threading
import time
from pathlib import Path

import httpx
import pytest

from tests.utils.engine_utils import save_tiny_llama
from tests.utils.server_utils import run_server, wait_gone

MAX_MODEL_LEN = 8192
LONG = MAX_MODEL_LEN - 64  # tokens: far more than the test waits for
DRAIN_S = 1.0
EXIT_WITHIN_S = 5.0  # the drain, the abort, the engine's last step, the interpreter's exit


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_llama(tmp_path_factory.mktemp("tiny-llama"), max_position_embeddings=8192)


def children(pid: int) -> list[int]:
    """The process's children: the engine core, multiprocessing's resource tracker."""
    out = subprocess.run(["ps", "--ppid", str(pid), "-o", "pid="], text=True, capture_output=True)
    return [int(line) for line in out.stdout.split()]


@pytest.mark.parametrize("engine", ["thread", "core-process"])
def test_sigterm_mid_stream_exits_after_the_drain_with_no_process_left(
    model: Path, engine: str
) -> None:
    args = ["--model", str(model), "--max-model-len", str(MAX_MODEL_LEN)]
    args += ["--shutdown-timeout", str(DRAIN_S)]
    if engine == "core-process":
        args += ["--engine-core-process", "--engine-core-threads", "1"]
    body = {"prompt": "Once upon a time", "max_tokens": LONG, "ignore_eos": True, "stream": True}
    with run_server(args) as server:
        kids = children(server.process.pid)
        assert len(kids) == (2 if engine == "core-process" else 0), kids  # core + tracker
        events: list[str] = []
        stream_ended = threading.Event()

        def read_stream() -> None:
            try:
                url = server.base_url + "/completions"
                with httpx.stream("POST", url, json=body, timeout=60) as response:
                    events.extend(
                        line for line in response.iter_lines() if line.startswith("data:")
                    )
            except httpx.HTTPError:  # the server closed the connection mid-stream
                pass
            finally:
                stream_ended.set()

        threading.Thread(target=read_stream, name="client", daemon=True).start()
        deadline = time.monotonic() + 60
        while len(events) < 20:  # well into its decode
            assert not stream_ended.is_set(), server.log()
            assert time.monotonic() < deadline, server.log()
            time.sleep(0.05)

        server.process.send_signal(signal.SIGTERM)
        start = time.monotonic()
        try:
            server.process.wait(timeout=EXIT_WITHIN_S)
        except subprocess.TimeoutExpired:
            pytest.fail(f"still running {EXIT_WITHIN_S} s after SIGTERM:\n{server.log()}")
        assert time.monotonic() - start >= DRAIN_S * 0.9  # the requests had their drain
        # uvicorn re-raises the signal it caught once it has shut down: SIGTERM's own status
        assert server.process.returncode in (0, -signal.SIGTERM), server.log()
        assert stream_ended.wait(5), "the stream stayed open"
        # cut, not finished, and ended as an aborted request ends: its last chunk, then [DONE]
        assert events[-1] == "data: [DONE]", events[-3:]
        reasons = [
            json.loads(e[len("data:") :])["choices"][0]["finish_reason"] for e in events[:-1]
        ]
        # the API spells an abort "stop" (serving.finish_reason); with ignore_eos and no stop
        # strings nothing else stops it
        assert reasons[-1] == "stop" and "length" not in reasons
        assert "Exception in ASGI application" not in server.log()  # not cancelled mid-send
        assert all(wait_gone(pid) for pid in kids), f"left behind: {kids}"
