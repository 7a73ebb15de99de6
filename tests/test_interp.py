"""The PTX interpreter: every op family's generated variants compute what the float64 reference does
on the CPU, and what a GPU would leave undefined (out-of-bounds access, shared-memory race, stale
cp.async data, unknown instruction) is reported with the instruction, thread and address."""

import dataclasses
import random
import re
import subprocess
import sys
from fractions import Fraction
from functools import cache

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mage_gen import interp
from mage_gen.interp.fp import fma_f32
from mage_gen.verdict import relative_error
from mage_gen.ops import get_op
from mage_gen.ops.layernorm import Params as LnParams
from mage_gen.ops.matmul import Params as MmParams
from mage_gen.space import draw, expand, load_space
from mage_gen.variants import build

LN = get_op("layernorm")
MM = get_op("matmul")
# a grid given per SM in the space (grid_cap "4/SM") sized as on an H200, the GPU of tuned/: any count would do
SMS = 132


@cache
def mm_valid(m: int, n: int, k: int) -> tuple:
    valid, _ = expand(MM, MM.shape(m=m, n=n, k=k), load_space(MM, "explore"))
    return tuple(valid)


# ---- generated variants against the float64 reference ----

@settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_layernorm_variants_match_the_reference_on_the_cpu(data):
    d = data.draw(st.one_of(st.integers(1, 1024), st.sampled_from([768, 1000, 1024])), label="d")
    params = draw(LN, LN.shape(d=d), load_space(LN, "full", sms=SMS),
                  random.Random(data.draw(st.integers(0, 2**32 - 1), label="params seed")))
    if params is None:
        return
    m = data.draw(st.integers(1, 3), label="M")
    shape = LN.shape(d=d)
    variant = build(LN, shape, params, "sm_90")
    rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1), label="seed"))
    err = interp.worst_error(LN, shape, variant, {"m": m}, rng, runs=[{"m": m}])
    assert err <= LN.tolerance, f"{params.label()} at d={d}, M={m}: relative error {err:.3g}"


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_matmul_variants_match_the_reference_on_the_cpu(data):
    dims = st.one_of(st.integers(1, 96), st.sampled_from([64, 128]))  # the interpreter's cost grows as m·n·k
    m, k = data.draw(dims, label="m"), data.draw(dims, label="k")
    n = data.draw(st.one_of(st.integers(1, 32).map(lambda x: 4 * x), st.sampled_from([64, 128])), label="n")
    valid = mm_valid(m, n, k)
    if not valid:
        return
    params = data.draw(st.sampled_from(valid), label="params")
    shape = MM.shape(m=m, n=n, k=k)
    variant = build(MM, shape, params, "sm_90")
    result = interp.gate(MM, shape, variant, {}, np.random.default_rng(data.draw(st.integers(0, 2**32 - 1))))
    assert result.passed, f"{params.label()} at {shape}: {result.reason}"


@pytest.mark.parametrize("dims", [(64, 64, 64), (100, 72, 40)])
@pytest.mark.parametrize("bug", ["offset_units", "last_tile_parity"])
def test_each_planted_pipeline_bug_is_caught_on_the_cpu(dims, bug):
    m, n, k = dims
    shape = MM.shape(m=m, n=n, k=k)
    for params in (mm_valid(m, n, k)[0], mm_valid(m, n, k)[-1]):
        variant = build(MM, shape, dataclasses.replace(params, plant=bug), "sm_90")
        result = interp.gate(MM, shape, variant, {}, np.random.default_rng(0))
        assert not result.passed, f"{params.label()} with {bug} passed"
        assert re.search(r"relative error|NaN|cp\.async|race", result.reason), result.reason


