"""``scripts/gpu-check --device cpu``: the short CPU version of the GPU check runs every part
a CPU can run, and its report has the structure that a GPU run's will have; so the check
cannot rot between the tasks that are lent a GPU. A one-rank gloo group stands in for NCCL in
the communicator's part.

Slow tier: each run starts a fresh interpreter (torch, torch._dynamo) and trains many small
simulated runs (about 20 s of CPU time for the whole check, a minute or more of wall-clock
on a busy machine).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PARTS = ["environment", "parity", "compress", "nccl", "amp", "compile", "memory", "sim64"]
pytestmark = pytest.mark.slow


def _check(out: Path, *args: str) -> tuple[subprocess.CompletedProcess, dict]:
    # generous limits: a busy CI machine may be several times slower than the budget assumes
    result = subprocess.run(
        ["bash", str(ROOT / "scripts" / "gpu-check"), "--device", "cpu", "--out", str(out),
         "--budget", "1200", "--part-time", "600", *args],
        cwd=ROOT, capture_output=True, text=True, timeout=1300,
        env=_python_env())
    assert (out / "report.json").is_file(), result.stdout[-3000:] + result.stderr[-3000:]
    return result, json.loads((out / "report.json").read_text())


def _python_env() -> dict[str, str]:
    import os

    return {**os.environ, "PYTHON": sys.executable}  # this interpreter, whatever PATH says


def test_the_cpu_version_runs_every_part_and_reports_it(tmp_path):
    result, report = _check(tmp_path / "report")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert report["device"] == "cpu" and report["finished"]
    assert report["seconds"] <= report["budget"]
    parts = {p["name"]: p for p in report["parts"]}
    assert list(parts) == PARTS
    for name, part in parts.items():
        assert set(part) == {"name", "status", "seconds", "summary", "checks", "data", "error"}
        if name == "nccl":
            assert part["status"] == "skipped" and "CUDA" in part["summary"]
            continue
        assert part["status"] == "passed", (name, part["error"], part["checks"])
        assert part["summary"] and part["seconds"] > 0
        for check in part["checks"]:
            assert check["ok"] in (True, None), (name, check)
    assert report["skipped"] == [{"part": "nccl", "reason": parts["nccl"]["summary"]}]
    # what each part measured, by the keys a GPU run's report will have
    from gossamer.algorithms import available

    assert set(parts["parity"]["data"]["methods"]) == set(available())
    assert {"floor", "dgc", "qsgd", "powersgd", "torch-powersgd"} \
        <= set(parts["compress"]["data"]["rows"])
    assert [c["ok"] for c in parts["compress"]["checks"]] == [None] * 3  # a GPU's limits
    assert set(parts["compile"]["data"]["methods"]) == {"allreduce", "diloco", "sgp"}
    assert set(parts["memory"]["data"]["methods"]) == {"adamw", *available()}
    assert parts["sim64"]["data"]["ratio"] > 0
    markdown = (tmp_path / "report" / "report.md").read_text()
    assert markdown.startswith("# GPU check: CPU")
    for name in PARTS:
        assert f"\n| {name} | " in markdown


def test_the_communicator_part_runs_on_gloo(tmp_path):
    result, report = _check(tmp_path / "report", "--parts", "nccl", "--comm-backend", "gloo")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    (part,) = report["parts"]
    assert part["status"] == "passed", (part["error"], part["checks"])
    assert part["data"]["backend"] == "gloo"
    assert {"all_reduce sum", "all_reduce_async", "all_gather", "broadcast", "barrier",
            "exchange", "subgroup all_reduce"} <= set(part["data"]["ran"])


def test_a_part_out_of_time_is_stopped_and_the_rest_skipped(tmp_path):
    # parity takes seconds: stopped after 1; then less than MIN_START (5 s) is left
    result, report = _check(tmp_path / "report", "--parts", "parity", "compress",
                            "--part-time", "1", "--budget", "5.5")
    assert result.returncode == 1
    parity, compress = report["parts"]
    assert parity["status"] == "timeout" and parity["seconds"] < 5, parity
    assert compress["status"] == "skipped" and "budget" in compress["summary"]
    assert report["skipped"] == [{"part": "compress", "reason": compress["summary"]}]
