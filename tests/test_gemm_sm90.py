"""The Hopper GEMM (mage_gen/ops/gemm_sm90.py): every quick variant compiles for sm_90a to the wgmma, TMA,
mbarrier and setmaxnreg its params imply, without spills; its rules refuse what cannot be built, each with a
line that names the rule; the tensor maps, tile orders and planted bugs are what they say. On the CPU
interpreter, small configs compute C bit for bit at tails, drawn ones pass the gate, and every planted bug is
caught."""

import dataclasses
import re

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from drawn import gate_a_drawn_gemm_on_the_interpreter  # tests/drawn.py
from mage_gen import interp
from mage_gen.dtypes import BFLOAT16, FLOAT32
from mage_gen.compile import compile_source
from mage_gen.errors import ConfigError
from mage_gen.ops import get_op
from mage_gen.ops.gemm_sm90 import STAMP_CTAS, STAMP_SLOTS, consumer_regs, consumer_rows, hilbert_order
from mage_gen.space import expand, load_space, preset_names
from mage_gen.variants import build, build_all

OP = get_op("gemm_sm90")


def test_every_quick_variant_compiles_to_the_instructions_its_params_imply():
    shape = OP.shape(m=4096, n=4096, k=4096)
    valid, rejected = expand(OP, shape, load_space(OP, "quick", shape, sms=132))
    assert valid and all(why.startswith(("shared-memory", "registers", "order")) for _, why in rejected), rejected
    assert {p.schedule for p in valid} == {"cooperative", "pingpong"}
    for v in build_all(OP, shape, valid, "sm_90"):
        p, c = v.params, v.census
        assert v.compiled.arch == "sm_90a", "wgmma needs the arch-specific target"
        assert c.spill_bytes == 0 and c.stack_bytes == 0, v.source.kernel_name
        slabs = consumer_rows(p) // 64
        # a stage is 64 deep: 4 k16 steps of every 64-row slab of a consumer's rows, as one group
        assert c.hopper[f"wgmma m64n{p.bn}k16.bf16"] == 4 * slabs
        assert c.hopper["wgmma.commit_group"] == 1 and c.hopper["wgmma.fence"] == 1
        assert c.hopper["tma load A"] == 1
        assert c.hopper["tma load B" + (" multicast" if p.cluster > 1 else "")] == 1
        assert c.hopper[f"setmaxnreg.dec {p.producer_regs}"] == 1
        assert c.hopper[f"setmaxnreg.inc {consumer_regs(p)}"] == 1
        assert c.hopper["mbarrier.arrive.expect_tx"] == 1
        assert c.unfenced_async_reads == {} and c.static_fault() == "", v.source.kernel_name
        if p.epilogue == "tma":
            assert c.hopper["tma store C"] == p.bn * 2 // 128  # one box of 128 bytes of a row per store
            assert c.hopper["fence.proxy.async"] == 1 and c.hopper["stmatrix x4"] == slabs * p.bn // 16
            assert not c.global_stores
        else:
            assert "tma store C" not in c.hopper and c.stores_of("C") == slabs * p.bn // 4  # bf16 pairs


def test_a_tma_store_where_rows_of_c_are_not_on_16_bytes_is_a_store_from_registers():
    p = OP.params_from_dict({"epilogue": "tma"})
    odd, even = OP.shape(m=256, n=250, k=256), OP.shape(m=256, n=256, k=256)
    assert OP.kernel_name(odd, p).endswith("_direct") and "tma_c" not in OP.tensor_maps(odd, p)
    assert OP.kernel_name(even, p).endswith("_tma") and OP.contract(even, p)["tensors"]["C"]["alignment_bytes"] == 16
    assert OP.contract(odd, p)["tensors"]["C"]["alignment_bytes"] == 4  # bf16 pairs
    assert build(OP, odd, p, "sm_90").census.stores_of("C") > 0


def test_odd_sizes_store_c_one_element_at_a_time_and_fp32_pairs_as_v2():
    odd = build(OP, OP.shape(m=1025, n=1033, k=1041), OP.params_from_dict({}), "sm_90").census
    assert odd.stores_of("C") == odd.stores_of("C", "scalar") == 128 // 2  # each column of a pair alone
    wide = build(OP, OP.shape(m=1024, n=1024, k=1024, c_dtype="fp32"), OP.params_from_dict({}), "sm_90").census
    assert wide.stores_of("C") == wide.stores_of("C", "v2") == 128 // 4


def test_the_kernel_is_built_for_sm_90a_only():
    with pytest.raises(ConfigError, match="arch: gemm_sm90 is built of wgmma, which only sm_90a"):
        build(OP, OP.shape(m=256, n=256, k=256), OP.params_from_dict({}), "sm_100")
    with pytest.raises(ConfigError, match="arch: gemm_sm90 needs sm_90"):
        build(OP, OP.shape(m=256, n=256, k=256), OP.params_from_dict({}), "sm_80")


@pytest.mark.parametrize("shape, values, rule", [
    ((256, 256, 256), {"bm": 96}, "tile: bm is 64, 128 or 256"),
    ((256, 256, 256), {"bn": 72}, "tile: bn is a multiple of 16"),
    ((256, 256, 256), {"bm": 64, "consumers": 2}, "consumers: 2 consumers split bm=64"),
    ((256, 256, 256), {"bm": 256, "bn": 256}, "registers: 256 accumulators"),
    ((256, 256, 256), {"bn": 256, "stages": 5}, "shared-memory: 5 stages"),
    ((256, 256, 256), {"producer_regs": 20}, "registers: producer_regs is 0"),
    ((256, 256, 256), {"epilogue": "tma", "bn": 96}, "epilogue: the TMA store writes C in boxes"),
    ((256, 256, 256), {"cluster": 4}, "cluster: cluster is one of"),
    ((256, 256, 256), {"order": "zorder"}, "order: order is one of"),
    ((64 * 600, 64 * 600, 64), {"bm": 64, "bn": 64, "consumers": 1, "order": "hilbert"},
     "order: a Hilbert order lists its 600 × 600 tiles in a table, at most 262144"),
    ((64, 16 << 16, 64), {"bm": 64, "bn": 16, "consumers": 1, "order": "hilbert"},
     "order: a Hilbert order lists its 1 × 65536 tiles in a table, .* fewer than 65536 a side"),
    ((256, 256, 256), {"plant": "proxy_fence"}, "plant: the proxy fence belongs to the TMA store"),
    ((256, 256, 256), {"swap": True, "epilogue": "tma"}, r"swap: swap \(Cᵀ = B·Aᵀ\) takes B N×K \(nk\), epilogue direct"),
    ((256, 256, 256), {"swap": True, "cluster": 2}, "swap: .* got b_layout nk, epilogue direct, cluster 2"),
])
def test_rules_refuse_with_a_line_naming_the_rule(shape, values, rule):
    with pytest.raises(ConfigError, match="^" + rule):
        OP.validate(OP.shape(*shape), OP.params_from_dict(values))