@pytest.mark.parametrize("params, wait, barriers", [
    (MmParams(bm=32, bn=64, bk=8, tm=4, tn=4, buffers=2), 1, 3),  # two barriers per K tile: wait_group(1)
    (MmParams(bm=32, bn=64, bk=8, tm=4, tn=4, buffers=2, sync="one"), 0, 2),  # one: wait_group(buffers - 2)
    (MmParams(bm=32, bn=64, bk=8, tm=4, tn=4, buffers=3, sync="one"), 1, 2),
])
def test_a_matmul_passes_and_one_wait_less_is_reported_as_a_stale_read(params, wait, barriers):
    shape = MM.shape(m=64, n=64, k=64)
    variant = build(MM, shape, params, "sm_90")
    assert interp.gate(MM, shape, variant, {}, np.random.default_rng(0)).passed
    ptx = variant.compiled.ptx
    assert f"cp.async.wait_group {wait};" in ptx and ptx.count("bar.sync 0;") == barriers
    # The main loop's wait comes first in the PTX (with 2 buffers and one barrier the drain's is also 0).
    weak = ptx.replace(f"cp.async.wait_group {wait};", f"cp.async.wait_group {wait + 1};", 1)
    broken = dataclasses.replace(variant, compiled=dataclasses.replace(variant.compiled, ptx=weak))
    with pytest.raises(interp.StaleReadError, match=r"reads shared address 0x[0-9a-f]+ while a cp\.async of thread"):
        interp.run_once(MM, shape, broken, {}, np.random.default_rng(0))


def test_a_deleted_barrier_is_reported_as_a_race():
    shape = LN.shape(d=1024)
    params = LnParams(template="row", threads=128, vector=16)  # 4 warps per row: partial sums via shared
    variant = build(LN, shape, params, "sm_90")
    lines = variant.compiled.ptx.splitlines(keepends=True)
    first = next(i for i, line in enumerate(lines) if line.strip() == "bar.sync 0;")
    broken = dataclasses.replace(variant, compiled=dataclasses.replace(
        variant.compiled, ptx="".join(lines[:first] + ["\n"] + lines[first + 1:])))
    assert interp.worst_error(LN, shape, variant, {"m": 2}, np.random.default_rng(0), runs=[{"m": 2}]) < 1e-5
    with pytest.raises(interp.RaceError, match=r"shared-memory race at shared address 0x[0-9a-f]+: "
                                               r"thread \(\d+,0,0\) of block \(0,0,0\) reads bytes that "
                                               r"thread \(\d+,0,0\) of block \(0,0,0\) wrote"):
        interp.worst_error(LN, shape, broken, {"m": 2}, np.random.default_rng(0), runs=[{"m": 2}])


# ---- hand-written PTX ----

def kernel(body: str, params: str = ".param .u64 out", regs: str = "", shared: str = "") -> str:
    return f"""
.version 9.0
.target sm_90
.address_size 64
{shared}
.visible .entry k({params})
{{
    .reg .pred %p<8>;
    .reg .b32 %r<32>;
    .reg .f32 %f<32>;
    .reg .b64 %rd<32>;
    {regs}
{body}
}}
"""


STORE_TID = """
    ld.param.u64 %rd1, [out];
    mov.u32 %r1, %tid.x;
    mul.wide.u32 %rd2, %r1, 4;
    add.s64 %rd3, %rd1, %rd2;
    st.global.u32 [%rd3], %r1;
    ret;
"""


def test_a_launch_writes_its_output_in_place():
    out = np.zeros(64, dtype=np.uint32)
    interp.run(kernel(STORE_TID), "k", 1, 64, 0, [out])
    assert (out == np.arange(64)).all()


def test_an_out_of_bounds_store_names_the_thread_and_the_address():
    out = np.zeros(40, dtype=np.uint32)
    with pytest.raises(interp.MemoryFault) as info:
        interp.run(kernel(STORE_TID), "k", 1, 64, 0, [out])
    message = str(info.value)
    assert "st.global.u32" in message and "line " in message
    assert "thread (40,0,0) of block (0,0,0)" in message
    base = int(re.search(r"global address (0x[0-9a-f]+)", message).group(1), 16)
    assert "outside every buffer" in message and base % 4 == 0


def test_an_unknown_instruction_is_named_with_its_line():
    ptx = kernel(STORE_TID.replace("st.global.u32", "popc.b32 %r2, %r1;\n    st.global.u32"))
    with pytest.raises(interp.UnknownInstruction, match=r"line \d+: popc\.b32"):
        interp.run(ptx, "k", 1, 32, 0, [np.zeros(32, dtype=np.uint32)])


