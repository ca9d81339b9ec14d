"""Schema-driven fuzzing: schemathesis reads the server's own /openapi.json and sends what it allows
and what it does not, to a real `minivllm serve` process.

Its coverage phase walks every field's boundaries (each type, each missing required field, each
enum value, each other HTTP method); its fuzzing phase draws random bodies, valid and invalid.
schemathesis's checks (`--checks all`) hold every answer to the published schema: never a 5xx, a
documented status, content type and JSON shape, every streamed event a documented chunk, invalid
bodies refused. On top, from the recorded traffic (a HAR file): every 4xx is OpenAI's error object.
Afterwards the server is healthy and holds no KV block.

The run is bounded: a fixed seed, `MAX_EXAMPLES` per operation in the fuzzing phase (the coverage
phase is finite by itself), and a tiny random Llama with `--max-model-len 48`, so that every
generation is short. schemathesis's `positive_data_acceptance` check is left out: limits the
schema cannot state (prompt plus max_tokens within max_model_len, min_tokens <= max_tokens, the
served names, SamplingParams' ranges) make some schema-valid bodies a correct 400.

schemathesis runs as its CLI, not through its pytest plugin: the plugin's fixture-based loader
(needed here, as the schema comes from a server the test starts) fails on pytest 9.
"""

from __future__ import annotations

import base64
import json
import subprocess
import sys
from collections import Counter, defaultdict
from typing import Any
from urllib.parse import urlsplit

import httpx
import pytest

from minivllm.entrypoints import protocol, response_schemas
from tests.utils.engine_utils import save_tiny_llama
from tests.utils.server_utils import RemoteServer, run_server

SEED = 17
MAX_EXAMPLES = 10  # per operation, in the fuzzing phase
# The generations' cost: a chat body of the coverage phase is a ~36-token prompt whose completion,
# without max_tokens, fills the model's length, and the run has a few hundred of them. 48 leaves
# every chat prompt schemathesis sends (29-36 tokens) room to generate.
MAX_MODEL_LEN = 48
RUN_TIMEOUT_S = 600  # a hung server fails the test instead of hanging it
# /invocations publishes ChatCompletionRequest's schema and hands a body with `messages` to the
# chat handler, so the coverage phase, which is determined by the schema alone, would send it the
# same ~760 bodies it sends /v1/chat/completions (over a quarter of the run, with ~180 generations)
# through the same parsing and handler. Its own code, the routing on `messages` / `prompt`, meets the fuzzing phase's
# random bodies, valid and invalid, like every other operation's.
INVOCATIONS_FUZZING_ONLY = """
[[operations]]
include-path = "/invocations"
phases.coverage.enabled = false
"""


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory):
    model = save_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))
    args = [str(model), "--max-model-len", str(MAX_MODEL_LEN), "--max-num-seqs", "8"]
    args += ["--block-size", "4", "--num-gpu-blocks-override", "192"]  # 8 x 48 tokens, twice over
    with run_server(args) as s:
        yield s