def test_a_swapped_product_takes_b_n_by_k_only():
    with pytest.raises(ConfigError, match="^swap: .* got b_layout kn"):
        OP.validate(OP.shape(m=256, n=256, k=256, b_layout="kn"), OP.params_from_dict({"swap": True}))


def test_shapes_refuse_what_the_op_cannot_take():
    with pytest.raises(ConfigError, match="^precision: precision is one of"):
        OP.shape(m=64, n=64, k=64, precision="fp8")
    with pytest.raises(ConfigError, match="^c-dtype:"):
        OP.shape(m=64, n=64, k=64, c_dtype="fp16")
    with pytest.raises(ConfigError, match="^k-range:"):
        OP.shape(m=64, n=64, k=0)


def test_tensor_maps_read_rows_padded_to_16_bytes_and_boxes_of_a_stage():
    shape = OP.shape(m=1025, n=1033, k=1041)
    p = OP.params_from_dict({"bm": 128, "bn": 256, "stages": 3, "cluster": 2})
    maps = OP.tensor_maps(shape, p)
    assert shape.lda == 1048 and set(maps) == {"tma_a", "tma_b"}
    assert maps["tma_a"].dims == (1041, 1025) and maps["tma_a"].strides == (2096,) and maps["tma_a"].box == (64, 128)
    assert maps["tma_b"].dims == (1041, 1033) and maps["tma_b"].box == (64, 128)  # each CTA of the pair copies half
    c = OP.tensor_maps(OP.shape(m=1024, n=1040, k=64, c_dtype="fp32"), dataclasses.replace(p, epilogue="tma"))["tma_c"]
    assert c.dims == (1040, 1024) and c.strides == (4160,) and c.box == (32, 64) and c.swizzle == 128


def test_inputs_pad_their_rows_with_nan_and_the_reference_reads_k_columns():
    shape = OP.shape(m=5, n=3, k=9)
    inputs = OP.make_inputs(shape, {}, np.random.default_rng(0))
    assert inputs["A"].shape == (5, 16) and inputs["B"].shape == (3, 16)
    assert (inputs["A"][:, 9:] == 0x7FC0).all()
    ref = OP.reference(shape, inputs, {})["C"]
    assert ref.shape == (5, 3) and np.isfinite(ref).all()


@pytest.mark.parametrize("rows, cols", [(1, 1), (3, 5), (8, 8), (16, 32), (33, 7)])
def test_a_hilbert_order_visits_every_tile_once(rows, cols):
    order = hilbert_order(rows, cols)
    assert sorted(order) == [(r, c) for r in range(rows) for c in range(cols)]
    if rows == cols and rows & (rows - 1) == 0:  # a whole curve: each step to a neighbour
        assert all(abs(a[0] - b[0]) + abs(a[1] - b[1]) == 1 for a, b in zip(order, order[1:]))


def test_a_cluster_pairs_tiles_of_one_column_and_its_grid_is_whole_clusters():
    shape = OP.shape(m=1152, n=4096, k=256)  # 9 tile rows: the last pair's second tile lies past M
    p = OP.params_from_dict({"cluster": 2, "grid": 131})
    assert OP.geometry(shape, p, {}).grid == (130, 1, 1)
    text = OP.source(shape, p).text
    assert "row < 1152" in text


@pytest.mark.parametrize("values", [{"cluster": 2}, {"cluster": 2, "multicast": "a"},
                                    {"cluster": 2, "epilogue": "direct", "schedule": "pingpong"}])
def test_a_clusters_shape_is_set_by_its_launch_alone_and_compiles_in_nothing(values):
    shape = OP.shape(m=1024, n=1032, k=1040)
    p = OP.params_from_dict(values)
    launch = OP.geometry(shape, p, {})
    assert launch.cluster == (2, 1, 1) and launch.clustered and launch.grid[0] % 2 == 0
    assert OP.launch_formula(shape, p)["cluster"] == [2, 1, 1]
    variant = build(OP, shape, p, "sm_90")
    assert variant.compiled.arch == "sm_90a" and "__cluster_dims__" not in variant.source.text
    # no cluster shape in the PTX either: a launch without the attribute would not be made clustered by the kernel
    directives = [line.strip() for line in variant.compiled.ptx.splitlines() if line.strip().startswith(".")]
    assert not [d for d in directives if "cluster" in d], directives
    assert variant.census.hopper["cluster barrier"] == 2 and variant.census.hopper["cluster rank"] == 1
    assert "_x2" in variant.source.kernel_name  # the name still says it
    single = OP.geometry(shape, OP.params_from_dict({}), {})
    assert single.cluster == (1, 1, 1) and not single.clustered


@pytest.mark.parametrize("c_dtype", ["bf16", "fp32"])
def test_a_tma_store_without_the_proxy_fence_is_a_fault_the_census_finds_in_the_ptx(c_dtype):
    shape = OP.shape(m=512, n=512, k=512, c_dtype=c_dtype)
    p = OP.params_from_dict({"epilogue": "tma"})
    clean = build(OP, shape, p, "sm_90").census
    bugged = build(OP, shape, dataclasses.replace(p, plant="proxy_fence"), "sm_90").census
    stores = clean.hopper["tma store C"]
    assert clean.unfenced_async_reads == {} and clean.static_fault() == ""
    assert bugged.unfenced_async_reads == {"C": stores}
    assert bugged.static_fault().startswith(f"census: TMA stores ({stores} of C) read shared memory")


@pytest.mark.parametrize("lines, unfenced", [
    (["st.shared.v2.f32 [%r1], {%f1, %f2}; // tensor=C", "fence.proxy.async.shared::cta;",
      "cp.async.bulk.tensor.2d.global.shared::cta.tile.bulk_group [%rd4, {%r2, %r3}], [%r6]; // tensor=C"], {}),
    (["stmatrix.sync.aligned.m8n8.x4.shared.b16 [%r10], {%r1, %r2, %r3, %r4}; // tensor=C",
      "cp.async.bulk.tensor.2d.global.shared::cta.tile.bulk_group [%rd4, {%r2, %r3}], [%r6]; // tensor=C"], {"C": 1}),
    # one inline-asm line: the order within it counts
    (["fence.proxy.async.shared::cta; st.shared.u32 [%r1], %r2; "
      "cp.async.bulk.tensor.2d.global.shared::cta.tile.bulk_group [%rd4, {%r2, %r3}], [%r6]; // tensor=D"], {"D": 1}),
    (["st.shared.u32 [%r1], %r2; fence.proxy.async.shared::cta; "
      "cp.async.bulk.tensor.2d.global.shared::cta.tile.bulk_group [%rd4, {%r2, %r3}], [%r6]; // tensor=D"], {}),
    # a TMA load writes shared memory through the proxy itself, and a comment is no instruction
    (["cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%r1], [%rd1, {%r2, %r3}], "
      "[%r4]; // tensor=A", "// st.shared.u32 [%r1], %r2;",
      "cp.async.bulk.tensor.2d.global.shared::cta.tile.bulk_group [%rd4, {%r2, %r3}], [%r6]; // tensor=C"], {}),
])
def test_the_census_follows_writes_fences_and_tma_stores_in_program_order(lines, unfenced):
    from mage_gen.census import _ProxyOrder

    order = _ProxyOrder()
    for line in lines:
        if not line.lstrip().startswith("//"):
            order.see(line)
    assert dict(order.unfenced) == unfenced