CP_ASYNC = """
    ld.param.u64 %rd1, [out];
    ld.param.u64 %rd2, [src];
    mov.u32 %r1, %tid.x;
    mul.wide.u32 %rd3, %r1, 16;
    add.s64 %rd4, %rd2, %rd3;
    mov.u64 %rd5, smem;
    cvt.u32.u64 %r2, %rd5;
    shl.b32 %r3, %r1, 4;
    add.s32 %r4, %r2, %r3;
    cp.async.cg.shared.global [%r4], [%rd4], 16, %r9;
    cp.async.commit_group;
    {wait}
    ld.shared.v4.f32 {{%f1, %f2, %f3, %f4}}, [%r4];
    add.s64 %rd6, %rd1, %rd3;
    st.global.v4.f32 [%rd6], {{%f1, %f2, %f3, %f4}};
    ret;
"""


def cp_async_kernel(wait: str, src_size: str = "16") -> str:
    body = CP_ASYNC.format(wait=wait).replace("%r9", src_size)
    return kernel(body, ".param .u64 out, .param .u64 src", shared=".extern .shared .align 16 .b8 smem[];")


def test_cp_async_at_a_negative_offset_reads_below_its_base():
    body = CP_ASYNC.format(wait="cp.async.wait_group 0;").replace(
        "add.s64 %rd4, %rd2, %rd3;", "add.s64 %rd4, %rd2, %rd3;\n    add.s64 %rd4, %rd4, 16;").replace(
        "[%rd4], 16, %r9;", "[%rd4+-16], 16, 16;")
    src = np.arange(128, dtype=np.float32) + 1
    out = np.full(128, np.nan, dtype=np.float32)
    interp.run(kernel(body, ".param .u64 out, .param .u64 src", shared=".extern .shared .align 16 .b8 smem[];"),
               "k", 1, 32, 32 * 16, [out, src])
    assert (out == src).all()


def test_mad_wide_adds_all_64_bits_of_its_addend():
    body = """
    ld.param.u64 %rd1, [out];
    mov.u32 %r1, %tid.x;
    mad.wide.u32 %rd2, %r1, 4, %rd1;
    st.global.u32 [%rd2], %r1;
    ret;
"""
    out = np.zeros(32, dtype=np.uint32)  # its address lies above 2^32 in the interpreter's global space
    interp.run(kernel(body), "k", 1, 32, 0, [out])
    assert (out == np.arange(32)).all()


def test_a_sink_in_a_vector_load_writes_no_register():
    body = """
    ld.param.u64 %rd1, [out];
    mov.u32 %r1, %tid.x;
    mul.wide.u32 %rd2, %r1, 8;
    add.s64 %rd3, %rd1, %rd2;
    mov.u32 %r31, 99;
    ld.global.v2.u32 {%r2, _}, [%rd3];
    st.global.v2.u32 [%rd3], {%r2, %r31};
    ret;
"""
    out = np.arange(64, dtype=np.uint32)
    interp.run(kernel(body), "k", 1, 32, 0, [out])
    assert (out[0::2] == np.arange(0, 64, 2)).all() and (out[1::2] == 99).all()


def test_ftz_flushes_comparisons_and_immediate_only_results():
    body = """
    ld.param.u64 %rd1, [out];
    mov.u32 %r1, %tid.x;
    mul.wide.u32 %rd2, %r1, 4;
    add.s64 %rd3, %rd1, %rd2;
    mov.b32 %f1, 0f00000001;
    setp.gt.ftz.f32 %p1, %f1, 0f00000000;
    selp.u32 %r2, 1, 2, %p1;
    add.ftz.f32 %f2, 0f3F800000, 0f3F800000;
    setp.lt.u32 %p2, %r1, 16;
    @%p2 ld.global.f32 %f2, [%rd3];
    mov.b32 %r3, %f2;
    add.s32 %r2, %r2, %r3;
    st.global.u32 [%rd3], %r2;
    ret;
"""
    out = np.zeros(32, dtype=np.uint32)
    interp.run(kernel(body), "k", 1, 32, 0, [out])
    two = int(np.float32(2).view(np.uint32))
    assert (out[:16] == 2).all() and (out[16:] == 2 + two).all()


@pytest.mark.parametrize("wait", ["", "cp.async.wait_group 1;"])
def test_reading_cp_async_data_before_its_wait_is_a_stale_read(wait):
    src = np.arange(128, dtype=np.float32)
    out = np.full(128, np.nan, dtype=np.float32)
    with pytest.raises(interp.StaleReadError, match=r"thread \(0,0,0\) of block \(0,0,0\) reads shared address "
                                                    r"0x0 while a cp\.async"):
        interp.run(cp_async_kernel(wait), "k", 1, 32, 32 * 16, [out, src])


