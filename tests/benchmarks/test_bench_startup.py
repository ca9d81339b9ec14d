"""`minivllm bench startup` times the learner's first program phase by phase, in fresh processes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from minivllm.entrypoints.cli import main
from tests.utils.engine_utils import save_tiny_llama


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_llama(tmp_path_factory.mktemp("tiny-startup"))


def test_startup_reports_each_phase_in_wall_and_cpu_seconds(tiny, tmp_path, capsys):
    out = tmp_path / "startup.json"
    argv = ["bench", "startup", "--model", str(tiny), "--repeat", "1", "--threads", "1"]
    assert main([*argv, "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["benchmark"] == "startup" and report["args"]["repeat"] == 1
    (warm,) = report["rows"]
    assert warm["runs"] == "warm" and warm["n"] == 1
    for phase in ("import", "LLM()", "first token"):
        assert warm[phase]["wall_s"] > 0 and warm[phase]["cpu_s"] > 0, phase
    total = sum(warm[p]["wall_s"] for p in ("import", "LLM()", "first token"))
    assert warm["total"]["wall_s"] == pytest.approx(total, rel=1e-6)
    assert "first text:" in capsys.readouterr().out


def test_startup_rejects_zero_runs_as_a_usage_error(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["bench", "startup", "--repeat", "0"])
    assert exc.value.code == 2
    assert "--repeat must be at least 1, got 0" in capsys.readouterr().err