@pytest.mark.parametrize("plant, planted", [
    ("swizzle", "((unsigned long long)2 << 62)"), ("sbo", "(512 >> 4)"),
    ("phase", "PLANTED: the phase a fresh barrier"), ("proxy_fence", "PLANTED: no proxy fence")])
def test_each_planted_bug_changes_the_kernel_where_it_says(plant, planted):
    shape = OP.shape(m=512, n=512, k=512)
    p = OP.params_from_dict({"epilogue": "tma", "plant": plant})
    clean, bugged = OP.source(shape, dataclasses.replace(p, plant="")).text, OP.source(shape, p).text
    assert planted in bugged and planted not in clean
    with pytest.raises(ConfigError, match="unknown gemm_sm90 parameter"):
        OP.params_from_user({"plant": plant})


def test_a_k_by_n_b_arrives_in_boxes_of_64_columns_and_is_read_through_the_transpose_bit():
    shape = OP.shape(m=1025, n=1033, k=1041, b_layout="kn")
    p = OP.params_from_dict({"bn": 256, "stages": 3})
    v = build(OP, shape, p, "sm_90")
    assert v.census.hopper["tma load B"] == 4 and v.census.hopper["wgmma m64n256k16.bf16"] == 4
    assert ", 1, 1, 0, 1; }" in v.source.text  # trans-b set, trans-a not
    assert OP.tensor_maps(shape, p)["tma_b"].dims == (1033, 1041) and shape.ldb == 1040
    b = OP.contract(shape, p)["tensors"]["B"]
    assert b["shape"] == [1041, 1033] and "row stride 1040" in b["layout"]
    inputs = OP.make_inputs(shape, {}, np.random.default_rng(1))
    assert inputs["B"].shape == (1041, 1040) and (inputs["B"][:, 1033:] == 0x7FC0).all()
    assert OP.reference(shape, inputs, {})["C"].shape == (1025, 1033)
    clustered = OP.params_from_dict({"bn": 128, "cluster": 2})
    assert build(OP, shape, clustered, "sm_90").census.hopper["tma load B multicast"] == 1
    with pytest.raises(ConfigError, match="^b-layout: with B K×N"):
        OP.validate(shape, OP.params_from_dict({"bn": 64, "cluster": 2}))


# ---- on the CPU interpreter (mage_gen/interp/hopper.py): TMA over tensor maps, mbarrier phases, wgmma over
# descriptors and swizzles, the proxy fence ----

SMALL = {"bm": 64, "bn": 64, "consumers": 1, "stages": 2, "grid": 2, "producer_regs": 0}  # 256 threads, two CTAs


def passes_the_gate_on_the_interpreter(shape, values, seed):
    """The variant of SMALL and values at shape, once it has passed the gate on the interpreter (an fp32 C within
    1e-6: silu's ex2 and rcp approximations are exact there, so what is left is the sums' rounding)."""
    variant = build(OP, shape, OP.params_from_dict({**SMALL, **values}), "sm_90")
    result = interp.gate(OP, shape, variant, {}, np.random.default_rng(seed))
    assert result.passed, result.reason
    if shape.c_dtype == "fp32":
        assert result.errors["fixed"] < 1e-6
    return variant


def _whole_numbers(shape, rng):
    """Inputs of small whole numbers (bf16 holds them exactly, and fp32 sums them exactly), rows padded with NaN."""
    inputs = OP.make_inputs(shape, {}, rng)
    for name, held in inputs.items():
        cols = shape.k if name == "A" or shape.b_layout == "nk" else shape.n
        held[:, :cols] = BFLOAT16.round(rng.integers(-3, 4, (held.shape[0], cols)).astype(np.float32))
    return inputs


@pytest.mark.parametrize("c_dtype", ["bf16", "fp32"])
@pytest.mark.parametrize("b_layout", ["nk", "kn"])
@pytest.mark.parametrize("values", [{}, {"epilogue": "tma", "stages": 3}, {"order": "hilbert", "inflight": 0, "grid": 1},
                                    {"schedule": "pingpong", "consumers": 2, "grid": 1, "epilogue": "tma"}])
def test_a_small_config_on_the_interpreter_matches_numpy_bit_for_bit_at_tails(c_dtype, b_layout, values):
    # M, N ≡ 1 mod 8 and K past a 64-deep stage; where N·size is not a multiple of 16 a TMA store is register stores
    n = 129 if values.get("epilogue") != "tma" else 136
    shape = OP.shape(m=129, n=n, k=73, c_dtype=c_dtype, b_layout=b_layout)
    variant = build(OP, shape, OP.params_from_dict({**SMALL, **values}), "sm_90")
    inputs = _whole_numbers(shape, np.random.default_rng(7))
    out = interp.launch_with(OP, shape, variant, {}, inputs)["C"]
    exact = OP.reference(shape, inputs, {})["C"]
    expected = BFLOAT16.round(exact) if c_dtype == "bf16" else exact.astype(np.float32)
    assert out.dtype == expected.dtype and np.array_equal(out.view(np.uint8), expected.view(np.uint8))


def test_a_hilbert_order_past_constant_memory_keeps_its_table_in_global_memory(monkeypatch):
    from mage_gen.ops import gemm_sm90

    hilbert = OP.params_from_dict({"order": "hilbert"})
    big = OP.shape(m=8192, n=57344, k=8192)  # 64 × 448 tiles of 128×128: more than constant memory's 16384
    OP.validate(big, hilbert)
    assert "__device__ const unsigned tile_order[28672] = { 0, 65536, 65537, 1, 2, 3," in OP.source(big, hilbert).text
    assert "__constant__ unsigned tile_order[32]" in OP.source(OP.shape(m=512, n=1024, k=64), hilbert).text
    # on the interpreter, with a table made too big for constant memory at a small size: each tile once, C exact
    monkeypatch.setattr(gemm_sm90, "CONSTANT_ORDER_TABLE", 2)
    shape = OP.shape(m=129, n=129, k=73)
    variant = build(OP, shape, OP.params_from_dict({**SMALL, "order": "hilbert", "inflight": 0, "grid": 1}), "sm_90")
    assert "__device__ const unsigned tile_order[9]" in variant.source.text
    inputs = _whole_numbers(shape, np.random.default_rng(5))
    out = interp.launch_with(OP, shape, variant, {}, inputs)["C"]
    assert np.array_equal(out.view(np.uint8), BFLOAT16.round(OP.reference(shape, inputs, {})["C"]).view(np.uint8))


# ---- clusters on the interpreter: a cluster's CTAs run together, multicasting into and arriving on each other ----