def test_cp_async_lands_at_its_wait_and_zero_fills_past_src_size():
    src = np.arange(128, dtype=np.float32) + 1
    out = np.full(128, np.nan, dtype=np.float32)
    interp.run(cp_async_kernel("cp.async.wait_group 0;"), "k", 1, 32, 32 * 16, [out, src])
    assert (out == src).all()
    interp.run(cp_async_kernel("cp.async.wait_all;", src_size="8"), "k", 1, 32, 32 * 16, [out, src])
    expect = src.reshape(32, 4).copy()
    expect[:, 2:] = 0
    assert (out == expect.reshape(-1)).all()


def test_shared_memory_starts_as_nan():
    body = """
    ld.param.u64 %rd1, [out];
    mov.u32 %r1, %tid.x;
    mov.u64 %rd5, smem;
    mul.wide.u32 %rd2, %r1, 4;
    add.s64 %rd6, %rd5, %rd2;
    ld.shared.f32 %f1, [%rd6];
    add.s64 %rd3, %rd1, %rd2;
    st.global.f32 [%rd3], %f1;
    ret;
"""
    out = np.zeros(32, dtype=np.float32)
    interp.run(kernel(body, shared=".shared .align 4 .b8 smem[128];"), "k", 1, 32, 0, [out])
    assert np.isnan(out).all()


def test_generic_addresses_reach_shared_and_global_memory():
    body = """
    ld.param.u64 %rd1, [out];
    cvta.to.global.u64 %rd1, %rd1;
    mov.u32 %r1, %tid.x;
    mul.wide.u32 %rd2, %r1, 4;
    mov.u64 %rd5, smem;
    cvta.shared.u64 %rd6, %rd5;
    add.s64 %rd7, %rd6, %rd2;
    cvt.rn.f32.u32 %f1, %r1;
    st.f32 [%rd7], %f1;
    bar.sync 0;
    xor.b32 %r2, %r1, 1;
    mul.wide.u32 %rd8, %r2, 4;
    add.s64 %rd9, %rd6, %rd8;
    ld.f32 %f2, [%rd9];
    cvta.to.shared.u64 %rd10, %rd9;
    ld.shared.f32 %f3, [%rd10];
    add.f32 %f4, %f2, %f3;
    add.s64 %rd3, %rd1, %rd2;
    st.f32 [%rd3], %f4;
    ret;
"""
    out = np.zeros(64, dtype=np.float32)
    interp.run(kernel(body, shared=".shared .align 4 .b8 smem[256];"), "k", 1, 64, 0, [out])
    assert (out == 2 * (np.arange(64) ^ 1)).all()


# warp 0 stores its tids to shared and global memory and arrives at barrier 1 (bar.arrive: it does not wait); warp 1
# waits there (bar.sync), then reads warp 0's words from both (the membar makes the interpreter track what each
# thread sees of global memory)
ARRIVE_THEN_READ = """
    ld.param.u64 %rd1, [out];
    ld.param.u64 %rd9, [seen];
    mov.u32 %r1, %tid.x;
    mov.u64 %rd5, smem;
    and.b32 %r2, %r1, 31;
    mul.wide.u32 %rd2, %r2, 4;
    add.s64 %rd6, %rd5, %rd2;
    add.s64 %rd3, %rd1, %rd2;
    shr.u32 %r3, %r1, 5;
    setp.ne.u32 %p1, %r3, 0;
    @%p1 bra WAIT;
    cvt.rn.f32.u32 %f1, %r1;
    st.shared.f32 [%rd6], %f1;
    st.global.f32 [%rd3], %f1;
    ARRIVAL
    ret;
WAIT:
    bar.sync 1, 64;
    ld.shared.f32 %f2, [%rd6];
    ld.global.f32 %f3, [%rd3];
    add.f32 %f4, %f2, %f3;
    add.s64 %rd10, %rd9, %rd2;
    st.global.f32 [%rd10], %f4;
    membar.gl;
    ret;
"""


def _arrive_then_read(arrival: str) -> np.ndarray:
    seen = np.zeros(32, dtype=np.float32)
    body = ARRIVE_THEN_READ.replace("ARRIVAL", arrival)
    interp.run(kernel(body, ".param .u64 out, .param .u64 seen", shared=".shared .align 4 .b8 smem[128];"), "k", 1,
               64, 0, [np.zeros(32, dtype=np.float32), seen])
    return seen


