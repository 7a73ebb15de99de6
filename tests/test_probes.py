"""The ceiling probe of bench/probes/mma_peak.py (templates/probe/) ends, on the CPU interpreter, exactly where its
bench's gate expects, so a probe that does less work than it is timed for fails here before it fails on a GPU; the
timeline and decoder probes' host halves."""

import numpy as np
import pytest

from mage_gen import interp
from mage_gen.census import take_census
from mage_gen.compile import compile_source
from mage_gen.render import render


@pytest.mark.parametrize("dtype, k", [("bf16", 16), ("tf32", 8)])
def test_the_mma_probe_sums_iters_times_k_products(dtype, k):
    """bench/probes/mma_peak.py: every C element equals iters · K · a · b (a and b the one value in every element)."""
    chains, iters, a, b = 3, 5, 2.0, 3.0
    kernel = compile_source(render("probe/mma_peak.cu.j2", {"THREADS": 32, "CHAINS": chains, "DTYPE": dtype}, "probe", None))
    assert sum(take_census(kernel).mma.values()) == chains

    def bits(value: float) -> int:  # bf16 twice in a word, or the fp32 word
        word = int(np.float32(value).view(np.uint32))
        return (word >> 16) * 0x10001 if dtype == "bf16" else word
    out = np.full(32 * chains * 4, np.nan, np.float32)
    interp.run(kernel.ptx, "probe", (1,), (32,), 0, [out, bits(a), bits(b), iters])
    assert out.tolist() == [iters * k * a * b] * out.size


def test_the_timeline_probe_turns_each_cta_s_clocks_into_spans_at_the_global_timer_s_rate():
    """bench/probes/gemm_sm90_timeline.py: a record of 3 CTAs at 2 GHz (2 cycles a ns), one of which ran no unit."""
    from bench.probes.gemm_sm90_timeline import phases

    stamps = np.zeros((8, 9), np.uint64)
    #             entry ns,  clocks: entry, copy, full,  loops' end, end,   end ns,        units | SM << 32, met
    stamps[0] = [1_000_000, 100, 2100, 6100, 26100, 30100, 1_000_000 + 15_000, 2 | 7 << 32, 1700]
    stamps[1] = [1_000_500, 900, 2900, 4900, 20900, 24900, 1_000_500 + 12_000, 1 | 9 << 32, 1300]
    stamps[2] = [1_000_200, 50, 0, 0, 0, 0, 0, 0, 90]  # no unit: left out
    got = phases(stamps, 3)
    assert got["ctas_with_units"] == 2 and got["distinct_sms"] == 2 and got["sm_clock_mhz"] == 2000.0
    assert got["units_per_cta"] == {"median": 1.5, "min": 1.0, "max": 2.0}
    assert got["start_after_first_us"] == {"median": 0.25, "min": 0.0, "max": 0.5}
    assert got["end_after_first_start_us"]["max"] == 15.0
    assert got["setup: entry to the threads' meeting"] == {"median": 0.5, "min": 0.2, "max": 0.8}
    assert got["setup: the meeting to the first copy"] == {"median": 0.5, "min": 0.2, "max": 0.8}
    assert got["first stage: copy to consumer 0's first full stage"] == {"median": 1.5, "min": 1.0, "max": 2.0}
    assert got["main loops: first full stage to the last loop's end"]["max"] == 10.0
    assert got["after the loops: sums and stores"]["median"] == 2.0
    assert phases(stamps, 0) == {"ctas_with_units": 0}


def test_the_decoder_layer_kernels_probe_refuses_a_way_it_does_not_have_before_it_opens_a_gpu():
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-m", "bench.probes.decoder_layer_kernels", "--tokens", "128", "--way",
                           "compile-reduce-overhead"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 2
    assert "--way takes 'eager', 'compile', 'compile-max-autotune', 'mage-gen patched" in done.stderr
    assert "Traceback" not in done.stderr