@pytest.mark.parametrize("values", [
    {"cluster": 2},  # tiles of one column share B: M's tail in the second CTA
    {"cluster": 2, "multicast": "a", "epilogue": "tma"},  # tiles of one row share A: N's tail
    {"cluster": 2, "schedule": "pingpong", "consumers": 2, "grid": 4},
    {"cluster": 2, "bn": 128, "stages": 3, "inflight": 0},
])
@pytest.mark.parametrize("b_layout", ["nk", "kn"])
def test_a_clustered_config_on_the_interpreter_matches_numpy_bit_for_bit_at_tails(values, b_layout):
    shape = OP.shape(m=257, n=136, k=200, b_layout=b_layout)
    # a cluster sharing a K×N B tile copies it in boxes of 64 columns, half each: a 128-wide tile at least
    wide = {"bn": 128} if b_layout == "kn" else {}
    variant = build(OP, shape, OP.params_from_dict({**SMALL, "producer_regs": 40, **values, **wide}), "sm_90")
    assert OP.geometry(shape, variant.params, {}).cluster == (2, 1, 1)
    inputs = _whole_numbers(shape, np.random.default_rng(11))
    out = interp.launch_with(OP, shape, variant, {}, inputs)["C"]
    expected = BFLOAT16.round(OP.reference(shape, inputs, {})["C"])
    assert np.array_equal(out.view(np.uint8), expected.view(np.uint8))


@pytest.mark.parametrize("old, new, caught", [
    # the B tile multicast into this CTA only: the peer's full stage never gets its half, and the kernel hangs
    ("(unsigned short)(3)", "(unsigned short)(1)", "at barrier.cluster.wait for phase 1"),
    # no cluster barrier before the first copies: the peer's mbarriers may not be initialised yet
    ("barrier.cluster.arrive.release.aligned; barrier.cluster.wait.acquire.aligned;", "",
     "no mbarrier was initialised"),
    # a stage freed in this CTA only: the peer's producer waits for an arrival that never comes
    ("if (threadIdx.x % 128 < 2) ", "if (threadIdx.x % 128 < 1) ", "every warp of the cluster"),
])
def test_the_interpreter_catches_a_cluster_s_missing_copy_barrier_or_arrival(old, new, caught):
    shape = OP.shape(m=256, n=136, k=520)  # 9 stages' worth of K in 4 stages: each stage is freed and filled again
    variant = build(OP, shape, OP.params_from_dict({"cluster": 2}), "sm_90")
    assert interp.gate(OP, shape, variant, {}, np.random.default_rng(0)).passed
    assert old in variant.source.text
    source = dataclasses.replace(variant.source, text=variant.source.text.replace(old, new, 1))
    broken = dataclasses.replace(variant, compiled=compile_source(source, "sm_90a"))
    result = interp.gate(OP, shape, broken, {}, np.random.default_rng(0))
    assert not result.passed and caught in result.reason, result.reason


def test_a_cluster_whose_blocks_also_meet_through_global_memory_is_refused_not_guessed():
    # Visibility follows one running block's threads; a cluster's run together
    shape = OP.shape(m=256, n=136, k=200)
    variant = build(OP, shape, OP.params_from_dict({"cluster": 2, "split_k": 2}), "sm_90")
    result = interp.gate(OP, shape, variant, {}, np.random.default_rng(0))
    assert not result.passed and "inside clusters are not modeled" in result.reason


@pytest.mark.parametrize("plant, caught", [
    ("swizzle", "relative error"), ("sbo", "relative error"),
    ("phase", "every warp of block"), ("proxy_fence", "with no fence.proxy.async since")])
def test_the_interpreter_catches_each_planted_bug(plant, caught):
    shape = OP.shape(m=130, n=128, k=136)
    clean = OP.params_from_dict({**SMALL, "epilogue": "tma"})
    assert interp.gate(OP, shape, build(OP, shape, clean, "sm_90"), {}, np.random.default_rng(0)).passed
    planted = build(OP, shape, dataclasses.replace(clean, plant=plant), "sm_90")
    result = interp.gate(OP, shape, planted, {}, np.random.default_rng(0))
    assert not result.passed and caught in result.reason, result.reason


def test_pingpong_consumers_take_turns_so_that_no_stage_is_waited_for_a_phase_ahead():
    # Without the turns, the consumer of a CTA's second tile, having let the first tile's stages go by, waited on a
    # stage for parity 0 while that stage's barrier was two fills behind: the interpreter took the phase of two fills
    # ago for it and ran into a hang (a GPU would read a stage not yet filled).
    shape = OP.shape(m=257, n=200, k=150)
    params = OP.params_from_dict({**SMALL, "bn": 16, "schedule": "pingpong", "consumers": 2})
    variant = build(OP, shape, params, "sm_90")
    assert variant.source.text.count("order_bar + 8 * consumer") == 1
    assert interp.gate(OP, shape, variant, {}, np.random.default_rng(0)).passed


def test_a_hang_names_each_warp_and_the_phase_it_waits_for():
    shape = OP.shape(m=64, n=64, k=64)
    variant = build(OP, shape, OP.params_from_dict({**SMALL, "plant": "phase"}), "sm_90")
    with pytest.raises(interp.HangError, match=r"warp 0 .* on the mbarrier at 0x\w+ for parity 0 \(phase 0 in "
                                               r"progress, 1 of 1 arrivals"):
        interp.launch_with(OP, shape, variant, {}, OP.make_inputs(shape, {}, np.random.default_rng(0)))


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_drawn_small_configs_pass_the_gate_on_the_interpreter(data):
    gate_a_drawn_gemm_on_the_interpreter(data, st.integers(1, 200))


def test_the_waves_n_tile_is_worked_out_from_the_sm_count_and_the_shape():
    from mage_gen.ops.gemm_sm90 import wave_tile

    decode = OP.shape(m=16, n=4096, k=4096)
    assert wave_tile(decode, 64, 132) == 32  # 128 tiles on 132 SMs, where 64 leaves half of them idle
    assert wave_tile(decode, 64, 66) == 64  # half the SMs: 64 tiles fill them as well as 128 in two waves
    assert wave_tile(OP.shape(m=16, n=4096, k=4096, b_layout="kn"), 64, 132) == 64  # a K×N B takes 64-column boxes
    # never more waves than 256-wide tiles take: 192 fills one wave at 512×6144 (128 tiles, against 96 of 256);
    # at 512×57344 every narrower tile takes more than 256's 7 waves (16 fills 109 of them better)
    assert wave_tile(OP.shape(m=512, n=6144, k=4096), 128, 132) == 192
    assert wave_tile(OP.shape(m=512, n=57344, k=8192), 128, 132) == 256
    listed = (16, 32, 64, 96, 128, 192, 256)
    assert dict(load_space(OP, "skinny", decode, sms=132).axes)["bn"] == listed  # 32 is listed already
    assert dict(load_space(OP, "skinny", OP.shape(m=16, n=6144, k=4096), sms=132).axes)["bn"] == (*listed, 48)
    unsized = load_space(OP, "skinny", decode)  # no GPU named: nothing to fill, so no such value
    assert dict(unsized.axes)["bn"] == listed and unsized.needs_sms