def test_what_a_warp_stored_before_it_arrived_is_seen_by_the_warps_that_waited_at_the_barrier():
    assert (_arrive_then_read("bar.arrive 1, 64;") == 2 * np.arange(32)).all()


@pytest.mark.parametrize("arrival, caught", [
    ("", (interp.HangError, r"warp 1 \(from thread \(32,0,0\) of block \(0,0,0\)\) at barrier 1")),  # never arrives
    ("bar.arrive 1, 96;", (interp.InterpError, r"at barrier 1 for different counts \{64, 96\}")),
    ("bar.arrive 1, 64; bar.arrive 1, 64;", (interp.InterpError, r"arrives at barrier 1 again before it has completed")),
])
def test_an_arrival_that_does_not_complete_the_barrier_is_reported(arrival, caught):
    error, says = caught
    with pytest.raises(error, match=says):
        _arrive_then_read(arrival)


def test_two_threads_writing_one_shared_word_race():
    body = """
    mov.u32 %r1, %tid.x;
    mov.u64 %rd5, smem;
    st.shared.u32 [%rd5], %r1;
    ret;
"""
    with pytest.raises(interp.RaceError, match=r"thread \(\d+,0,0\) of block \(0,0,0\) and thread"):
        interp.run(kernel(body, shared=".shared .align 4 .b8 smem[128];"), "k", 1, 32, 0,
                   [np.zeros(1, dtype=np.uint32)])


def test_two_threads_storing_one_global_word_race():
    body = STORE_TID.replace("mul.wide.u32 %rd2, %r1, 4;", "shr.u32 %r2, %r1, 1;\n    mul.wide.u32 %rd2, %r2, 4;")
    with pytest.raises(interp.RaceError, match=r"global-memory race at global address 0x[0-9a-f]+: thread \([01],0,0\) "
                                               r"of block \(0,0,0\) stores to a word that thread \([01],0,0\)"):
        interp.run(kernel(body), "k", 1, 32, 0, [np.zeros(16, dtype=np.uint32)])


def test_divergent_branches_reconverge():
    body = """
    ld.param.u64 %rd1, [out];
    mov.u32 %r1, %tid.x;
    and.b32 %r2, %r1, 1;
    setp.eq.s32 %p1, %r2, 0;
    mov.u32 %r3, 0;
    @%p1 bra $EVEN;
    add.s32 %r3, %r3, 100;
    bra.uni $JOIN;
$EVEN:
    add.s32 %r3, %r3, 200;
$JOIN:
    add.s32 %r3, %r3, %r1;
    mul.wide.u32 %rd2, %r1, 4;
    add.s64 %rd3, %rd1, %rd2;
    st.global.u32 [%rd3], %r3;
    ret;
"""
    out = np.zeros(48, dtype=np.uint32)
    interp.run(kernel(body), "k", 1, 48, 0, [out])
    t = np.arange(48)
    assert (out == np.where(t % 2 == 0, 200, 100) + t).all()


def test_a_loop_with_a_trip_count_per_lane_reconverges_after_it():
    body = """
    ld.param.u64 %rd1, [out];
    mov.u32 %r1, %tid.x;
    and.b32 %r2, %r1, 7;
    mov.u32 %r3, 0;
    mov.u32 %r4, 0;
$LOOP:
    add.s32 %r3, %r3, %r1;
    add.s32 %r4, %r4, 1;
    setp.le.u32 %p1, %r4, %r2;
    @%p1 bra $LOOP;
    setp.gt.u32 %p2, %r1, 40;
    @%p2 ret;
    mul.wide.u32 %rd2, %r1, 4;
    add.s64 %rd3, %rd1, %rd2;
    st.global.u32 [%rd3], %r3;
    ret;
"""
    out = np.zeros(64, dtype=np.uint32)
    interp.run(kernel(body), "k", 1, 64, 0, [out])
    t = np.arange(64)
    assert (out == np.where(t > 40, 0, t * ((t & 7) + 1))).all()