@pytest.fixture(scope="module")
def fuzz(server: RemoteServer, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """One schemathesis run: its JSON run report and the HAR entries of every request it sent."""
    out = tmp_path_factory.mktemp("schemathesis")
    config = out / "schemathesis.toml"
    config.write_text(INVOCATIONS_FUZZING_ONLY)
    cmd = [sys.executable, "-m", "schemathesis.cli", "--config-file", str(config), "run"]
    cmd += [server.url + "/openapi.json"]
    cmd += [
        "--phases",
        "coverage,fuzzing",
        "--seed",
        str(SEED),
        "--max-examples",
        str(MAX_EXAMPLES),
    ]
    cmd += ["--checks", "all", "--exclude-checks", "positive_data_acceptance", "--workers", "1"]
    cmd += ["--generation-database", "none", "--request-timeout", "60", "--no-color"]
    cmd += ["--report", "json,har", "--report-dir", str(out)]
    # cwd: the run reads no schemathesis.toml and writes nothing into the checkout.
    run = subprocess.run(cmd, cwd=out, capture_output=True, text=True, timeout=RUN_TIMEOUT_S)
    report = json.loads(next(out.glob("json-*.json")).read_text())
    entries = json.loads(next(out.glob("har-*.json")).read_text())["log"]["entries"]
    outcomes = Counter(
        (e["request"]["method"], urlsplit(e["request"]["url"]).path, e["response"]["status"])
        for e in entries
    )
    by_operation: dict[str, Counter[int]] = defaultdict(Counter)
    for (method, path, status), count in outcomes.items():
        by_operation["any undocumented method" if status == 405 else f"{method} {path}"][
            status
        ] += count
    print(f"\nschemathesis: {len(entries)} requests; {report['test_cases']}")
    for operation, statuses in sorted(by_operation.items()):
        print(f"  {operation}: " + ", ".join(f"{s} x{n}" for s, n in sorted(statuses.items())))
    return {"run": run, "report": report, "entries": entries, "outcomes": outcomes}


def _body(entry: dict[str, Any]) -> str:
    content = entry["response"]["content"]
    text = content.get("text", "")
    return base64.b64decode(text).decode() if content.get("encoding") == "base64" else text


def test_schemathesis_checks_pass_in_both_phases(fuzz: dict[str, Any]) -> None:
    report = fuzz["report"]
    assert fuzz["run"].returncode == 0, fuzz["run"].stdout[-4000:]
    assert report["failures"] == [] and report["errors"] == []
    assert report["phases"]["coverage"]["status"] == "success"
    assert report["phases"]["fuzzing"]["status"] == "success"
    assert report["operations"]["tested"] == report["operations"]["total"] == 13
    assert report["test_cases"]["generated"] >= 500


def test_no_request_got_a_5xx_and_every_4xx_is_an_openai_error(fuzz: dict[str, Any]) -> None:
    statuses = {status for _, _, status in fuzz["outcomes"]}
    assert max(statuses) < 500
    generated = {s for m, p, s in fuzz["outcomes"] if p.startswith("/v1/") and m == "POST"}
    assert {200, 400} <= generated  # both paths were exercised: generation and refusal
    for entry in fuzz["entries"]:
        status = entry["response"]["status"]
        if status >= 400:
            error = response_schemas.ErrorResponse.model_validate_json(_body(entry)).error
            assert error.code == status and error.message, entry["request"]["url"]


def test_fuzzing_leaves_the_server_healthy_and_every_kv_block_free(
    fuzz: dict[str, Any], server: RemoteServer
) -> None:
    assert fuzz["report"]["test_cases"]["generated"] > 0
    assert httpx.get(server.url + "/health", timeout=10).status_code == 200
    metrics = server.metrics()
    busy = [
        v
        for k, v in metrics.items()
        if k.startswith(("vllm:kv_cache_usage_perc", "vllm:num_requests_running"))
    ]
    assert busy == [0.0, 0.0], metrics
    ok = httpx.post(server.url + "/v1/completions", json={"prompt": "Hi", "max_tokens": 3})
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 3
    assert "Traceback" not in server.log()


def test_the_schema_documents_every_request_body_from_its_model(server: RemoteServer) -> None:
    doc = httpx.get(server.url + "/openapi.json", timeout=10).json()
    bodies = {
        "/v1/completions": protocol.CompletionRequest,
        "/v1/chat/completions": protocol.ChatCompletionRequest,
        "/tokenize": protocol.TokenizeRequest,
        "/detokenize": protocol.DetokenizeRequest,
    }
    for path, model in bodies.items():
        op = doc["paths"][path]["post"]
        body = op["requestBody"]["content"]["application/json"]["schema"]
        assert body == {"$ref": f"#/components/schemas/{model.__name__}"}
        published = doc["components"]["schemas"][model.__name__]
        assert set(published["properties"]) == set(model.model_fields)
        assert published["additionalProperties"] is False  # an unknown field is a 400
        for status in ("400", "404", "413"):
            error = op["responses"][status]["content"]["application/json"]["schema"]
            assert error == {"$ref": "#/components/schemas/ErrorResponse"}
    chat_example = doc["paths"]["/v1/chat/completions"]["post"]["requestBody"]["content"]
    assert chat_example["application/json"]["example"]["messages"]  # /docs' "Try it out" body
    page = httpx.get(server.url + "/docs", timeout=10)
    assert page.status_code == 200 and "/openapi.json" in page.text


def test_unknown_paths_and_methods_get_openai_errors(server: RemoteServer) -> None:
    missing = httpx.get(server.url + "/v1/nothing-here", timeout=10)
    assert missing.status_code == 404 and missing.json()["error"]["code"] == 404
    wrong = httpx.get(server.url + "/v1/completions", timeout=10)
    assert wrong.status_code == 405 and wrong.json()["error"]["type"] == "MethodNotAllowedError"
    assert wrong.headers["allow"] == "POST"
