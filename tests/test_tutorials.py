"""The tutorials run, and teach what they say: each `tutorials/0N_*.py` runs as a reader would
run it (`python tutorials/0N_*.py OUT_DIR`, in a fork of tests/utils/zygote.py, which imported the
libraries once) and its printed numbers are held to the lesson it states. Every tutorial ends
with a picture of its own run and a "TRY THIS" exercise; figures and traces are written into a temporary folder and checked (PNGs; a trace.json
and its page). The copies the docs show are committed under docs/tutorials/img/ (regenerate them
with `python tutorials/0N_*.py docs/tutorials/img`) and docs/img/trace/ (screenshots of tutorial
09's page, tests/utils/trace_screenshots.py), so the docs build never depends on this run.

Also here: the docs include the tutorials and their figures, and every line-range snippet of
library code in the docs still starts and ends on a whole definition, so a page cannot drift
silently from the code it quotes.
"""

from __future__ import annotations

import ast
import json
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from tests.utils.zygote import Zygote

ROOT = Path(__file__).resolve().parent.parent
TUTORIALS = ROOT / "tutorials"
DOCS = ROOT / "docs"
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


# The tutorials whose ranks are spawned processes that re-import the script: they run in a fresh
# interpreter. In a fork of the zygote, tutorial 16's driver could not unpickle its stage's reply,
# an object of a class the script defines ("Can't get attribute 'StageReport' on <module
# '__main__' from '.../zygote.py'>").
FRESH_INTERPRETER = {"08_tensor_parallel.py", "16_pipeline_stages.py"}
_zygote: Zygote | None = None


def _tutorial_env() -> dict[str, str]:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    env.pop("TRITON_INTERPRET", None)  # the Triton backend decides for itself, as for a reader
    return env


