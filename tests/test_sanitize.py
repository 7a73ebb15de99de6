"""bench/sanitize.py without a GPU (--list): the committed tensor-core winners rebuilt on a smaller grid for the
slow sanitizer tools, and refused where their tiles would not divide it."""

import re
import subprocess
import sys

SCRIPT = ["-m", "bench.sanitize", "--gpu", "NVIDIA H200", "--op", "matmul_tc", "--list"]


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *SCRIPT, *args], capture_output=True, text=True, timeout=300)


def test_a_smaller_grid_builds_each_winner_at_it_with_k_as_tuned():
    full, small = run(), run("--grid", "512,512")
    assert full.returncode == small.returncode == 0, small.stderr
    names = re.findall(r"matmul_tc_\S+", full.stdout)
    assert names and len(names) == len(re.findall(r"matmul_tc_\S+", small.stdout))
    for name in names:  # m and n replaced, k and every param kept
        assert re.sub(r"_m\d+_n\d+_", "_m512_n512_", name) in small.stdout


def test_a_grid_the_tiles_do_not_divide_is_refused_per_winner():
    result = run("--grid", "512,100")
    assert result.returncode == 1
    assert "do not divide it (the copies would be guarded: other code)" in result.stdout
    assert "--grid" in run("--grid", "512").stderr and run("--grid", "512").returncode == 2
