"""Split K in the Hopper GEMM (mage_gen/ops/gemm_sm90.py, split_k): with split_k 1 every stored winner renders the
text it was tuned with; with more, units are (tile, slice of K), each partial goes to the workspace, the tile's
counter says which unit came last, and that one sums the partials in slice order and leaves the counter zero.
On the CPU interpreter: C bit for bit at tails, the same bits whichever block finishes first, the counters left
zero for the next launch, and each planted bug of the reduction caught."""

import dataclasses
import json
import re
import shutil

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from drawn import gate_a_drawn_gemm_on_the_interpreter  # tests/drawn.py
from mage_gen import interp
from mage_gen.compile import compile_source
from mage_gen.dtypes import BFLOAT16
from mage_gen.errors import ConfigError
from mage_gen.ops import get_op
from mage_gen.ops.base import launch_args
from mage_gen.ops.gemm_sm90 import SPLIT_SUMS, counters, workspace_floats
from mage_gen.resources import data_dir
from mage_gen.space import load_space
from mage_gen.store import is_current
from mage_gen.variants import build
from test_gemm_sm90 import SMALL, _whole_numbers

OP = get_op("gemm_sm90")


def _stored_winners():
    for path in sorted(data_dir("tuned").glob("*/gemm_sm90.json")):  # every GPU's
        for entry in json.loads(path.read_text())["entries"].values():
            yield OP.shape(**entry["shape"]), entry


def test_every_stored_winner_renders_as_it_was_tuned_and_an_unsplit_one_needs_no_working_buffers():
    winners = list(_stored_winners())
    assert winners and any(OP.params_from_dict(e["params"]).split_k > 1 for _, e in winners)
    for shape, entry in winners:
        params = OP.params_from_dict(entry["params"])
        source = OP.source(shape, params)
        assert is_current(entry, source), f"{shape}: {params.label()} renders other text than it was tuned with"
        unsplit = params.split_k == 1
        assert (launch_args(OP, shape, params) == OP.args(shape)) == unsplit
        assert ("working" not in OP.contract(shape, params)) == unsplit


def test_split_k_is_an_axis_of_the_space_and_searched_only_where_m_is_small():
    shape = OP.shape(m=16, n=4096, k=4096)
    for preset in ("full", "quick"):
        assert dict(load_space(OP, preset, shape).axes)["split_k"] == (1,)
    assert dict(load_space(OP, "skinny", shape).axes)["split_k"] == (1, 2, 4)
    text = (data_dir("search") / "gemm_sm90.toml").read_text()
    assert "split_k = [1, 2, 3, 4, 6, 8]" in text


@pytest.mark.parametrize("k, values, rule", [
    (4096, {"split_k": 0}, "split-k: split_k is 1 (no split) to 16 slices of K, got 0"),
    (4096, {"split_k": 17}, "split-k: split_k is 1 (no split) to 16 slices of K, got 17"),
    (129, {"split_k": 4}, "split-k: split_k=4 slices need a 64-deep step of K each, and K=129 has 3; use split_k ≤ 3"),
    (4096, {"plant": "split_reset"}, "plant: split_reset is a bug of the split-K reduction through the workspace: "
                                      "plant it with split_k > 1 and split_sum global or ticket"),
    (4096, {"plant": "split_fence", "split_k": 2, "split_sum": "cluster"},
     "plant: split_fence is a bug of the split-K reduction through the workspace: plant it with split_k > 1 and "
     "split_sum global or ticket"),
    (4096, {"split_sum": "dsmem"}, "split-sum: split_sum is one of ('global', 'ticket', 'cluster'), got 'dsmem'"),
    (4096, {"split_k": 2, "split_sum": "ticket", "schedule": "pingpong", "consumers": 2},
     "split-sum: split_sum ticket takes cluster 1 and cooperative consumers, got cluster 1, pingpong"),
    (4096, {"split_k": 2, "split_sum": "ticket", "cluster": 2},
     "split-sum: split_sum ticket takes cluster 1 and cooperative consumers, got cluster 2, cooperative"),
    (4096, {"split_k": 3, "split_sum": "cluster"}, "split-sum: split_sum cluster makes a tile's slices one cluster's "
     "CTAs, a CTA each: it takes split_k 2, 4 or 8, cluster 1, grid 0 and cooperative consumers, got split_k 3, "
     "cluster 1, grid 0, cooperative"),
    (4096, {"split_k": 2, "split_sum": "cluster", "grid": 132}, "split-sum: split_sum cluster makes a tile's slices "
     "one cluster's CTAs, a CTA each: it takes split_k 2, 4 or 8, cluster 1, grid 0 and cooperative consumers, got "
     "split_k 2, cluster 1, grid 132, cooperative"),
    (4096, {"split_k": 2, "split_sum": "cluster", "bm": 128, "bn": 256, "stages": 2},
     "split-sum: split_sum cluster keeps a 128×256 fp32 partial in the stages' 98304 bytes: use more stages"),
])
def test_rules_refuse_a_split_that_cannot_be_built_with_a_line_naming_the_rule(k, values, rule):
    with pytest.raises(ConfigError, match="^" + re.escape(rule) + "$"):
        OP.validate(OP.shape(m=256, n=256, k=k), OP.params_from_dict(values))


