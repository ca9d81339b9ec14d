"""07 · Serving, and calling the server with the official `openai` client.

`minivllm serve` puts the engine behind an OpenAI-compatible HTTP API (minivllm/entrypoints/):
FastAPI routes validate each request, an engine thread runs `LLMEngine.step()` in a loop, and each
request's outputs stream back to its handler as server-sent events. Because the API is OpenAI's,
the official `openai` client talks to it unchanged: only `base_url` differs.

This script starts `minivllm serve` (bundled SmolLM2-135M) as a subprocess on a free port, calls
it, and stops it.

Run: python tutorials/07_serving.py [OUT_DIR]   (writes OUT_DIR/07_stream.png)
"""

from __future__ import annotations

import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import IO

import matplotlib.pyplot as plt
import openai

plt.switch_backend("Agg")  # write files, never open a window
OUT = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(__file__).parent / "out"
MAX_TOKENS = 24  # of the streamed reply
API_KEY = "tutorial-key"  # with --api-key, every /v1 request must carry it

with socket.socket() as s:  # ask the OS for a free port
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]

# In a shell this is `minivllm serve --port ...`; no model named: the bundled SmolLM2. A small KV
# cache (64 blocks of 16 tokens) keeps the tutorial light.
args = f"serve --port {port} --api-key {API_KEY} --max-model-len 512 --num-gpu-blocks-override 64"
command = [sys.executable, "-m", "minivllm.entrypoints.cli", *args.split()]


def wait_until_healthy(server: subprocess.Popen, log: IO[bytes]) -> float:
    """Poll /health until the model is loaded and the engine thread runs; seconds waited. (The
    benches and tests share minivllm/benchmarks/server_process.py's; this tutorial keeps its own
    copy so that it reads on its own.)"""
    start = time.monotonic()
    while time.monotonic() - start < 180:
        if server.poll() is not None:
            log.seek(0)
            sys.exit(f"the server exited early:\n{log.read().decode()}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1) as r:
                if r.status == 200:
                    return time.monotonic() - start
        except OSError:  # not listening yet
            time.sleep(0.5)
    sys.exit("the server did not become healthy within 180 s")


with tempfile.TemporaryFile() as log:  # the server's log, shown if it fails to start
    server = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
    try:
        print(f"server healthy on port {port} after {wait_until_healthy(server, log):.0f} s")
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=API_KEY)
        model = client.models.list().data[0].id
        print(f"GET /v1/models -> {model}")

        completion = client.completions.create(
            model=model, prompt="The capital of France is", max_tokens=8, temperature=0
        )
        choice = completion.choices[0]
        print(f"POST /v1/completions -> {choice.text!r} (finish_reason {choice.finish_reason!r})")

        # Streaming: the reply arrives chunk by chunk, as the engine produces tokens.
        sent = time.perf_counter()
        stream = client.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": "Name three colours."}],
            max_tokens=MAX_TOKENS,
            temperature=0,
            stream=True,
        )
        chunks, arrivals = [], []  # each chunk's text, and when it arrived (s after sending)
        for c in stream:
            if c.choices:
                chunks.append(c.choices[0].delta.content or "")
                arrivals.append(time.perf_counter() - sent)
        print(
            f"POST /v1/chat/completions, stream=True -> {len(chunks)} chunks: {''.join(chunks)!r}"
        )

        # A bad parameter is refused before any work, with OpenAI's error shape and the field's name.
        try:
            client.completions.create(model=model, prompt="Hi", top_p=1.5)
        except openai.BadRequestError as e:
            print(f"top_p=1.5 -> HTTP {e.status_code}: {e.body['message']!r}")

        # Operators read Prometheus metrics with vLLM's own names: a vLLM dashboard reads them.
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics") as r:
            metrics = r.read().decode()
        lines = [m for m in metrics.splitlines() if m.startswith("vllm:generation_tokens_total")]
        print(f"GET /metrics -> {lines[0]}")
    finally:
        server.terminate()  # SIGTERM: uvicorn shuts down, the engine thread stops
        server.wait(timeout=60)
print("server stopped")

# The picture: when each streamed chunk arrived. The first waits for the prompt's prefill (time to
# first token); the rest come one engine step apart (inter-token latency).
OUT.mkdir(parents=True, exist_ok=True)
fig, ax = plt.subplots(figsize=(7, 3))
ax.step(arrivals, range(1, len(arrivals) + 1), where="post")
ax.plot(arrivals, range(1, len(arrivals) + 1), "o", markersize=3)
ax.set_xlabel("seconds after the request was sent")
ax.set_ylabel("chunks received")
ax.set_title(f"A streamed reply: first chunk after {arrivals[0]:.2f} s", fontsize=10)
fig.tight_layout()
fig.savefig(OUT / "07_stream.png", dpi=100)
print(f"figure: {OUT / '07_stream.png'}")
print(
    f"LESSON: minivllm speaks OpenAI's API: the official client listed the model, completed, "
    f"streamed {len(chunks)} chunks and got a 400 naming the bad field, with only base_url changed."
)
print(
    "TRY THIS: set MAX_TOKENS = 48. Predict before you run: about twice as many chunks, the first "
    "one no later (it waits only for the prompt), the line in the picture twice as long."
)