@pytest.mark.parametrize("bn", [32, 48, 112])
def test_narrow_n_tiles_a_wave_picks_match_numpy_bit_for_bit_on_the_interpreter(bn):
    shape = OP.shape(m=16, n=2 * bn + 9, k=73)  # a tail tile past N
    variant = build(OP, shape, OP.params_from_dict({**SMALL, "bn": bn, "grid": 2}), "sm_90")
    inputs = _whole_numbers(shape, np.random.default_rng(bn))
    out = interp.launch_with(OP, shape, variant, {}, inputs)["C"]
    assert np.array_equal(out.view(np.uint8), BFLOAT16.round(OP.reference(shape, inputs, {})["C"]).view(np.uint8))


@pytest.mark.parametrize("c_dtype", ["bf16", "fp32"])
@pytest.mark.parametrize("values", [{"bn": 16}, {"bn": 32, "split_k": 2},
                                    {"bn": 16, "schedule": "pingpong", "consumers": 2}])
def test_a_swapped_product_stores_c_transposed_bit_for_bit_at_tails_on_the_interpreter(c_dtype, values):
    """Cᵀ = B·Aᵀ: the kernel's 64-row slabs over N (129, a tail), its bn over M (17 tokens, a tail)."""
    shape = OP.shape(m=17, n=129, k=137, c_dtype=c_dtype)
    params = OP.params_from_dict({**SMALL, **values, "swap": True})
    variant = build(OP, shape, params, "sm_90")
    maps = OP.tensor_maps(shape, params)
    assert (maps["tma_a"].tensor, maps["tma_a"].box, maps["tma_b"].tensor, maps["tma_b"].box) == ("B", (64, 64), "A",
                                                                                                   (64, params.bn))
    assert variant.source.kernel_name.endswith("_sw") and params.label().endswith(" swap")
    inputs = _whole_numbers(shape, np.random.default_rng(5))
    out = interp.launch_with(OP, shape, variant, {}, inputs)["C"]
    exact = OP.reference(shape, inputs, {})["C"]
    expected = BFLOAT16.round(exact) if c_dtype == "bf16" else exact.astype(np.float32)
    assert np.array_equal(out.view(np.uint8), expected.view(np.uint8))


def _whole_e4m3(shape, rng):
    """e4m3 inputs of small whole numbers and scales of powers of two: every sum exact in fp32."""
    from mage_gen.dtypes import E4M3

    inputs = OP.make_inputs(shape, {}, rng)
    for name in ("A", "B"):
        held = inputs[name]
        held[:, :shape.k] = E4M3.round(rng.integers(-3, 4, (held.shape[0], shape.k)).astype(np.float32))
    inputs["scale_a"][:], inputs["scale_b"][:] = 0.5, 4.0
    return inputs


@pytest.mark.parametrize("c_dtype", ["bf16", "fp32"])
@pytest.mark.parametrize("values", [{}, {"bn": 32, "split_k": 2}, {"schedule": "pingpong", "consumers": 2},
                                    {"bn": 16, "swap": True}, {"epilogue": "tma"}])
def test_an_e4m3_product_with_per_tensor_scales_matches_numpy_bit_for_bit_at_tails(c_dtype, values):
    n = 136 if values.get("epilogue") == "tma" else 129
    shape = OP.shape(m=17, n=n, k=300, c_dtype=c_dtype, precision="e4m3")  # K past two 128-deep stages
    variant = build(OP, shape, OP.params_from_dict({**SMALL, **values}), "sm_90")
    assert "wgmma.mma_async.sync.aligned.m64n" in variant.compiled.ptx and ".f32.e4m3.e4m3" in variant.compiled.ptx
    inputs = _whole_e4m3(shape, np.random.default_rng(9))
    out = interp.launch_with(OP, shape, variant, {}, inputs)["C"]
    exact = OP.reference(shape, inputs, {})["C"]
    expected = BFLOAT16.round(exact) if c_dtype == "bf16" else exact.astype(np.float32)
    assert np.array_equal(out.view(np.uint8), expected.view(np.uint8))


def test_an_e4m3_kernel_passes_the_gate_on_the_interpreter_and_its_padding_is_nan():
    shape = OP.shape(m=40, n=72, k=200, precision="e4m3")
    inputs = OP.make_inputs(shape, {}, np.random.default_rng(0))
    assert inputs["A"].dtype == np.uint8 and inputs["A"].shape == (40, 208) and (inputs["A"][:, 200:] == 0x7F).all()
    assert inputs["scale_a"].shape == (1,) and 0.5 <= inputs["scale_a"][0] < 2
    variant = build(OP, shape, OP.params_from_dict(SMALL), "sm_90")
    assert interp.gate(OP, shape, variant, {}, np.random.default_rng(0)).passed
    maps = OP.tensor_maps(shape, OP.params_from_dict(SMALL))
    assert (maps["tma_a"].dtype, maps["tma_a"].box, maps["tma_a"].strides) == ("uint8", (128, 64), (208,))
    assert [a.name for a in OP.args(shape)] == ["C", "A", "B", "scale_a", "scale_b"]


def test_e4m3_takes_b_n_by_k_and_its_tolerance_grows_as_the_root_of_k():
    with pytest.raises(ConfigError, match="^precision: an e4m3 wgmma reads both operands K-major"):
        OP.shape(m=64, n=64, k=64, precision="e4m3", b_layout="kn")
    small, large = (OP.tolerance_of(OP.shape(m=64, n=64, k=k, precision="e4m3"), "C", FLOAT32) for k in (256, 4096))
    assert large == pytest.approx(4 * small, rel=1e-3)


@pytest.mark.parametrize("values", [{}, {"bn": 128}, {"bn": 32, "split_k": 2}, {"schedule": "pingpong", "consumers": 2},
                                    {"epilogue": "tma"}])