@pytest.fixture(scope="module", autouse=True)
def _tutorial_zygote(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """The tutorials run as forks of one process that imported their libraries once
    (tests/utils/zygote.py), not as fresh interpreters that each import them again; it ends with
    this module."""
    global _zygote
    _zygote = Zygote(_tutorial_env(), tmp_path_factory.mktemp("tutorial-output"))
    yield
    _zygote.close()
    _zygote = None


def run_tutorial(name: str, out_dir: Path, timeout: int = 300) -> str:
    """Run one tutorial as a reader would (`python tutorials/NAME OUT_DIR`, forked from the
    zygote unless FRESH_INTERPRETER); return its stdout (stderr is shown on failure)."""
    argv = [str(TUTORIALS / name), str(out_dir)]
    if name in FRESH_INTERPRETER:
        proc = subprocess.run(
            [sys.executable, *argv],
            cwd=ROOT,
            env=_tutorial_env(),
            capture_output=True,
            text=True,
            timeout=timeout,
        )
        returncode, stdout, stderr = proc.returncode, proc.stdout, proc.stderr
    else:
        assert _zygote is not None
        returncode, stdout, stderr = _zygote.run(argv, ROOT, timeout)
    assert returncode == 0, f"{name} failed:\n{stdout}\n{stderr[-4000:]}"
    assert "LESSON:" in stdout, stdout
    return stdout


def number(pattern: str, text: str) -> float:
    """The first number captured by `pattern` in `text` (percentages as fractions)."""
    match = re.search(pattern, text)
    assert match, f"{pattern!r} not found in:\n{text}"
    value = match.group(1).replace(",", "")
    return float(value.rstrip("%")) / 100 if value.endswith("%") else float(value)


def assert_png(path: Path) -> None:
    assert path.is_file(), f"{path} was not written"
    assert path.read_bytes()[:8] == PNG_MAGIC, f"{path} is not a PNG"


def assert_ends_with_a_picture_and_an_exercise(out: str, png: Path) -> None:
    assert_png(png)
    assert re.search(r"^TRY THIS: .*Predict", out, re.M), "no 'TRY THIS' exercise at the end"


def assert_trace(folder: Path) -> dict:
    """A trace the tutorial wrote: trace.json with steps, and its self-contained page."""
    trace = json.loads((folder / "trace.json").read_text())
    assert trace["steps"] and trace["sequences"]
    assert (folder / "index.html").read_text().startswith("<!doctype html>")
    return trace


# --------------------------------------------------------------------------------- the tutorials


@pytest.mark.slow
def test_01_naive_reservation_holds_fewer_token_states_than_paging(tmp_path: Path) -> None:
    out = run_tutorial("01_kv_cache_waste.py", tmp_path)
    naive = number(r"naive reservation:\s+([\d.]+%)", out)
    paged = number(r"paging \(minivllm\):\s+([\d.]+%)", out)
    assert naive < paged
    assert naive < 0.4  # the paper's Fig. 2: 20-40% for systems that reserve up front
    assert paged > 0.8  # only the tail of each request's last block is empty
    fit_naive = number(r"requests at once in this cache: naive (\d+)", out)
    fit_paged = number(r"requests at once in this cache: naive \d+, paging (\d+)", out)
    assert fit_paged > fit_naive
    assert_ends_with_a_picture_and_an_exercise(out, tmp_path / "01_kv_memory.png")


def test_02_block_tables_interleave_and_attention_is_unchanged(tmp_path: Path) -> None:
    out = run_tutorial("02_block_table.py", tmp_path)
    tables = {
        m.group(1): ast.literal_eval(m.group(2))
        for m in re.finditer(
            r"(seq \d \(request \d\)): +\d+ tokens -> block table (\[[\d, ]*\])", out
        )
    }
    a, b = "seq 1 (request 0)", "seq 2 (request 1)"  # the naming of the engine and the page
    assert set(tables) == {a, b}
    assert not set(tables[a]) & set(tables[b])  # no block is held twice
    assert tables[a] != list(range(tables[a][0], tables[a][0] + len(tables[a])))
    for empty in re.findall(r"slots for \d+ tokens, (\d+) empty", out):
        assert int(empty) < 4  # at most block_size - 1
    assert number(r"max \|difference\| = ([\d.e+-]+)", out) < 1e-5
    assert "6 of 8 blocks free again" in out
    trace = assert_trace(tmp_path / "02_trace")  # the same two requests in the engine
    engine_tables = re.search(r"in the engine, step \d+: block tables (.*)", out)[1]
    found = dict(re.findall(r"(seq \d \(request \d\)): (\[[\d, ]*\])", engine_tables))
    assert sorted(len(ast.literal_eval(t)) for t in found.values()) == [2, 3]  # 6+4, 3+4 tokens
    assert set(found) == {a, b}
    assert trace["block_size"] == 4
    assert_ends_with_a_picture_and_an_exercise(out, tmp_path / "02_block_map.png")


@pytest.mark.slow
def test_03_forks_share_blocks_until_a_write_and_prefixes_are_reused(tmp_path: Path) -> None:
    out = run_tutorial("03_copy_on_write.py", tmp_path)
    assert "reference counts [2, 2]" in out  # fork shares every block
    copies = ast.literal_eval(re.search(r"copies \(src, dst\) (\[.*?\])", out).group(1))
    assert len(copies) == 1  # copy-on-write copied only the block being written
    assert "y hit 8 of its 10" in out
    queried = number(r"(\d+) prompt tokens, \d+ served", out)
    hits = number(r"(\d+) served by the prefix cache", out)
    computed = number(r"prefix cache, (\d+) computed", out)
    assert hits > 0 and hits + computed == queried
    peak = number(r"peak (\d+) KV blocks", out)
    copies_4 = number(r"4 copies would hold (\d+)", out)
    assert peak < copies_4
    assert len(re.findall(r"sample \d: ", out)) == 4
    assert "reference counts [4]" in out  # the fork: four tables on the prompt's blocks
    trace = assert_trace(tmp_path / "03_trace")
    assert any(step["copies"] for step in trace["steps"])
    assert_ends_with_a_picture_and_an_exercise(out, tmp_path / "03_block_map.png")


@pytest.mark.slow
def test_04_continuous_batching_keeps_the_batch_fuller_and_chunks_long_prompts(
    tmp_path: Path,
) -> None:
    out = run_tutorial("04_continuous_batching.py", tmp_path)
    static_steps = number(r"static batching:\s+(\d+) steps", out)
    cont_steps = number(r"continuous batching:\s+(\d+) steps", out)
    static_busy = number(r"static batching:.*?(\d+%) of the rows", out)
    cont_busy = number(r"continuous batching:.*?(\d+%) of the rows", out)
    assert cont_steps < static_steps and cont_busy > static_busy
    chunks = [
        (int(p), int(d)) for p, d in re.findall(r"step \d: +(\d+) prompt tokens \+ (\d+) new", out)
    ]
    assert sum(p for p, _ in chunks) == 200  # the whole long prompt, in pieces
    assert all(p + d <= 64 for p, d in chunks)  # never past the token budget
    assert all(d >= 3 for p, d in chunks)  # the decodes kept going meanwhile
    trace = assert_trace(tmp_path / "04_trace")
    assert len(trace["steps"]) == cont_steps  # the continuous run, step for step
    assert re.search(r"at step \d+ a waiting request took its row", out)
    assert_ends_with_a_picture_and_an_exercise(out, tmp_path / "04_batch_occupancy.png")


@pytest.mark.slow
def test_05_sampler_truncates_matches_softmax_and_seeds_ignore_the_batch(tmp_path: Path) -> None:
    out = run_tutorial("05_sampler.py", tmp_path)
    temps = [
        number(rf"temperature {t}: P\(most likely token\) = ([\d.]+)", out)
        for t in ["0.5", "1.0", "2.0"]
    ]
    assert temps[0] > temps[1] > temps[2]  # a lower temperature sharpens
    assert "top_k=2: 2 of 6 tokens" in out
    assert number(r"max gap ([\d.]+)", out) < 0.02
    assert re.search(r"1\. ' Paris'", out), out  # greedy knowledge of the real model
    alone = re.search(r"seed 1234 alone: +(.*)", out).group(1)
    in_batch = re.search(r"seed 1234 in a batch: +(.*)", out).group(1)
    assert alone == in_batch
    assert_ends_with_a_picture_and_an_exercise(out, tmp_path / "05_sampler.png")


def test_06_triton_kernels_match_the_reference(tmp_path: Path) -> None:
    out = run_tutorial("06_paged_attention.py", tmp_path)
    errors = [float(e) for e in re.findall(r"max \|reference - triton\| = ([\d.e+-]+)", out)]
    assert len(errors) == 2 and max(errors) < 1e-4
    # On a CPU the tutorial also checks the compiled CPU decode kernel against the reference.
    if not torch.cuda.is_available():
        assert float(re.search(r"max \|reference - cpu\| = ([\d.e+-]+)", out)[1]) < 1e-4
    assert_ends_with_a_picture_and_an_exercise(out, tmp_path / "06_block_tables.png")


@pytest.mark.slow
def test_07_openai_client_talks_to_minivllm_serve(tmp_path: Path) -> None:
    out = run_tutorial("07_serving.py", tmp_path)
    assert "GET /v1/models -> SmolLM2-135M-Instruct" in out
    assert re.search(r"POST /v1/completions -> '.+' \(finish_reason 'length'\)", out)
    assert number(r"stream=True -> (\d+) chunks", out) > 1
    assert "top_p=1.5 -> HTTP 400: 'top_p must be in (0, 1]" in out
    assert number(r"generation_tokens_total\{[^}]*\} ([\d.]+)", out) > 0
    assert "server stopped" in out
    assert_ends_with_a_picture_and_an_exercise(out, tmp_path / "07_stream.png")


@pytest.mark.slow
def test_09_the_trace_shows_a_shared_prefix_a_preemption_and_a_copy_on_write(
    tmp_path: Path,
) -> None:
    """The walk-through's events are in its trace, and its page is the one the docs' screenshots
    show (taken here in Chromium, as tests/utils/trace_screenshots.py takes the committed ones)."""
    out = run_tutorial("09_watch_the_scheduler.py", tmp_path)
    trace = assert_trace(tmp_path / "09_trace")
    for event in ("cache_hits", "preempted", "forked", "copies", "finished"):
        assert any(step[event] for step in trace["steps"]), event
    assert re.search(r"blocks \[[\d, ]+\] are held twice \(reference count 2\)", out)
    assert re.search(r"was preempted;\s+at step \d+ it resumed and took \d+ of its tokens", out)
    preemptions = sum(len(step["preempted"]) for step in trace["steps"])
    assert f"preempted {preemptions} times" in out  # the LESSON counts the run's preemptions
    assert re.search(r"first scheduled at step \d+: its two samples need 2 of the 4 rows", out)
    assert re.search(r"shared block \d+, partly filled; the first to write got a copy", out)
    assert_ends_with_a_picture_and_an_exercise(out, tmp_path / "09_block_map.png")

    from tests.utils.trace_screenshots import SHOTS, take_screenshots

    shots = take_screenshots(tmp_path / "09_trace", tmp_path / "shots")
    assert set(shots) == set(SHOTS)
    for path in shots.values():
        assert_png(path)


@pytest.mark.slow
def test_10_beams_share_blocks_fork_copy_and_prune(tmp_path: Path) -> None:
    out = run_tutorial("10_beam_search.py", tmp_path)
    held = number(r"blocks held on average: ([\d.]+)", out)
    separate = number(r"without sharing ([\d.]+)", out)
    assert 0 < held < separate
    assert re.search(r"beam +\d+: \[\d+\*4", out)  # a block shared by all four beams
    assert number(r"copy-on-write copies: (\d+)", out) > 0
    assert len(re.findall(r"^  +-?[\d.]+  '", out, re.M)) == 4  # four beams, with scores
    # A dip to one block happens or not with the model's logits (the CPU's dot product): the
    # tutorial says which, with the step.
    assert re.search(
        r"a dip to one block: all 4 survivors of step \d+ extend the same parent"
        r"|no dip to one block in this run: the fewest blocks .* were \d+, at step \d+",
        out,
    )
    picture = re.search(r"^picture: (.*)$", out, re.M)[1]
    assert Path(picture).is_absolute()  # a path the reader can open from anywhere
    assert_ends_with_a_picture_and_an_exercise(out, tmp_path / "10_beam_blocks.png")


def test_11_a_schema_masks_the_vocabulary_and_the_output_parses(tmp_path: Path) -> None:
    out = run_tutorial("11_structured_outputs.py", tmp_path)
    counts = [int(c) for c in re.findall(r"step \d+: +(\d+) of 49152 tokens allowed", out)]
    assert len(counts) == 8 and min(counts) < 10 and max(counts) > 1000  # joints and free text
    assert re.search(r"compiled once in [\d.]+ ms", out)
    assert re.search(r"^constrained: '\{", out, re.M)  # the tutorial itself json.loads it
    assert_ends_with_a_picture_and_an_exercise(out, tmp_path / "11_mask_sizes.png")


@pytest.mark.slow
def test_12_paging_sustains_a_higher_rate_than_reservations(tmp_path: Path) -> None:
    out = run_tutorial("12_why_paging_wins.py", tmp_path)
    paged = number(r"paged serves ([\d.]+) req/s", out)
    oracle = number(r"orca-oracle ([\d.]+) and", out)
    orca_max = number(r"orca-max ([\d.]+)\.", out)
    assert paged > oracle > orca_max
    assert_ends_with_a_picture_and_an_exercise(out, tmp_path / "12_why_paging_wins.png")


@pytest.mark.slow
def test_13_copy_prompts_keep_most_drafts_and_the_text_is_unchanged(tmp_path: Path) -> None:
    out = run_tutorial("13_speculative_decoding.py", tmp_path)  # it asserts the text unchanged
    runs = {
        name: (int(tokens), int(steps), int(kept) / 100)
        for name, tokens, steps, kept in re.findall(
            r"^(copy|new): (\d+) tokens in (\d+) steps;.* kept \((\d+)%\)", out, re.M
        )
    }
    tokens, steps, kept = runs["copy"]
    assert kept > 0.5 and steps < tokens / 2  # several tokens per step where the output copies
    assert runs["new"][0] / runs["new"][1] < tokens / steps  # a new text: fewer tokens per step
    assert_ends_with_a_picture_and_an_exercise(out, tmp_path / "13_acceptance.png")


@pytest.mark.slow
def test_14_adapters_share_steps_by_slot_the_lru_evicts_and_each_answers_its_own(
    tmp_path: Path,
) -> None:
    out = run_tutorial("14_lora_adapters.py", tmp_path)  # it asserts the merged-weight answers
    one, two = (number(rf"max_loras={n}: (\d+) steps", out) for n in (1, 2))
    assert two < one  # two slots: chat need not wait for sql's requests
    assert re.search(
        r"step 1: rows \(adapter@slot\) sql@0, sql@0, base@-1; slots \{'0': 'sql'\}", out
    )
    assert re.search(r"rows \(adapter@slot\) chat@0; slots \{'0': 'chat'\}", out)  # the LRU's turn
    assert "sql@0, chat@1, sql@0, base@-1" in out  # one step, two adapters
    assert "chat was evicted from slot 1" in out  # sql was touched since: chat is the LRU
    assert len(re.findall(r"= transformers with it merged: True", out)) == 4
    assert_ends_with_a_picture_and_an_exercise(out, tmp_path / "14_lora_slots.png")


@pytest.mark.slow
def test_15_embeddings_equal_sentence_transformers_and_the_query_ranks_first(
    tmp_path: Path,
) -> None:
    out = run_tutorial("15_embeddings.py", tmp_path)  # it asserts the agreement and the ranking
    assert number(r"cosine >= ([\d.]+)", out) >= 0.99999
    assert "chunked prefill off" in out
    assert number(r"KV blocks: (\d+)", out) == 0  # an encoder-only model holds none
    assert re.search(r"^  1\. 1\.000  'where do cats sleep'", out, re.M)
    assert_ends_with_a_picture_and_an_exercise(out, tmp_path / "15_ranking.png")


def test_08_two_ranks_hold_half_the_model_each_and_give_the_same_tokens(tmp_path: Path) -> None:
    out = run_tutorial("08_tensor_parallel.py", tmp_path)
    ranks = re.findall(
        r"rank (\d): weights ([\d.]+) MiB, KV cache ([\d.]+) MiB .*?, all-reduce ([\d,]+) B", out
    )
    (one, *two) = [(float(w), float(kv), float(ar.replace(",", ""))) for _, w, kv, ar in ranks]
    assert len(two) == 2
    for weights, kv, all_reduce in two:
        assert weights == pytest.approx(one[0] / 2, rel=0.01)  # only the norms are whole
        assert kv == one[1] / 2  # one of the two KV heads per rank, in as many blocks
        assert all_reduce == number(r"= ([\d,]+) B per token", out)  # no recomputation here
    assert one[2] == 0  # one rank: no collective at all
    assert "outputs equal at tensor_parallel_size 1 and 2: True" in out
    assert_ends_with_a_picture_and_an_exercise(out, tmp_path / "08_shards.png")


@pytest.mark.slow
def test_16_two_stages_hold_their_own_layers_and_kv_send_hidden_and_residual_same_tokens(
    tmp_path: Path,
) -> None:
    out = run_tutorial("16_pipeline_stages.py", tmp_path)  # it asserts the bytes sent add up
    one = re.search(
        r"one process \((\d+)\) holds layers 0\.\.4, (.*?); KV cache \[(.*?)\], ([\d,]+) B", out
    )
    assert one and one[2] == "embed_tokens, norm, lm_head", out
    stages = re.findall(
        r"stage (\d) \(pid (\d+)\): layers (\d)\.\.(\d), (.*?); KV cache \[(.*?)\], ([\d,]+) B", out
    )
    # vLLM's split of 5 layers: the odd one to the stage before the last.
    assert [(s[0], s[2], s[3], s[4]) for s in stages] == [
        ("0", "0", "2", "embed_tokens"),
        ("1", "3", "4", "norm, lm_head"),
    ]
    assert stages[0][1] == one[1] != stages[1][1]  # stage 0 is the driver; stage 1 its own process
    one_shape = [int(x) for x in one[3].split(", ")]
    one_block = int(one[4].replace(",", ""))
    for _, _, first, last, _, shape, block in stages:
        layers = int(last) - int(first) + 1
        assert [int(x) for x in shape.split(", ")] == [layers, *one_shape[1:]]  # its layers only
        assert int(block.replace(",", "")) == one_block * layers // 5
    assert re.search(r"step 1 \(prompts\): hidden \[48, 64\] \+ residual \[48, 64\] float32", out)
    assert re.search(r"step 2 \(decode\): hidden \[3, 64\] \+ residual \[3, 64\] float32", out)
    # 12 + 16 + 20 prompt tokens, then 3 requests x 5 decode steps (the 6th token is sampled from
    # the 5th step's logits), each token 2 x 64 floats; nothing sent on from the last stage.
    assert "stage 0 sent 32,256 B in all = 63 tokens" in out
    assert "stage 1 sent 0 B" in out
    assert "greedy outputs equal with 1 and 2 stages: True" in out
    assert_ends_with_a_picture_and_an_exercise(out, tmp_path / "16_pipeline_stages.png")


# ------------------------------------------------------------------------- the docs quote them


def test_every_tutorial_is_run_here_and_shown_in_the_docs() -> None:
    tutorials = sorted(p.name for p in TUTORIALS.glob("[0-9][0-9]_*.py"))
    assert len(tutorials) >= 10
    tested = Path(__file__).read_text()
    docs = "\n".join(p.read_text() for p in DOCS.rglob("*.md"))
    for name in tutorials:
        assert f'"{name}"' in tested, f"{name} is not run by this file"
        assert f'--8<-- "tutorials/{name}"' in docs, f"{name} is not included in the docs"


def test_docs_figures_are_committed_and_are_the_tutorials_figures() -> None:
    shown = set(
        re.findall(r"img/([\w.-]+\.png)", "\n".join(p.read_text() for p in DOCS.rglob("*.md")))
    )
    written = set(
        re.findall(
            r'OUT / "([\w.-]+\.png)"', "\n".join(p.read_text() for p in TUTORIALS.glob("*.py"))
        )
    )
    assert shown and shown <= written, f"docs show figures no tutorial writes: {shown - written}"
    for name in shown:
        assert_png(DOCS / "tutorials" / "img" / name)


def test_docs_screenshots_of_the_trace_page_are_committed_and_are_the_ones_the_tests_take() -> None:
    from tests.utils.trace_screenshots import SHOTS

    pages = "\n".join(p.read_text() for p in DOCS.rglob("*.md"))
    shown = set(re.findall(r"img/trace/([\w.-]+\.png)", pages))
    assert shown == set(SHOTS), "every screenshot is shown, and only those the tests take"
    for name in shown:
        assert_png(DOCS / "img" / "trace" / name)


def test_every_quoted_definition_exists_and_is_quoted_whole() -> None:
    """The docs quote library code under `<!-- def: Name -->`; the code_refs hook gives each
    quote the definition's current line range at build time. Every name must resolve, and after
    resolution each quote must start at the definition (or its decorator) and end with it."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("code_refs", DOCS / "hooks" / "code_refs.py")
    assert spec and spec.loader
    hooks = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(hooks)
    quoted = 0
    for page in sorted(DOCS.rglob("*.md")):
        text = page.read_text()
        ranges = re.findall(r'--8<-- "minivllm/[^"]*:\d+:\d+"', text)
        named = hooks.QUOTE.findall(text)
        assert len(named) == len(ranges), f"{page.name}: a line-range snippet has no def comment"
        resolved = hooks.resolve_quotes(text)
        for m in hooks.QUOTE.finditer(resolved):
            quoted += 1
            start, end = (int(x) for x in re.findall(r":(\d+):(\d+)\"$", m.group(0))[0])
            lines = (ROOT / m["path"]).read_text().splitlines()
            first = lines[start - 1].strip()
            leaf = m["name"].split(".")[-1]
            assert first.startswith("@") or f" {leaf}" in first, (page.name, m["name"], first)
            assert end <= len(lines)
    assert quoted, "no quoted definition found: did the docs stop quoting the code?"
