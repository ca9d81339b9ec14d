"""A configuration error on the command line is one line naming the flag, its value and what is
allowed, with exit status 2 (argparse's own `error`), never a traceback."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from minivllm.entrypoints.cli import main
from tests.utils.engine_utils import save_tiny_llama


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # max_position_embeddings=1024: the model's limit for --max-model-len
    return save_tiny_llama(tmp_path_factory.mktemp("tiny-cli"))


def _error_line(capsys: pytest.CaptureFixture[str], argv: list[str]) -> str:
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return err.strip().splitlines()[-1]


@pytest.mark.parametrize("command", ["trace", "serve"])
def test_max_num_seqs_above_token_budget_names_both_flags(tiny, tmp_path, capsys, command):
    argv = [command, str(tiny), "--max-num-seqs", "512", "--max-num-batched-tokens", "256"]
    if command == "trace":
        argv += ["--prompt", "hi", "--out", str(tmp_path)]
    line = _error_line(capsys, argv)
    assert line.startswith(f"minivllm {command}: error: "), line
    assert "--max-num-batched-tokens (256)" in line and "--max-num-seqs (512)" in line, line


@pytest.mark.parametrize("command", ["trace", "serve"])
def test_max_model_len_above_the_models_limit(tiny, tmp_path, capsys, command):
    argv = [command, str(tiny), "--max-model-len", "4096", "--num-gpu-blocks-override", "8"]
    if command == "trace":
        argv += ["--prompt", "hi", "--out", str(tmp_path)]
    line = _error_line(capsys, argv)
    assert "--max-model-len" in line and "1024" in line and "4096" in line, line


def test_sampling_flag_of_trace_is_named(tiny, tmp_path, capsys):
    line = _error_line(
        capsys, ["trace", str(tiny), "--prompt", "hi", "--out", str(tmp_path), "--n", "0"]
    )
    assert "--n" in line and "0" in line, line


def test_missing_model_is_one_line(tmp_path, capsys):
    missing = str(tmp_path / "no-such-model")
    line = _error_line(capsys, ["trace", missing, "--prompt", "hi", "--out", str(tmp_path)])
    assert missing in line, line


def test_the_installed_command_exits_2_without_traceback(tiny, tmp_path):
    """The same through a real process: what a user sees in a shell."""
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "minivllm.entrypoints.cli",
            "trace",
            str(tiny),
            "--prompt",
            "hi",
            "--out",
            str(tmp_path),
            "--max-num-seqs",
            "300",
            "--max-num-batched-tokens",
            "100",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr
    assert done.stderr.strip().splitlines()[-1].startswith("minivllm trace: error: --max-num-")


@pytest.mark.parametrize("core", ["--engine-core-process", "--no-engine-core-process"])
def test_a_kv_cache_too_small_for_max_model_len_is_one_line_from_the_core_too(tiny, capsys, core):
    # Found while the engine is built: in the engine-core process, it comes back to be reported.
    argv = ["serve", str(tiny), core, "--max-model-len", "512", "--num-gpu-blocks-override", "8"]
    line = _error_line(capsys, argv)
    assert "--max-model-len (512)" in line and "KV cache" in line, line