def test_units_are_slices_of_tiles_and_the_workspace_and_counters_are_arguments_after_b():
    shape = OP.shape(m=16, n=4096, k=4096)
    p = OP.params_from_dict({"bm": 64, "bn": 64, "consumers": 1, "grid": 0, "split_k": 2})
    assert OP.geometry(shape, p, {}).grid == (128, 1, 1)  # 64 tiles, two units each
    assert OP.geometry(shape, dataclasses.replace(p, grid=132), {}).grid == (128, 1, 1)
    assert workspace_floats(shape, p) == 2 * 64 * 64 * 64 and counters(shape, p) == 64
    args = launch_args(OP, shape, p)
    assert [(a.name, a.kind) for a in args] == [("C", "out"), ("A", "in"), ("B", "in"), ("workspace", "scratch"),
                                                ("counters", "zeroed")]
    assert args[3].elements == workspace_floats(shape, p) and args[4].elements == 64
    contract = OP.contract(shape, p)
    working = contract["working"]
    assert working["workspace"]["bytes"] == 4 * 2 * 64 * 64 * 64 and working["counters"]["elements"] == 64
    assert "zero" in working["counters"]["contents"] and "slice order" in contract["determinism"]
    text = OP.source(shape, p).text
    assert "float* __restrict__ workspace, unsigned* __restrict__ counters," in text
    assert OP.kernel_name(shape, p).endswith("_k2") and "split2" in p.label()
    # by ticket: a second counter a tile (the partials stored), the same workspace
    ticket = dataclasses.replace(p, split_sum="ticket")
    assert counters(shape, ticket) == 2 * 64 and workspace_floats(shape, ticket) == workspace_floats(shape, p)
    assert OP.kernel_name(shape, ticket).endswith("_k2t") and "by ticket" in ticket.label()
    # the slices of K's 64 steps: 0-31 and 32-63
    assert "kb_begin = slice * 64 / 2, kb_end = (slice + 1) * 64 / 2" in text
    # at M = 16 only the first 16 rows of a 64-row tile go through the workspace: the other warps store and sum none
    assert text.count("if (part_row + 0 < 16)") == 2
    assert "part_row" not in OP.source(OP.shape(m=128, n=4096, k=4096), p).text


SPLIT_CALLER = r"""
#include <stdio.h>
#include "gemm_split.h"

#define CALL(label, expr) do { printf("call %s\n", label); printf("result %d\n", (int)(expr)); } while (0)

int main()
{
    CUfunction f = (CUfunction)0x1000;
    CUstream s = (CUstream)0x2000;
    unsigned short* c = (unsigned short*)0x100000;
    const unsigned short* a = (const unsigned short*)0x200000;
    const unsigned short* b = (const unsigned short*)0x300000;
    float* workspace = (float*)0x400000;
    unsigned int* counters = (unsigned int*)0x500000;
    CALL("split", gemm_split_launch(f, c, a, b, workspace, counters, s));
    CALL("misaligned_workspace", gemm_split_launch(f, c, a, b, workspace + 1, counters, s));
    CALL("misaligned_counters", gemm_split_launch(f, c, a, b, workspace, (unsigned int*)0x500002, s));
    return 0;
}
"""


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc is not on PATH")
def test_the_emitted_header_takes_the_workspace_and_counters_after_b_and_states_their_contract(tmp_path):
    from mage_gen.emit import emit
    from test_emit import STUB_GEMM_LIBCUDA, run_against_stub

    shape = OP.shape(m=16, n=4096, k=4096)
    p = OP.params_from_dict({"bm": 64, "bn": 64, "consumers": 1, "grid": 132, "split_k": 2})
    emit(OP, shape, p, "sm_90", tmp_path, None, stem="gemm_split")
    doc = json.loads((tmp_path / "gemm_split.launch.json").read_text())
    assert [(a["name"], a["type"]) for a in doc["args"][:5]] == [
        ("C", "unsigned short*"), ("A", "const unsigned short*"), ("B", "const unsigned short*"),
        ("workspace", "float*"), ("counters", "unsigned int*")]
    assert doc["contract"]["working"]["counters"]["elements"] == 64
    header = (tmp_path / "gemm_split.h").read_text()
    assert f"//   workspace: float32 [{2 * 64 * 64 * 64}] ({4 * 2 * 64 * 64 * 64} bytes), scratch:" in header
    assert "//   counters: uint32 [64] (256 bytes), all zero before the first launch" in header
    assert "if ((CUdeviceptr)workspace % 16 != 0) return CUDA_ERROR_INVALID_VALUE;" in header
    got = run_against_stub(tmp_path, STUB_GEMM_LIBCUDA, SPLIT_CALLER)
    launch = OP.geometry(shape, p, {})
    # the stub prints the fourth argument as a tensor map's first word: here the workspace's address
    assert got["split"][-2:] == [f"launch 0x1000 grid {launch.grid[0]} 1 1 block 256 1 1 shared "
                                 f"{launch.dynamic_shared_bytes} stream 0x2000 arg0 0x100000 map0 0x400000 extra (nil)",
                                 "result 0"]
    assert got["misaligned_workspace"] == got["misaligned_counters"] == ["result 1"]