@pytest.mark.parametrize("mode, b, expect", [
    ("bfly", 5, lambda lane: lane ^ 5),
    ("down", 3, lambda lane: np.where(lane + 3 <= 31, lane + 3, lane)),
    ("up", 3, lambda lane: np.where(lane - 3 >= 0, lane - 3, lane)),
    ("idx", 7, lambda lane: np.full(32, 7)),
])
def test_shuffles(mode, b, expect):
    c = "0" if mode == "up" else "0x1f"
    body = f"""
    ld.param.u64 %rd1, [out];
    mov.u32 %r1, %tid.x;
    mul.lo.s32 %r2, %r1, 10;
    shfl.sync.{mode}.b32 %r3, %r2, {b}, {c}, 0xffffffff;
    mul.wide.u32 %rd2, %r1, 4;
    add.s64 %rd3, %rd1, %rd2;
    st.global.u32 [%rd3], %r3;
    ret;
"""
    out = np.zeros(32, dtype=np.uint32)
    interp.run(kernel(body), "k", 1, 32, 0, [out])
    assert (out == expect(np.arange(32)) * 10).all()


def test_a_shuffle_by_part_of_its_members_is_reported():
    body = """
    mov.u32 %r1, %tid.x;
    setp.lt.u32 %p1, %r1, 16;
    @%p1 bra $DONE;
    shfl.sync.bfly.b32 %r3, %r1, 1, 0x1f, 0xffffffff;
$DONE:
    ret;
"""
    with pytest.raises(interp.DivergenceError, match="shfl.sync"):
        interp.run(kernel(body), "k", 1, 32, 0, [np.zeros(1, dtype=np.uint32)])


def test_scalar_parameters_and_float_arithmetic():
    body = """
    ld.param.u64 %rd1, [out];
    ld.param.f32 %f1, [a];
    ld.param.u32 %r1, [n];
    cvt.rn.f32.s32 %f2, %r1;
    fma.rn.f32 %f3, %f1, %f2, 0f3F800000;
    sqrt.rn.f32 %f4, %f3;
    div.rn.f32 %f5, %f4, 0f40000000;
    rsqrt.approx.ftz.f32 %f6, %f3;
    setp.leu.f32 %p1, %f5, 0f7FC00000;
    selp.f32 %f7, 0f3F800000, 0f00000000, %p1;
    st.global.v4.f32 [%rd1], {%f3, %f4, %f5, %f6};
    st.global.f32 [%rd1+16], %f7;
    ret;
"""
    out = np.zeros(5, dtype=np.float32)
    interp.run(kernel(body, ".param .u64 out, .param .f32 a, .param .u32 n"), "k", 1, 1, 0, [out, 2.0, 4])
    assert out.tolist() == pytest.approx([9.0, 3.0, 1.5, 1 / 3, 1.0])


def test_fma_rounds_once_where_float64_would_round_twice():
    # a·b = 1 + 2^-24 exactly (2^24 + 1 = 97 · 172961): a float32 tie; c = 2^-80 breaks it upwards.
    a, b = np.float32(97 * 2.0**-7), np.float32(172961 * 2.0**-17)
    assert Fraction(float(a)) * Fraction(float(b)) == 1 + Fraction(1, 2**24)
    c = np.array([2.0**-80, -(2.0**-80), 0.0], dtype=np.float32)
    twice = (np.float64(a) * np.float64(b) + c.astype(np.float64)).astype(np.float32)
    assert twice[0] == np.float32(1)  # float64 then float32: the wrong answer
    once = fma_f32(np.full(3, a), np.full(3, b), c)
    assert once.tolist() == [float(np.float32(1 + 2.0**-23)), 1.0, 1.0]


def test_fma_matches_exact_rounding_on_random_operands():
    rng = np.random.default_rng(1)
    a, b = rng.standard_normal((2, 4000)).astype(np.float32)
    c = (rng.standard_normal(4000) * 10.0 ** rng.integers(-12, 3, 4000)).astype(np.float32)
    r = fma_f32(a, b, c)
    for i in range(0, 4000, 40):
        exact = Fraction(float(a[i])) * Fraction(float(b[i])) + Fraction(float(c[i]))
        up, down = np.nextafter(r[i], np.float32(np.inf)), np.nextafter(r[i], np.float32(-np.inf))
        assert abs(Fraction(float(r[i])) - exact) <= abs(Fraction(float(up)) - exact)
        assert abs(Fraction(float(r[i])) - exact) <= abs(Fraction(float(down)) - exact)