def test_e4m3_block_scales_are_applied_in_each_stages_promotion_bit_for_bit_on_the_interpreter(values):
    """DeepGEMM's layout: A's scales per row and 128 of K, B's per 128×128 block; N = 300 spans three blocks."""
    n = 136 if values.get("epilogue") == "tma" else 300
    shape = OP.shape(m=17, n=n, k=300, precision="e4m3_block")
    variant = build(OP, shape, OP.params_from_dict({**SMALL, "inflight": 0, **values}), "sm_90")
    rng = np.random.default_rng(4)
    inputs = _whole_e4m3(shape, rng)
    assert inputs["scale_a"].shape == (17, 3) and inputs["scale_b"].shape == (-(-n // 128), 3)
    for name in ("scale_a", "scale_b"):  # powers of two: every product exact
        inputs[name][:] = 2.0 ** rng.integers(-2, 3, inputs[name].shape)
    out = interp.launch_with(OP, shape, variant, {}, inputs)["C"]
    assert np.array_equal(out.view(np.uint8), BFLOAT16.round(OP.reference(shape, inputs, {})["C"]).view(np.uint8))


def test_block_scales_promote_a_stage_as_soon_as_it_is_done():
    with pytest.raises(ConfigError, match="^block-scales: e4m3_block promotes each stage's sums when they are done"):
        OP.validate(OP.shape(m=64, n=64, k=256, precision="e4m3_block"), OP.params_from_dict({"inflight": 1}))
    with pytest.raises(ConfigError, match="^registers: 256 accumulators"):  # a stage's sums held apart: twice over
        OP.validate(OP.shape(m=64, n=64, k=256, precision="e4m3_block"),
                    OP.params_from_dict({"bm": 64, "bn": 256, "consumers": 1, "inflight": 0}))


def test_the_gates_inputs_are_the_same_for_a_seed_however_many_threads_draw_them(monkeypatch):
    """Blocks of rows from children of the generator, on every core: a seed still fixes every value, whatever the
    host; values about standard normal, the padding past K NaN."""
    from concurrent.futures import ThreadPoolExecutor

    from mage_gen.dtypes import BFLOAT16
    from mage_gen.ops import base

    shape = OP.shape(m=300, n=5000, k=1001)  # B: several blocks of rows
    assert shape.n * shape.k > 2 * base.BLOCK_ELEMENTS
    many = OP.make_inputs(shape, {}, np.random.default_rng(8))
    monkeypatch.setattr(base, "_threads", [ThreadPoolExecutor(1)])
    one = OP.make_inputs(shape, {}, np.random.default_rng(8))
    assert all(np.array_equal(many[name], one[name]) for name in ("A", "B"))
    b = BFLOAT16.widen(many["B"])
    assert np.isnan(b[:, shape.k:]).all() and not np.isnan(b[:, :shape.k]).any()
    assert abs(b[:, :shape.k].mean()) < 0.01 and abs(b[:, :shape.k].std() - 1) < 0.01
    assert not np.array_equal(b[:1000, :shape.k], b[1000:2000, :shape.k])  # each block its own draws


# ---- gate silu (SwiGLU over a fused gate_up weight): C = silu(A·B_gateᵀ) ⊙ A·B_upᵀ ----

@pytest.mark.parametrize("shape, values", [
    (dict(m=129, n=258, k=73), {}),  # C's rows of 129 elements: stored from registers, one at a time
    (dict(m=70, n=272, k=200), {"bn": 128, "epilogue": "tma", "schedule": "pingpong", "consumers": 2, "grid": 1}),
    (dict(m=17, n=130, k=300, precision="e4m3"), {"bn": 32, "split_k": 2}),
    (dict(m=33, n=258, k=150, c_dtype="fp32"), {"bn": 256}),
])
def test_a_gated_product_passes_the_gate_on_the_interpreter(shape, values):
    passes_the_gate_on_the_interpreter(OP.shape(**shape, gate="silu"), values, 3)


@pytest.mark.parametrize("values", [
    {"cluster": 2},  # tiles of one column share B: each CTA copies a quarter of the tile, half from each half of B
    {"cluster": 2, "bn": 128, "epilogue": "tma", "stages": 3},
    {"cluster": 2, "multicast": "a", "epilogue": "tma"},  # tiles of one row share A, each copying both halves of B
    {"cluster": 2, "schedule": "pingpong", "consumers": 2, "grid": 4},
])
def test_a_gated_product_in_a_cluster_matches_numpy_bit_for_bit_at_tails(values):
    # M's tail in a cluster's second CTA; C's 69 columns end inside a tile, where the gate half's last rows read the
    # up half's first
    shape = OP.shape(m=257, n=138, k=200, c_dtype="fp32", gate="silu")
    variant = build(OP, shape, OP.params_from_dict({**SMALL, "producer_regs": 40, **values}), "sm_90")
    assert OP.geometry(shape, variant.params, {}).cluster == (2, 1, 1)
    shared = values.get("multicast", "b").upper()
    assert f"tma load {shared} multicast" in variant.census.hopper
    inputs = _whole_numbers(shape, np.random.default_rng(12))
    out = interp.launch_with(OP, shape, variant, {}, inputs)["C"]
    product = OP.reference(dataclasses.replace(shape, gate="none"), inputs, {})["C"]
    gate, up = product[:, :69], product[:, 69:]
    np.testing.assert_allclose(out, gate / (1 + np.exp(-gate)) * up, rtol=1e-5, atol=1e-6)


def test_a_gated_tile_pairs_each_gate_sum_with_the_up_sum_of_the_same_column():
    shape = OP.shape(m=64, n=256, k=64, c_dtype="fp32", gate="silu")
    variant = build(OP, shape, OP.params_from_dict({**SMALL, "bn": 128}), "sm_90")
    inputs = _whole_numbers(shape, np.random.default_rng(5))
    out = interp.launch_with(OP, shape, variant, {}, inputs)["C"]
    product = OP.reference(dataclasses.replace(shape, gate="none"), inputs, {})["C"]
    gate, up = product[:, :128], product[:, 128:]
    assert out.shape == (64, 128)
    np.testing.assert_allclose(out, gate / (1 + np.exp(-gate)) * up, rtol=1e-5, atol=1e-6)
    assert not np.allclose(out, up / (1 + np.exp(-up)) * gate, rtol=1e-3)  # the halves are not interchangeable


def test_a_gated_stage_copies_half_the_b_tile_from_each_half_of_b():
    shape = OP.shape(m=256, n=2048, k=512, gate="silu")
    p = OP.params_from_dict({"bm": 128, "bn": 256, "epilogue": "tma"})
    maps = OP.tensor_maps(shape, p)
    assert maps["tma_b"].dims == (512, 2048) and maps["tma_b"].box == (64, 128)
    assert maps["tma_c"].dims == (1024, 256) and OP.output_shapes(shape, {}) == {"C": (256, 1024)}
    text = OP.source(shape, p).text
    assert text.count("&tma_b") == 3 and "1024 + tn * 128" in text  # the prefetch, then gate and up rows
    assert OP.kernel_name(shape, p).startswith("gemm_sm90_bf16_nk_bf16_gsilu_m256_n2048_k512_b128x256")
    assert OP.shape_key(shape) == "m=256,n=2048,k=512,gate=silu/bf16/nk/bf16"  # not a size class of the plain key
    assert OP.shape_key(OP.shape(m=256, n=2048, k=512)) == "m=256,n=2048,k=512/bf16/nk/bf16"  # plain keys as stored


def test_a_gated_tile_of_c_that_is_not_whole_128_byte_boxes_is_stored_from_registers():
    shape = OP.shape(m=256, n=2048, k=512, gate="silu")
    assert OP.kernel_name(shape, OP.params_from_dict({"bn": 192, "epilogue": "tma"})).endswith("_direct")
    assert OP.kernel_name(shape, OP.params_from_dict({"bn": 256, "epilogue": "tma"})).endswith("_tma")


@pytest.mark.parametrize("shape, values, rule", [
    (dict(n=257), {}, "gate: gate silu pairs .* N must be even"),
    (dict(b_layout="kn"), {}, "gate: .* got N=256, b_layout kn"),
    (dict(precision="e4m3_block"), {}, "gate: .* per-block scales are not taken"),
    ({}, {"swap": True, "bn": 32}, "gate: gate silu pairs sums a thread holds: it takes no swap"),
    ({}, {"cluster": 2, "bn": 48}, "gate: .* bn=48 must be a multiple of 32"),
])
def test_a_gated_product_refuses_what_cannot_pair_its_sums(shape, values, rule):
    with pytest.raises(ConfigError, match="^" + rule):
        OP.validate(OP.shape(**{"m": 256, "n": 256, "k": 256, **shape, "gate": "silu"}), OP.params_from_dict(values))


# ---- bias (a vector of N, before the gate) and residual (a tensor like C, last) in the epilogue ----

@pytest.mark.parametrize("shape, values", [
    (dict(m=129, n=136, k=73, bias=True), {}),
    (dict(m=129, n=136, k=73, residual=True), {"epilogue": "tma"}),
    (dict(m=129, n=129, k=73, bias=True, residual=True), {}),  # odd N: elements one at a time
    (dict(m=70, n=272, k=200, gate="silu", bias=True, residual=True),
     {"bn": 128, "epilogue": "tma", "schedule": "pingpong", "consumers": 2, "grid": 1}),
    (dict(m=17, n=130, k=300, precision="e4m3", bias=True, residual=True), {"bn": 32, "split_k": 2}),
    (dict(m=33, n=258, k=150, c_dtype="fp32", gate="silu", bias=True, residual=True), {"bn": 64}),
    (dict(m=20, n=200, k=150, bias=True, residual=True), {"bn": 16, "swap": True}),
    (dict(m=129, n=136, k=73, b_layout="kn", bias=True, residual=True), {}),
    (dict(m=128, n=256, k=256, precision="e4m3_block", bias=True, residual=True), {"inflight": 0, "bn": 128}),
])
def test_a_bias_and_a_residual_pass_the_gate_on_the_interpreter(shape, values):
    shape = OP.shape(**shape)
    added = [name for name in ("bias", "residual") if getattr(shape, name)]
    assert [a.name for a in OP.args(shape)][-len(added):] == added  # after C, A, B and any scales
    passes_the_gate_on_the_interpreter(shape, values, 4)


@pytest.mark.parametrize("precision", ["bf16", "e4m3"])
@pytest.mark.parametrize("addend", ["bias", "residual"])
def test_a_kernel_that_left_out_an_addend_would_fail_the_gate(precision, addend):
    shape = OP.shape(m=64, n=256, k=512, precision=precision, **{addend: True})
    inputs = OP.make_inputs(shape, {}, np.random.default_rng(0))
    with_it = OP.reference(shape, inputs, {})["C"]
    without = OP.reference(dataclasses.replace(shape, **{addend: False}), inputs, {})["C"]
    error = np.linalg.norm(with_it - without) / np.linalg.norm(with_it)
    assert error > 10 * OP.tolerance_of(shape, "C", BFLOAT16)


def test_an_epilogue_names_its_kernel_and_key_and_is_one_of_the_ops_epilogue_fields():
    shape = OP.shape(m=256, n=2048, k=512, bias=True, residual=True)
    assert OP.shape_key(shape) == "m=256,n=2048,k=512,bias,residual/bf16/nk/bf16"
    assert "_bias_residual_m256" in OP.kernel_name(shape, OP.params_from_dict({}))
    assert OP.epilogue_fields == ("gate", "bias", "residual")


# ---- chains: a stage's wgmma steps dealt over several accumulator sets, added at the tile's end ----

@pytest.mark.parametrize("shape, values", [
    (dict(m=129, n=136, k=200, c_dtype="fp32"), {"chains": 4}),
    (dict(m=20, n=200, k=300), {"bn": 16, "swap": True, "chains": 4, "split_k": 2}),
    (dict(m=17, n=130, k=300, precision="e4m3"), {"chains": 2, "inflight": 0}),
    (dict(m=70, n=272, k=200, gate="silu"), {"bn": 128, "chains": 2, "schedule": "pingpong", "consumers": 2, "grid": 1}),
    (dict(m=129, n=136, k=73, b_layout="kn", c_dtype="fp32"), {"chains": 4}),
])
def test_chained_accumulators_pass_the_gate_on_the_interpreter(shape, values):
    variant = passes_the_gate_on_the_interpreter(OP.shape(**shape), values, 6)
    chains = values["chains"]
    assert variant.source.text.count(f"float chain{chains - 1}[") == 1 and f"_a{chains}_" in variant.source.kernel_name


def test_chains_hold_more_accumulators_and_block_scales_take_one():
    shape = OP.shape(m=256, n=256, k=256)
    with pytest.raises(ConfigError, match="^registers: 256 accumulators"):
        OP.validate(shape, OP.params_from_dict({"bn": 256, "chains": 2}))
    with pytest.raises(ConfigError, match="^chains: chains is one of"):
        OP.validate(shape, OP.params_from_dict({"chains": 3}))
    with pytest.raises(ConfigError, match="^chains: e4m3_block sums each stage apart"):
        OP.validate(OP.shape(m=256, n=256, k=256, precision="e4m3_block"),
                    OP.params_from_dict({"bn": 64, "chains": 2, "inflight": 0}))


# ---- stream K: the last tiles' K steps dealt evenly over the grid's CTAs, a tile's pieces summed in CTA order ----

@pytest.mark.parametrize("shape, values", [
    # 9 tiles of 4 steps, 5 whole, then 4 over 5 CTAs: shares begin and end inside tiles, a tile's first piece its
    # CTA's last
    (dict(m=129, n=136, k=200, c_dtype="fp32"), {"grid": 5}),
    (dict(m=64, n=64, k=512, c_dtype="fp32"), {"grid": 3}),  # one tile in three pieces
    (dict(m=129, n=136, k=200, c_dtype="fp32"), {"grid": 4}),  # a last wave of 1 tile: 4 whole, then 5
    (dict(m=129, n=136, k=200, c_dtype="fp32"), {"bn": 48, "grid": 4}),  # 6 chunks a thread, read back 3 at a time
    (dict(m=200, n=272, k=300, gate="silu"), {"bn": 128, "grid": 5, "schedule": "pingpong", "consumers": 2}),
    (dict(m=70, n=272, k=300, gate="silu", bias=True), {"bn": 128, "grid": 4, "schedule": "pingpong", "consumers": 2}),
    (dict(m=20, n=200, k=300, residual=True), {"bn": 16, "swap": True, "grid": 7, "chains": 2}),
    (dict(m=17, n=130, k=600, precision="e4m3"), {"bn": 32, "grid": 5}),
    (dict(m=128, n=256, k=512, precision="e4m3_block"), {"inflight": 0, "bn": 128, "grid": 3}),
])
def test_stream_k_passes_the_gate_on_the_interpreter(shape, values):
    shape = OP.shape(**shape)
    variant = passes_the_gate_on_the_interpreter(shape, {**values, "stream_k": True}, 8)
    assert OP.geometry(shape, variant.params, {}).grid == (values["grid"], 1, 1)
    assert variant.source.kernel_name.endswith("_sk" if not variant.params.swap else "_sk_sw")
    assert [a.name for a in OP.launch_args(shape, variant.params)][-2:] == ["workspace", "counters"]


def test_stream_k_keeps_two_partial_tiles_per_cta_and_says_how_it_sums():
    from mage_gen.ops.gemm_sm90 import counters, workspace_floats

    shape = OP.shape(m=129, n=136, k=200)
    params = OP.params_from_dict({**SMALL, "grid": 3, "stream_k": True})
    assert workspace_floats(shape, params) == 2 * 3 * 64 * 64 and counters(shape, params) == 3 * 3  # a counter a tile
    assert OP.contract(shape, params)["determinism"].startswith("each tile of C is the sum of its partials (the pieces")


@pytest.mark.parametrize("shape, grid, waves", [
    (dict(m=129, n=136, k=200), 10, 0),  # 9 tiles: under a wave, all streamed
    (dict(m=129, n=136, k=200), 5, 1),  # 5 whole, then the last 4
    (dict(m=129, n=136, k=200), 4, 1),  # the last wave holds 1 tile: 4 whole, then 5
    (dict(m=129, n=136, k=200), 3, 2),  # three whole waves: the last streamed, a tile a CTA
    (dict(m=2048, n=28672, k=4096, gate="silu"), 132, 13),  # 1792 tiles of 128×256: the last 76 streamed
    (dict(m=2048, n=4096, k=4096), 132, 1),  # 256 tiles: the last 124
])
def test_stream_k_streams_the_last_partial_wave_of_tiles_or_one_and_a_half(shape, grid, waves):
    from mage_gen.ops.gemm_sm90 import stream_waves

    shape = OP.shape(**shape)
    small = shape.m < 1024
    values = {**SMALL, "grid": grid, "stream_k": True} if small else {"bm": 128, "bn": 256, "grid": grid,
                                                                        "stream_k": True}
    params = OP.params_from_dict(values)
    tiles = OP.geometry(shape, OP.params_from_dict({**values, "stream_k": False, "grid": 0}), {}).grid[0]
    assert stream_waves(shape, params) == waves
    streamed = tiles - waves * grid
    assert grid / 2 <= streamed < 1.5 * grid if tiles >= grid else streamed == tiles
    text = (build(OP, shape, params, "sm_90").source if small else OP.source(shape, params)).text
    assert f"wave < {waves} || it < sk_end" in text


def test_stream_k_takes_a_grid_of_single_ctas_and_no_split():
    shape = OP.shape(m=256, n=256, k=256)
    for values, got in (({"grid": 0}, "grid 0"), ({"grid": 132, "split_k": 2}, "split_k 2"),
                        ({"grid": 132, "cluster": 2}, "cluster 2")):
        with pytest.raises(ConfigError, match=f"^stream-k: .* got .*{got}"):
            OP.validate(shape, OP.params_from_dict({**values, "stream_k": True}))
    params = OP.params_from_dict({"grid": 132, "stream_k": True})
    assert OP.geometry(OP.shape(m=64, n=128, k=128), params, {}).grid == (2, 1, 1)  # at most a CTA per step


# ---- stamps: a probe's record of each CTA's phases (bench/probes/gemm_sm90_timeline.py) ----

@pytest.mark.parametrize("shape, values", [
    (dict(m=16, n=4096, k=4096), {"bm": 64, "bn": 128, "consumers": 1, "stages": 8, "split_k": 4}),
    (dict(m=512, n=6144, k=4096), {"stream_k": True, "grid": 132}),
    (dict(m=2048, n=4096, k=4096), {"schedule": "pingpong", "epilogue": "tma", "grid": 132}),
    (dict(m=128, n=28672, k=4096, gate="silu"), {"bn": 256, "stages": 3}),
])
def test_stamps_add_a_record_and_leave_the_kernel_s_work_as_it_was(shape, values):
    shape = OP.shape(**shape)
    plain, stamped = (build(OP, shape, OP.params_from_dict({**values, "stamps": s}), "sm_90") for s in (False, True))
    assert stamped.source.kernel_name == plain.source.kernel_name + "_stamps"
    assert "mg_stamps" not in plain.source.text and "mg_stamps" not in plain.compiled.ptx
    assert re.search(rf"\.global \.align 8 \.b8 mg_stamps\[{(STAMP_CTAS + 1) * STAMP_SLOTS * 8}\];",
                     stamped.compiled.ptx)
    # the same copies, products, barriers and stores of C: only the record's stores are new
    assert stamped.census.hopper == plain.census.hopper
    assert stamped.census.stores_of("C") == plain.census.stores_of("C")
    assert stamped.census.spill_bytes <= 16


def test_stamps_and_early_copies_are_a_probe_s_switches_outside_every_search_space():
    for switch in ("stamps", "early_copies"):
        for preset in preset_names(OP.name):
            assert switch not in dict(load_space(OP, preset).axes)
        assert switch not in OP.params_to_dict(OP.params_from_dict({}))


def test_early_copies_let_the_producer_arrive_at_the_setup_barrier_and_copy_while_the_consumers_wait():
    shape = OP.shape(m=16, n=4096, k=4096)
    values = {"bm": 64, "bn": 128, "consumers": 1, "stages": 8, "split_k": 4, "epilogue": "direct", "grid": 0}
    plain, early = (build(OP, shape, OP.params_from_dict({**values, "early_copies": e}), "sm_90") for e in (False, True))
    assert early.source.kernel_name == plain.source.kernel_name + "_early"
    assert "bar.arrive" not in plain.compiled.ptx and len(re.findall(r"\bbar\.sync 0;", plain.compiled.ptx)) == 1
    arrivals = re.findall(r"bar\.arrive %r\d+, (\d+);", early.compiled.ptx)
    assert arrivals == ["256"] and not re.search(r"\bbar\.sync 0;", early.compiled.ptx)  # every thread counted
    assert early.census.hopper == plain.census.hopper and early.census.stores_of("C") == plain.census.stores_of("C")
    with pytest.raises(ConfigError, match="^early-copies: .* use cluster 1"):
        OP.validate(OP.shape(m=256, n=256, k=256), OP.params_from_dict({"cluster": 2, "early_copies": True}))


@pytest.mark.parametrize("values", [{}, {"split_k": 2, "grid": 0}, {"schedule": "pingpong", "consumers": 2, "grid": 1,
                                                                    "epilogue": "tma"}])
def test_early_copies_on_the_interpreter_match_numpy_bit_for_bit_at_tails(values):
    shape = OP.shape(m=129, n=136, k=200)
    variant = build(OP, shape, OP.params_from_dict({**SMALL, **values, "early_copies": True}), "sm_90")
    inputs = _whole_numbers(shape, np.random.default_rng(5))
    out = interp.launch_with(OP, shape, variant, {}, inputs)["C"]
    assert np.array_equal(out.view(np.uint8), BFLOAT16.round(OP.reference(shape, inputs, {})["C"]).view(np.uint8))


def test_a_label_tells_apart_every_config_that_renders_another_kernel():
    # a probe names its subjects by label: two configs of one label would be timed as one
    base = OP.params_from_dict({"bm": 64, "bn": 128, "consumers": 1, "split_k": 4})
    others = [dataclasses.replace(base, early_copies=True), dataclasses.replace(base, stamps=True),
              dataclasses.replace(base, split_sum="ticket")]
    assert len({p.label() for p in [base, *others]}) == 4