@pytest.mark.parametrize("values", [{"split_k": 2}, {"split_k": 4, "bm": 64, "consumers": 1},
                                    {"split_k": 2, "schedule": "pingpong", "consumers": 2}])
def test_the_census_counts_one_arrival_and_two_fences_and_the_partials_as_16_byte_accesses(values):
    shape = OP.shape(m=512, n=512, k=512)
    p = OP.params_from_dict({**values, "bn": 128, "epilogue": "tma"})
    c = build(OP, shape, p, "sm_90").census
    assert c.hopper["atom.relaxed.gpu.global.add.u32"] == 1
    assert c.hopper["fence.acq_rel.gpu"] == 2  # release before the arrival, acquire after the last one
    slabs = (p.bm // p.consumers if p.schedule == "cooperative" else p.bm) // 64
    assert c.stores_of("workspace") == c.stores_of("workspace", "v4") == slabs * p.bn // 8
    assert c.loads_of("workspace") == c.loads_of("workspace", "v4") == slabs * p.bn // 8 * p.split_k
    assert c.stores_of("counters") == 1  # the reset
    assert c.unfenced_async_reads == {} and c.spill_bytes == 0
    plain = build(OP, shape, dataclasses.replace(p, split_k=1), "sm_90").census
    assert not [key for key in plain.hopper if key.startswith(("atom", "fence.acq_rel"))]


def test_by_ticket_the_last_unit_stores_no_partial_and_waits_on_a_second_counter():
    shape = OP.shape(m=512, n=512, k=512)
    p = OP.params_from_dict({"split_k": 2, "bn": 128, "epilogue": "tma", "split_sum": "ticket"})
    variant = build(OP, shape, p, "sm_90")
    c, text = variant.census, variant.source.text
    # the ticket, the count of a stored partial, and the wait's reads of that count: relaxed atomics
    assert c.hopper["atom.relaxed.gpu.global.add.u32"] >= 3
    assert c.hopper["fence.acq_rel.gpu"] == 2  # release before the count, acquire after the wait
    assert c.stores_of("counters") == 2  # both reset by the last unit
    tiles = counters(shape, p) // 2
    assert f"wait_count(counters + {tiles} + tile, 1);" in text
    # the ticket taken in the main loop, as the last step begins, before that step's wait for its stage
    taken = text.index("if (kb == kb_end - 1 && threadIdx.x == 128)")
    assert "atom.relaxed.gpu.global.add.u32" in text[taken:text.index("wait_phase(full_bar", taken)]
    # the partial is stored only where the ticket was not the last
    assert text.index("if (!*last_flag) {") < text.index("tensor=workspace") < text.index("wait_count(counters")
    plain = OP.source(shape, dataclasses.replace(p, split_sum="global")).text
    assert "wait_count" not in plain and "ticket" not in plain


# ---- on the CPU interpreter ----

@pytest.mark.parametrize("c_dtype", ["bf16", "fp32"])
@pytest.mark.parametrize("values", [{"split_k": 2}, {"split_k": 3, "grid": 3},
                                    {"split_k": 2, "schedule": "pingpong", "consumers": 2, "grid": 1},
                                    {"split_k": 3, "bn": 128, "epilogue": "tma"},
                                    {"split_k": 3, "grid": 3, "split_sum": "ticket"},
                                    {"split_k": 4, "grid": 1, "split_sum": "ticket"}])
def test_a_split_config_on_the_interpreter_matches_numpy_bit_for_bit_at_tails_and_leaves_the_counters_zero(
        c_dtype, values):
    # M, N, K ≡ 1 mod 8, K = 201 four 64-deep steps, the last a tail (a TMA store needs N·size on 16 bytes)
    n = 136 if values.get("epilogue") == "tma" else 129
    shape = OP.shape(m=129, n=n, k=201, c_dtype=c_dtype)
    variant = build(OP, shape, OP.params_from_dict({**SMALL, **values}), "sm_90")
    inputs = _whole_numbers(shape, np.random.default_rng(7))
    exact = OP.reference(shape, inputs, {})["C"]
    expected = BFLOAT16.round(exact) if c_dtype == "bf16" else exact.astype(np.float32)
    working = {}
    for launch in range(2):  # the second on the counters the first left (launch_with checks they are zero)
        out = interp.launch_with(OP, shape, variant, {}, inputs, working=working, reverse=bool(launch))["C"]
        assert out.dtype == expected.dtype and np.array_equal(out.view(np.uint8), expected.view(np.uint8)), launch
        assert not working["counters"].any()
        working["workspace"][:] = np.nan


@pytest.mark.parametrize("split_sum", ["global", "ticket"])
def test_the_sum_is_the_same_bits_whichever_unit_arrives_last(split_sum):
    # K's 5 steps in 3 slices, random (not whole) values: fp32 sums that differ with their order; grid 2 takes
    # slices of one tile in both blocks, so running the blocks the other way round changes who arrives last
    shape = OP.shape(m=65, n=65, k=321, c_dtype="fp32")
    p = OP.params_from_dict({**SMALL, "split_k": 3, "split_sum": split_sum})
    inputs = OP.make_inputs(shape, {}, np.random.default_rng(3))
    outputs = {}
    for plant in ("", "split_order"):
        variant = build(OP, shape, dataclasses.replace(p, plant=plant), "sm_90")
        forward, backward = (interp.launch_with(OP, shape, variant, {}, inputs, reverse=r)["C"] for r in (False, True))
        outputs[plant] = np.count_nonzero(forward.view(np.uint32) != backward.view(np.uint32))
    assert outputs[""] == 0 and outputs["split_order"] > 0


@pytest.mark.parametrize("split_sum, plant, caught", [
    ("global", "split_reset", "counters: 4 of 4 words are not zero after the launch"),
    ("global", "split_fence", "stored with nothing that makes the store visible to it"),
    ("global", "split_order", "is not the same bits with the blocks run in the reverse order"),
    ("ticket", "split_reset", "counters: 8 of 8 words are not zero after the launch"),
    ("ticket", "split_fence", "stored with nothing that makes the store visible to it"),
    ("ticket", "split_order", "is not the same bits with the blocks run in the reverse order"),
])
def test_the_interpreter_gate_catches_each_planted_bug_of_the_reduction(split_sum, plant, caught):
    # 2×2 tiles of 64, K's 5 steps in 3 slices (of two, the order could not show: a + b is b + a, bit for bit)
    shape = OP.shape(m=100, n=120, k=300, c_dtype="fp32")
    clean = OP.params_from_dict({**SMALL, "split_k": 3, "split_sum": split_sum})
    assert interp.gate(OP, shape, build(OP, shape, clean, "sm_90"), {}, np.random.default_rng(0)).passed
    planted = build(OP, shape, dataclasses.replace(clean, plant=plant), "sm_90")
    result = interp.gate(OP, shape, planted, {}, np.random.default_rng(0))
    assert not result.passed and caught in result.reason, result.reason


@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_drawn_split_configs_pass_the_interpreters_gate(data):
    gate_a_drawn_gemm_on_the_interpreter(data, st.integers(65, 400), split_k=(2, 3, 4))


def test_inspect_lists_a_split_kernels_atomics_and_fences():
    from test_cli import mage_gen

    done = mage_gen("inspect", "gemm_sm90", "--m", "16", "--n", "4096", "--k", "4096", "--config",
                    "bm=64,bn=64,consumers=1,split_k=2", "--json")
    assert done.returncode == 0, done.stderr
    hopper = json.loads(done.stdout)["census"]["hopper"]
    assert hopper["atom.relaxed.gpu.global.add.u32"] == 1 and hopper["fence.acq_rel.gpu"] == 2
    table = mage_gen("inspect", "gemm_sm90", "--m", "16", "--n", "4096", "--k", "4096", "--config",
                     "bm=64,bn=64,consumers=1,split_k=2")
    assert table.returncode == 0 and "atomics" in table.stdout, table.stderr


# ---- split_sum cluster: a tile's slices are one cluster's CTAs, summed in distributed shared memory ----

@pytest.mark.parametrize("shape, values", [
    (dict(m=20, n=136, k=300), {"bm": 64, "bn": 64, "consumers": 1, "split_k": 2}),
    (dict(m=129, n=136, k=520, c_dtype="fp32"), {"split_k": 4, "stages": 4}),
    (dict(m=129, n=136, k=520), {"split_k": 4, "stages": 4, "epilogue": "tma", "inflight": 0}),
    (dict(m=20, n=200, k=300, bias=True, residual=True), {"bm": 64, "bn": 16, "consumers": 1, "swap": True,
                                                         "split_k": 2, "chains": 2}),
    (dict(m=70, n=272, k=600, gate="silu"), {"bn": 128, "split_k": 8, "stages": 6}),
    (dict(m=33, n=136, k=520, b_layout="kn"), {"bm": 64, "bn": 128, "consumers": 1, "split_k": 2}),
    (dict(m=17, n=130, k=700, precision="e4m3"), {"bm": 64, "bn": 32, "consumers": 1, "split_k": 2}),
])
def test_a_split_summed_in_a_cluster_or_by_ticket_gives_the_bits_of_the_split_summed_by_the_last_to_arrive(
        shape, values):
    shape = OP.shape(**shape)
    through = {s: build(OP, shape, OP.params_from_dict({**values, "split_sum": s}), "sm_90") for s in SPLIT_SUMS}
    inputs = OP.make_inputs(shape, {}, np.random.default_rng(5))
    outs = {s: interp.launch_with(OP, shape, v, {}, inputs)["C"] for s, v in through.items()}
    assert np.array_equal(outs["global"].view(np.uint8), outs["cluster"].view(np.uint8))
    assert np.array_equal(outs["global"].view(np.uint8), outs["ticket"].view(np.uint8))
    clustered = through["cluster"]
    assert interp.gate(OP, shape, clustered, {}, np.random.default_rng(6)).passed  # both block orders
    # a cluster of split_k CTAs a tile, no workspace, counters, gpu-scope fence or atomic
    launch = OP.geometry(shape, clustered.params, {})
    assert launch.cluster == (values["split_k"], 1, 1) and launch.grid == OP.geometry(shape, through["global"].params,
                                                                                      {}).grid
    assert [a.kind for a in launch_args(OP, shape, clustered.params)].count("scratch") == 0
    assert clustered.source.kernel_name == through["global"].source.kernel_name.replace(
        f"_k{values['split_k']}", f"_k{values['split_k']}c")
    assert "fence.acq_rel.gpu" not in clustered.compiled.ptx and "atom." not in clustered.compiled.ptx


@pytest.mark.parametrize("which, caught", [
    (2, "not the same bits with the blocks run in the reverse order"),  # the partials' cluster barrier
    (3, "which has exited"),  # the last one: a peer left before CTA 0 read its partial
])
def test_the_interpreter_catches_a_cluster_sum_s_missing_barrier(which, caught):
    shape = OP.shape(m=129, n=136, k=520)
    variant = build(OP, shape, OP.params_from_dict({"split_k": 4, "stages": 4, "split_sum": "cluster"}), "sm_90")
    sync = 'asm volatile("barrier.cluster.arrive.release.aligned; barrier.cluster.wait.acquire.aligned;" ::: "memory");'
    text = variant.source.text
    at = -1
    for _ in range(which):
        at = text.index(sync, at + 1)
    source = dataclasses.replace(variant.source, text=text[:at] + text[at + len(sync):])
    broken = dataclasses.replace(variant, compiled=compile_source(source, "sm_90a"))
    result = interp.gate(OP, shape, broken, {}, np.random.default_rng(0))
    assert not result.passed and caught in result.reason, result.reason


def test_the_skinny_preset_keeps_the_workspace_sum_until_a_probe_measures_the_cluster_s():
    shape = OP.shape(m=16, n=4096, k=4096)
    assert dict(load_space(OP, "skinny", shape).axes)["split_sum"] == ("global",)
    assert "split_sum = [\"global\", \"ticket\", \"cluster\"]" in (data_dir("search") / "gemm_sm90.toml").read_text()