def test_worst_error_is_the_gates_relative_error():
    shape = LN.shape(d=64)
    variant = build(LN, shape, LnParams(template="row", threads=32, vector=8), "sm_90")
    result = interp.run_once(LN, shape, variant, {"m": 2}, np.random.default_rng(3))
    err = relative_error(result["outputs"]["y"], result["reference"]["y"])  # measure's, as the GPU gate uses
    assert 0 < err <= LN.tolerance
    assert interp.worst_error(LN, shape, variant, {"m": 2}, np.random.default_rng(3), runs=[{"m": 2}]) == err


def one_instruction(instr: str, a: np.ndarray, b: np.ndarray, out_dtype) -> np.ndarray:
    """Run `instr` (dst %x3, sources %x1, %x2 where x is f or r) on 32 lanes of a and b."""
    body = f"""
    ld.param.u64 %rd1, [out];
    ld.param.u64 %rd2, [src_a];
    ld.param.u64 %rd3, [src_b];
    mov.u32 %r10, %tid.x;
    mul.wide.u32 %rd4, %r10, 4;
    add.s64 %rd5, %rd2, %rd4;
    add.s64 %rd6, %rd3, %rd4;
    ld.global.b32 %r1, [%rd5];
    ld.global.b32 %r2, [%rd6];
    mov.b32 %f1, %r1;
    mov.b32 %f2, %r2;
    {instr};
    add.s64 %rd7, %rd1, %rd4;
    st.global.b32 [%rd7], %r3;
"""
    if "%f3" in instr:
        body = body.replace("st.global.b32 [%rd7], %r3;", "st.global.f32 [%rd7], %f3;")
    if "%p1" in instr.split(",")[0]:
        body = body.replace("st.global.b32 [%rd7], %r3;", "selp.b32 %r3, 1, 0, %p1;\n    st.global.b32 [%rd7], %r3;")
    out = np.zeros(32, dtype=out_dtype)
    interp.run(kernel(body + "    ret;\n", ".param .u64 out, .param .u64 src_a, .param .u64 src_b"), "k", 1, 32, 0,
               [out, np.ascontiguousarray(a), np.ascontiguousarray(b)])
    return out


F = np.array([1.5, -2.25, 0.0, -0.0, np.inf, -np.inf, np.nan, 3.0, 1e-45, -7.5, 2.5, 0.5, 1e30, -1e-30, 100.0, 7.0]
             * 2, dtype=np.float32)
G = np.roll(F, 3)
I = np.array([5, -7, 0, 2**31 - 1, -2**31, 123456, -1, 3, 17, -100, 64, 1, 2, -2, 30, 31] * 2, dtype=np.int32)
J = np.array([3, 2, 5, 1, 1, -3, 31, 33, -4, 7, 6, 1, 30, 3, 2, 1] * 2, dtype=np.int32)


