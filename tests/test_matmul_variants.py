"""Every matmul variant is rejected by a named rule or compiles to the pipeline it asked for."""

import re

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mage_gen.errors import ConfigError
from mage_gen.ops import get_op
from mage_gen.ops.matmul import Params
from mage_gen.space import expand, load_space
from mage_gen.variants import build, build_all

OP = get_op("matmul")
SEED = Params()  # 64×64×32 block tile, 4×4 per thread, A transposed (4-byte copies), B 16-byte, 2 buffers
RULES = {"tile", "thread-tile", "tile-divides", "threads", "buffers", "a-layout", "copy-width", "padding",
         "divisibility", "tile-copy", "shared-memory", "registers", "plant", "lanes", "split", "warp-tile", "sync"}

params_strategy = st.builds(
    Params,
    bm=st.sampled_from([16, 32, 64, 128, 256]), bn=st.sampled_from([32, 64, 128, 256]), bk=st.sampled_from([8, 16, 32]),
    tm=st.sampled_from([4, 8, 16]), tn=st.sampled_from([4, 8, 16]), buffers=st.sampled_from([1, 2, 3, 4]),
    a_layout=st.sampled_from(["transposed", "direct"]), a_width=st.sampled_from([4, 8, 16]),
    b_width=st.sampled_from([4, 8, 16]), a_pad=st.sampled_from([0, 4]), b_pad=st.sampled_from([0, 4]),
    lanes_m=st.sampled_from([1, 2, 4, 8]), split=st.booleans(), sync=st.sampled_from(["two", "one"]),
)
sizes = st.one_of(st.integers(1, 300), st.sampled_from([64, 128, 256, 1000, 1024]))


