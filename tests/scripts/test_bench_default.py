"""scripts/benchmarks/bench_default.py: each command in its own process, its usage recorded, a failing one stopping the
benchmark with the log to read (no conversion)."""

from __future__ import annotations

import os
import re

import pytest

from file_modules import import_file

bench = import_file("scripts/benchmarks/bench_default.py")


def test_a_command_is_timed_in_its_own_process(tmp_path):
    usage = bench.run(["normswap", "plan", "--help"], dict(os.environ), tmp_path / "plan.log")
    assert set(usage) == {"wall_s", "cpu_s", "peak_rss_mb"}
    assert usage["cpu_s"] > 0 and usage["peak_rss_mb"] > 0
    assert "usage:" in (tmp_path / "plan.log").read_text()


def test_a_failing_command_stops_the_benchmark_naming_its_log(tmp_path):
    log = tmp_path / "convert.log"
    command = ["normswap", "convert", str(tmp_path / "absent"), "--to", "eln", "--output", str(tmp_path / "out")]
    with pytest.raises(SystemExit, match=rf"exited [1-9]\d*; see {re.escape(str(log))}$"):
        bench.run(command, dict(os.environ), log)
    assert log.read_text()