@pytest.mark.parametrize("instr, a, b, expect", [
    ("add.f32 %f3, %f1, %f2", F, G, lambda a, b: a + b),
    ("sub.rn.f32 %f3, %f1, %f2", F, G, lambda a, b: a - b),
    ("mul.f32 %f3, %f1, %f2", F, G, lambda a, b: a * b),
    ("div.rn.f32 %f3, %f1, %f2", F, G, lambda a, b: a / b),
    ("div.full.f32 %f3, %f1, %f2", F, G, lambda a, b: a / b),
    ("min.f32 %f3, %f1, %f2", F, G, np.fmin),
    ("max.f32 %f3, %f1, %f2", F, G, np.fmax),
    ("neg.f32 %f3, %f1", F, G, lambda a, b: -a),
    ("abs.f32 %f3, %f1", F, G, lambda a, b: np.abs(a)),
    ("rcp.rn.f32 %f3, %f1", F, G, lambda a, b: np.float32(1) / a),
    ("sqrt.rn.f32 %f3, %f1", F, G, lambda a, b: np.sqrt(a)),
    ("fma.rn.f32 %f3, %f1, %f2, %f1", F, G, lambda a, b: fma_f32(a, b, a)),
    ("add.s32 %r3, %r1, %r2", I, J, lambda a, b: a + b),
    ("sub.s32 %r3, %r1, %r2", I, J, lambda a, b: a - b),
    ("mul.lo.s32 %r3, %r1, %r2", I, J, lambda a, b: a * b),
    ("mul.hi.s32 %r3, %r1, %r2", I, J, lambda a, b: ((a.astype(np.int64) * b) >> 32).astype(np.int32)),
    ("mad.lo.s32 %r3, %r1, %r2, %r1", I, J, lambda a, b: a * b + a),
    ("div.s32 %r3, %r1, %r2", I, J, lambda a, b: np.trunc(a / b).astype(np.int32)),
    ("rem.s32 %r3, %r1, %r2", I, J, lambda a, b: np.fmod(a, b).astype(np.int32)),
    ("min.s32 %r3, %r1, %r2", I, J, np.minimum),
    ("max.u32 %r3, %r1, %r2", I, J, lambda a, b: np.maximum(a.view(np.uint32), b.view(np.uint32)).view(np.int32)),
    ("shl.b32 %r3, %r1, %r2", I, J, lambda a, b: np.where(b.view(np.uint32) >= 32, 0, a << np.clip(b, 0, 31))),
    ("shr.s32 %r3, %r1, %r2", I, J, lambda a, b: a >> np.clip(b.view(np.uint32), 0, 31).astype(np.int32)),
    ("shr.u32 %r3, %r1, %r2", I, J, lambda a, b: np.where(b.view(np.uint32) >= 32, 0,
                                                          a.view(np.uint32) >> np.clip(b, 0, 31).astype(np.uint32)
                                                          ).astype(np.uint32).view(np.int32)),
    ("and.b32 %r3, %r1, %r2", I, J, np.bitwise_and),
    ("xor.b32 %r3, %r1, %r2", I, J, np.bitwise_xor),
    ("not.b32 %r3, %r1", I, J, lambda a, b: ~a),
    ("neg.s32 %r3, %r1", I, J, lambda a, b: -a),
    ("bfi.b32 %r3, %r1, %r2, 4, 8", I, J, lambda a, b: ((b.view(np.uint32) & ~np.uint32(0xFF0))
                                                        | ((a.view(np.uint32) << 4) & 0xFF0)).view(np.int32)),
    ("cvt.rni.s32.f32 %r3, %f1", F, G, lambda a, b: np.where(np.isnan(a), 0, np.clip(np.rint(a.astype(np.float64)),
                                                                                     -2**31, 2**31 - 1)).astype(np.int32)),
    ("cvt.rzi.s32.f32 %r3, %f1", F, G, lambda a, b: np.where(np.isnan(a), 0, np.clip(np.trunc(a.astype(np.float64)),
                                                                                     -2**31, 2**31 - 1)).astype(np.int32)),
    ("cvt.rn.f32.s32 %f3, %r1", I, J, lambda a, b: a.astype(np.float32)),
    ("cvt.rmi.f32.f32 %f3, %f1", F, G, lambda a, b: np.floor(a)),
])
def test_instructions_against_numpy(instr, a, b, expect):
    with np.errstate(all="ignore"):
        want = np.asarray(expect(a, b))
    got = one_instruction(instr, a.view(np.uint32), b.view(np.uint32), want.dtype)
    assert np.array_equal(got, want, equal_nan=True), (got, want)


@pytest.mark.parametrize("cmp", ["eq", "ne", "lt", "le", "gt", "ge", "equ", "neu", "ltu", "leu", "gtu", "geu",
                                 "num", "nan"])
def test_float_comparisons_and_nan(cmp):
    base = {"eq": np.equal, "ne": np.not_equal, "lt": np.less, "le": np.less_equal, "gt": np.greater,
            "ge": np.greater_equal}
    unordered = np.isnan(F) | np.isnan(G)
    with np.errstate(all="ignore"):
        if cmp == "num":
            want = ~unordered
        elif cmp == "nan":
            want = unordered
        elif cmp.endswith("u"):
            want = base[cmp[:-1]](F, G) | unordered
        else:
            want = base[cmp](F, G) & ~unordered
    got = one_instruction(f"setp.{cmp}.f32 %p1, %f1, %f2", F.view(np.uint32), G.view(np.uint32), np.int32)
    assert (got == want).all()


def test_the_interpreter_never_imports_the_gpu_module():
    # it runs where there is no driver: nothing of it may reach cuda.bindings, directly or through measure
    code = ("import sys, mage_gen.interp; "
            "print(sorted(m for m in ('mage_gen.gpu', 'mage_gen.measure', 'cuda.bindings.driver') if m in sys.modules))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "[]", (done.stdout, done.stderr)