def has_main_loop(shape, p: Params) -> bool:
    return -(-shape.k // p.bk) - (p.buffers - 1) > 0


def expected_waits(shape, p: Params) -> dict[int, int]:
    waits = {0: 1}  # the drain
    if has_main_loop(shape, p):
        pending = p.buffers - (2 if p.sync == "one" else 1)
        waits[pending] = waits.get(pending, 0) + 1
    return waits


def expected_barriers(shape, p: Params) -> int:
    """The drain's one, and one or two per K step of the main loop."""
    return 1 + ((1 if p.sync == "one" else 2) if has_main_loop(shape, p) else 0)


def check_variant(m: int, n: int, k: int, p: Params) -> None:
    shape = OP.shape(m=m, n=n, k=k)
    try:
        OP.validate(shape, p)
    except ConfigError as exc:
        assert str(exc).split(":", 1)[0] in RULES, f"rejection without a named rule: {exc}"
        return
    v = build(OP, shape, p, "sm_90")
    c, launch = v.census, OP.geometry(shape, p, {})
    assert c.spill_bytes == 0 and c.stack_bytes == 0, (p.label(), c.registers)
    assert c.shared_bytes == 0 and launch.dynamic_shared_bytes == OP.shared_bytes(shape, p)
    assert launch.threads == (p.bm // p.tm) * (p.bn // p.tn)
    assert launch.grid == (-(-n // p.bn), -(-m // p.bm), 1)
    a_copy = 4 if p.a_layout == "transposed" else p.a_width
    assert set(c.cp_async) == {a_copy, p.b_width}
    assert c.wait_groups == expected_waits(shape, p)
    assert c.bar_sync == expected_barriers(shape, p)
    width = "v4" if n % 4 == 0 else "scalar"
    assert c.stores_of("C", width) == c.stores_of("C") > 0
    assert not c.global_loads, "operands reach shared memory only through cp.async"


@settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(m=sizes, n=sizes, k=sizes, params=params_strategy)
def test_drawn_variants_are_rejected_by_a_rule_or_compile_as_asked(m, n, k, params):
    check_variant(m, n, k, params)


def test_every_sixth_quick_variant_with_tails_compiles_without_spills():
    # Every sixth config of the quick preset (both copy widths of A, every tile and thread tile, both stage
    # counts stay in): a matmul compile takes most of a second, and the CPU suite has a time budget.
    shape = OP.shape(m=1000, n=1000, k=1000)  # 1000 is a multiple of no block tile: every tail path
    valid, rejected = expand(OP, shape, load_space(OP, "quick"))
    assert valid and rejected
    sample = valid[::6]
    for axis in ("bm", "bn", "bk", "tm", "tn", "buffers", "a_width"):
        assert {getattr(p, axis) for p in sample} == {getattr(p, axis) for p in valid}, axis
    for v in build_all(OP, shape, sample, "sm_90"):
        assert v.census.spill_bytes == 0, v.params.label()


def test_seed_kernel_is_one_point_of_the_space():
    shape = OP.shape(m=1024, n=1024, k=1024)
    v = build(OP, shape, SEED, "sm_90")
    assert OP.shared_bytes(OP.shape(m=1024, n=1024, k=1024), SEED) == 33792
    assert OP.geometry(shape, SEED, {}).threads == 256
    assert set(v.census.cp_async) == {4, 16}
    assert v.census.wait_groups[1] == 1  # one wait_group(1) in the K loop: one per K step
    assert v.census.commit_groups == 2  # prologue and loop


@pytest.mark.parametrize("bug", ["offset_units", "last_tile_parity"])
def test_each_planted_bug_changes_the_ptx(bug):
    shape = OP.shape(m=256, n=256, k=256)
    clean = build(OP, shape, SEED, "sm_90").compiled.ptx
    planted = build(OP, shape, Params(plant=bug), "sm_90").compiled.ptx
    body = lambda ptx: re.sub(r"matmul_\w+", "K", ptx)  # noqa: E731 - the entry names differ by design
    assert body(clean) != body(planted)


def test_planted_bugs_stay_out_of_search_spaces_and_records():
    assert "plant" not in dict(load_space(OP, "full").axes)
    assert "plant" not in OP.params_to_dict(SEED)


@pytest.mark.parametrize("dims, params, rule", [
    ((1024, 1024, 1024), Params(tm=3), "thread-tile"),
    ((1024, 1024, 1024), Params(tm=32), "thread-tile"),
    ((1024, 1024, 1024), Params(buffers=1, sync="one"), "sync"),
    ((1024, 1024, 1024), Params(sync="three"), "sync"),
    ((1024, 1024, 1024), Params(bm=60, tm=8), "tile-divides"),
    ((1024, 1024, 1024), Params(bm=32, bn=32, tm=8, tn=8), "threads"),
    ((1024, 1024, 1024), Params(buffers=5), "buffers"),
    ((1024, 1024, 1024), Params(a_width=16), "copy-width"),
    ((1024, 1024, 1024), Params(a_pad=2), "padding"),
    ((1024, 1022, 1024), Params(), "divisibility"),
    ((1024, 1024, 1024), Params(bm=128, bn=128, bk=128, tm=8, tn=8, buffers=3), "shared-memory"),
    ((1024, 1024, 1024), Params(bm=32, bn=32, bk=4, tm=4, tn=4, lanes_m=4), "tile-copy"),
    ((1024, 1024, 1024), Params(bm=64, bn=64, tm=8, tn=8), "warp-tile"),
    ((1024, 1024, 1024), Params(lanes_m=3), "lanes"),
    ((1024, 1024, 1024), Params(split=1), "split"),
    ((1000, 1000, 1000), Params(bm=64, bn=64, bk=32, tm=8, tn=8, lanes_m=8), "registers"),
    ((1024, 1024, 1024), Params(plant="typo"), "plant"),
])
def test_rejections_name_their_rule(dims, params, rule):
    m, n, k = dims
    with pytest.raises(ConfigError, match=rf"^{re.escape(rule)}:"):
        OP.validate(OP.shape(m=m, n=n, k=k), params)


@pytest.mark.parametrize("dims", [(0, 4, 4), (4, -1, 4), (4, 4, 1 << 20)])
def test_sizes_out_of_range_are_rejected(dims):
    m, n, k = dims
    with pytest.raises(ConfigError, match=r"^[mnk]-range:"):
        OP.shape(m=m, n=n, k=k)


def test_a_tile_row_that_does_not_divide_the_block_is_rejected():
    # 12 copies per row of A and 32 threads: thread t's second copy is not at a fixed offset from its first
    # (it computed 5760 NaN on the interpreter before this rule).
    with pytest.raises(ConfigError, match=r"^tile-copy: a row of the A tile is 12 copies"):
        OP.validate(OP.shape(m=96, n=96, k=48), Params(bm=32, bn=32, bk=12, tm=4, tn=8, lanes_m=8))
