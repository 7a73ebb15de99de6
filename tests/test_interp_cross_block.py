"""The interpreter's model of ordering across blocks (mage_gen/interp/memory.py Visibility): global atomics,
gpu-scope fences, the release and acquire that make one block's stores visible to another's reads, and the
named barriers that order a word's reads by several warps before a write. Blocks run one after another, so a
store is caught by what orders it, not by when it lands."""

import numpy as np
import pytest

from mage_gen import interp
from test_interp import kernel

# Two blocks of one thread: each stores its word of data, arrives on a counter, and the one that arrives second
# reads the other's word into out.
HANDOFF = """
    mov.u32 %r1, %ctaid.x;
    ld.param.u64 %rd1, [data];
    mad.wide.u32 %rd5, %r1, 4, %rd1;
    add.u32 %r2, %r1, 7;
    st.global.u32 [%rd5], %r2;
    {release}
    ld.param.u64 %rd2, [counter];
    atom{sem}.gpu.global.add.u32 %r3, [%rd2], 1;
    setp.ne.u32 %p1, %r3, 1;
    @%p1 bra DONE;
    {acquire}
    xor.b32 %r4, %r1, 1;
    mad.wide.u32 %rd7, %r4, 4, %rd1;
    ld.global.u32 %r5, [%rd7];
    ld.param.u64 %rd3, [out];
    st.global.u32 [%rd3], %r5;
DONE:
    ret;
"""
PARAMS = ".param .u64 data, .param .u64 counter, .param .u64 out"


def _handoff(release: str, sem: str, acquire: str, reverse: bool = False) -> tuple[int, int]:
    data, counter, out = np.zeros(2, np.uint32), np.zeros(1, np.uint32), np.zeros(1, np.uint32)
    ptx = kernel(HANDOFF.format(release=release, sem=sem, acquire=acquire), PARAMS)
    interp.run(ptx, "k", 2, 1, 0, [data, counter, out], reverse=reverse)
    return int(out[0]), int(counter[0])


@pytest.mark.parametrize("release, sem, acquire", [
    ("fence.acq_rel.gpu;", ".relaxed", "fence.acq_rel.gpu;"),  # the fences around a relaxed atomic
    ("", ".acq_rel", ""),  # the atomic itself
    ("membar.gl;", "", "fence.sc.gpu;"),
    ("", ".release", "fence.acq_rel.gpu;"),
])
def test_a_release_and_an_acquire_hand_a_store_to_the_block_that_arrives_last(release, sem, acquire):
    assert _handoff(release, sem, acquire) == (7, 2)  # block 1 arrived second and read block 0's word
    assert _handoff(release, sem, acquire, reverse=True) == (8, 2)


@pytest.mark.parametrize("release, sem, acquire", [
    ("", ".relaxed", "fence.acq_rel.gpu;"),  # nothing released
    ("fence.acq_rel.gpu;", ".relaxed", ""),  # nothing acquired
    ("", ".release", ""),
    ("fence.acq_rel.cta;", ".relaxed", "fence.acq_rel.cta;"),  # a block's fences order nothing across blocks
])
def test_a_read_of_another_blocks_store_without_a_release_and_an_acquire_is_stale(release, sem, acquire):
    with pytest.raises(interp.StaleReadError, match=r"ld\.global\.u32 .* thread \(0,0,0\) of block \(1,0,0\) reads "
                                                    r"global address 0x\w+, which thread \(0,0,0\) of block \(0,0,0\) "
                                                    r"stored with nothing that makes the store visible"):
        _handoff(release, sem, acquire)


def test_an_atomic_at_cta_scope_releases_nothing_to_another_block():
    ptx = kernel(HANDOFF.format(release="", sem=".acq_rel", acquire="").replace(".gpu.global", ".cta.global"), PARAMS)
    with pytest.raises(interp.StaleReadError):
        interp.run(ptx, "k", 2, 1, 0, [np.zeros(2, np.uint32), np.zeros(1, np.uint32), np.zeros(1, np.uint32)])


def test_atomics_add_and_exchange_lane_by_lane_and_return_the_old_value():
    body = """
    ld.param.u64 %rd1, [counter];
    ld.param.u64 %rd3, [out];
    mov.u32 %r1, %tid.x;
    atom.global.add.u32 %r2, [%rd1], %r1;
    mul.wide.u32 %rd4, %r1, 4;
    add.s64 %rd5, %rd3, %rd4;
    st.global.u32 [%rd5], %r2;
    red.relaxed.gpu.global.add.s32 [%rd1+4], -1;
    atom.global.exch.b32 %r3, [%rd1+8], %r1;
    ret;
"""
    counter, out = np.array([5, 0, 9], np.uint32), np.zeros(32, np.uint32)
    interp.run(kernel(body, ".param .u64 counter, .param .u64 out"), "k", 1, 32, 0, [counter, out])
    lanes = np.arange(32, dtype=np.uint32)
    assert (out == 5 + np.cumsum(lanes) - lanes).all()
    assert counter.tolist() == [5 + lanes.sum(), 2**32 - 32, 31]


@pytest.mark.parametrize("instruction", ["atom.global.cas.b32 %r2, [%rd1], %r1, %r1;",
                                         "atom.shared.add.u32 %r2, [%rd1], %r1;",
                                         "atom.global.add.f32 %f2, [%rd1], %f1;",
                                         "fence.proxy.alias;", "membar.x;"])
def test_an_atomic_or_fence_the_interpreter_does_not_model_is_an_unknown_instruction(instruction):
    body = f"""
    ld.param.u64 %rd1, [counter];
    mov.u32 %r1, %tid.x;
    {instruction}
    ret;
"""
    with pytest.raises(interp.UnknownInstruction, match=r"line \d+: "):
        interp.run(kernel(body, ".param .u64 counter"), "k", 1, 32, 0, [np.zeros(4, np.uint32)])


# Both warps read one shared word; the threads of `count` meet at named barrier 1 (the others leave); then thread 0
# writes the word.
READ_THEN_WRITE = """
    mov.u32 %r1, %tid.x;
    mov.u64 %rd5, smem;
    ld.shared.u32 %r2, [%rd5];
    setp.ge.u32 %p1, %r1, {count};
    @%p1 bra DONE;
    bar.sync 1, {count};
    setp.ne.u32 %p2, %r1, 0;
    @%p2 bra DONE;
    st.shared.u32 [%rd5], %r1;
DONE:
    ret;
"""


def test_a_named_barrier_of_every_warp_that_read_a_word_orders_their_reads_before_a_write():
    shared = ".shared .align 4 .b8 smem[128];"
    interp.run(kernel(READ_THEN_WRITE.format(count=64), "", shared=shared), "k", 1, 64, 0, [])
    with pytest.raises(interp.RaceError, match="writes bytes that several other threads read since the last barrier"):
        interp.run(kernel(READ_THEN_WRITE.format(count=32), "", shared=shared), "k", 1, 64, 0, [])
