import dataclasses
import os

import numpy as np
import pytest

from mage_gen import interp
from mage_gen.census import take_census
from mage_gen.compile import compile_source
from mage_gen.errors import CompileError, ConfigError
from mage_gen.ops import get_op
from mage_gen.ops.layernorm import Params
from mage_gen.render import Source, environment, render

OP = get_op("layernorm")


def test_second_compile_is_a_cache_hit_with_the_same_binary():
    source = OP.source(OP.shape(d=333), Params(threads=64, vector=4))
    first = compile_source(source)
    second = compile_source(source)
    assert not first.from_cache and second.from_cache
    assert first.cubin == second.cubin and first.ptx == second.ptx and first.key == second.key


def test_cache_key_follows_source_and_arch():
    a = OP.source(OP.shape(d=512), Params(threads=64, vector=8))
    b = OP.source(OP.shape(d=512), Params(threads=64, vector=8, rsqrt="exact"))
    assert compile_source(a).key != compile_source(b).key
    assert compile_source(a, "sm_80").key != compile_source(a, "sm_90").key


@pytest.mark.parametrize("arch", ["sm_80", "sm_89", "sm_90"])
def test_builds_for_each_supported_arch(arch):
    compiled = compile_source(OP.source(OP.shape(d=768), Params()), arch)
    assert f".target {arch}" in compiled.ptx and compiled.cubin[:4] == b"\x7fELF"


def test_unknown_arch_is_a_config_error():
    with pytest.raises(ConfigError, match="^arch:"):
        compile_source(OP.source(OP.shape(d=768), Params()), "sm_10")


def test_compile_error_carries_nvrtc_log():
    broken = Source(text='extern "C" __global__ void k() { undeclared_thing(); }', kernel_name="k",
                    template="-", template_hash="-", params=None)
    with pytest.raises(CompileError, match="undeclared_thing"):
        compile_source(broken)


VOCABULARY_PROBE = """{% import "ptx.j2" as ptx %}
extern "C" __global__ void probe(float* out, const float* in)
{
    __shared__ __align__(16) float tile[64];
    const unsigned dst = {{ ptx.smem_addr('tile + 4 * threadIdx.x') }};
    {{ ptx.cp_async('dst', 'in + 4 * threadIdx.x', 16, 'cg') }}
    {{ ptx.cp_async('dst', 'in + 4 * threadIdx.x', 8) }}
    {{ ptx.cp_async('dst', 'in + 4 * threadIdx.x', 4, 'ca', 'threadIdx.x < 3 ? 4 : 0') }}
    {{ ptx.cp_async_commit() }}
    {{ ptx.cp_async_wait(1) }}
    {{ ptx.cp_async_wait(0) }}
    {{ ptx.barrier() }}
    float v[4], s, r;
    {{ ptx.ld_shared(regs('v', 4), 'dst') }}
    {{ ptx.st_shared('dst', regs('v', 2)) }}
    {{ ptx.ld_global(['s'], 'in', 'nc_na', 'in') }}
    {{ ptx.warp_sum('s') }}
    {{ ptx.rsqrt('r', 's', 'approx') }}
    {{ ptx.fma('s', 'r', 'v[0]', 'v[1]') }}
    {{ ptx.st_global('out + 4 * threadIdx.x', regs('v', 4), 'cs', 'out') }}
    {{ ptx.st_global('out', ['s'], '', 'out') }}
}
"""


def test_ptx_vocabulary_compiles_and_is_counted():
    text = environment().from_string(VOCABULARY_PROBE).render()
    compiled = compile_source(Source(text=text, kernel_name="probe", template="-", template_hash="-", params=None))
    c = take_census(compiled)
    assert c.cp_async == {4: 1, 8: 1, 16: 1}
    assert c.commit_groups == 1 and c.wait_groups == {0: 1, 1: 1}
    assert c.loads_of("in", "scalar") == 1 and c.stores_of("out", "v4") == 1 and c.stores_of("out", "scalar") == 1
    assert c.shfl_sync == 5 and c.rsqrt_approx == 1 and c.bar_sync == 1
    assert c.shared_loads >= 1 and c.shared_stores >= 1
    assert "ld.global.nc.L1::no_allocate.f32" in compiled.ptx and "st.global.cs.v4.f32" in compiled.ptx


FETCH_PROBE = """
{% import "ptx.j2" as ptx %}{% import "half.j2" as half %}
extern "C" __global__ void fetch(const float* __restrict__ in, const unsigned* __restrict__ packed, float* out,
                                 unsigned* packed_out) {
    {{ ptx.create_policy('policy', 'last') }}
    float a[4]; unsigned b[4];
    {{ ptx.ld_global(regs('a', 4), 'in + 4 * threadIdx.x', 'nc@256', 'in') }}
    {{ half.ld_global_b32(regs('b', 4), 'packed + 4 * threadIdx.x', 'nc_l1_last@128', 'packed', 'policy') }}
    {{ ptx.st_global('out + 4 * threadIdx.x', regs('a', 4), '', 'out') }}
    {{ half.st_global_b32('packed_out + 4 * threadIdx.x', regs('b', 4), '', 'packed_out') }}
}
"""


def test_a_load_hint_names_how_much_l2_fetches_after_its_cache_policy_and_moves_the_same_bits():
    text = environment().from_string(FETCH_PROBE).render()
    compiled = compile_source(Source(text=text, kernel_name="fetch", template="-", template_hash="-", params=None))
    loads = [line.split()[0] for line in compiled.ptx.splitlines() if line.strip().startswith("ld.global")]
    # PTX orders them: eviction priority, cache policy, prefetch size, vector
    assert sorted(loads) == ["ld.global.nc.L1::evict_last.L2::cache_hint.L2::128B.v4.b32", "ld.global.nc.L2::256B.v4.f32"]
    census = take_census(compiled)
    assert census.loads_of("in", "v4") == 1 and census.loads_of("packed", "v4") == 1
    rng = np.random.default_rng(0)
    source, packed = rng.standard_normal(128, dtype=np.float32), rng.integers(0, 2**32, 128, dtype=np.uint32)
    out, packed_out = np.full(128, np.nan, np.float32), np.zeros(128, np.uint32)
    interp.run(compiled.ptx, "fetch", 1, 32, 0, [source, packed, out, packed_out])
    assert out.view(np.uint32).tolist() == source.view(np.uint32).tolist() and (packed_out == packed).all()


@pytest.mark.parametrize("snippet, message", [
    ("{{ ptx.cp_async('d', 's', 8, 'cg') }}", "16 bytes only"),
    ("{{ ptx.cp_async('d', 's', 12) }}", "4, 8 or 16"),
    ("{{ ptx.ld_global(['a', 'b', 'c'], 'p') }}", "1, 2 or 4"),
    ("{{ ptx.ld_global(['a'], 'p', 'sticky') }}", "unknown cache hint"),
    ("{{ ptx.ld_global(['a'], 'p', 'sticky@128') }}", "unknown cache hint"),
    ("{{ ptx.ld_global(['a'], 'p', 'nc@96') }}", "L2 fetch size of load hint 'nc@96' must be one of"),
    ("{{ ptx.ld_global(['a'], 'p', 'volatile@64') }}", "a volatile load takes no L2 fetch size"),
    ("{{ ptx.rsqrt('a', 'b', 'fast') }}", "rsqrt mode"),
    ("{{ undefined_name }}", "undefined"),
])
def test_vocabulary_rejects_what_ptx_does_not_have(snippet, message, tmp_path):
    template = environment().from_string('{% import "ptx.j2" as ptx %}' + snippet)
    with pytest.raises(Exception, match=message):
        template.render()


def test_render_failure_is_a_config_error():
    with pytest.raises(ConfigError, match="rsqrt mode"):
        render("layernorm/resident.cu.j2", {**OP.context(OP.shape(d=768), Params()), "RSQRT": "fast"}, "k", None)


def test_a_ptxas_report_without_registers_fails_the_census_rather_than_reading_zero():
    op = get_op("layernorm")
    compiled = compile_source(op.source(op.shape(d=768), Params()))
    assert take_census(compiled).registers > 0
    # a zero would win every tie broken by fewer registers
    stripped = dataclasses.replace(compiled, log="\n".join(line for line in compiled.log.splitlines()
                                                         if "registers" not in line))
    with pytest.raises(CompileError, match="ptxas reported no registers for layernorm_row_d768"):
        take_census(stripped)
    no_shared = dataclasses.replace(compiled, log=compiled.log.replace(", 16 bytes smem", "").replace(
        ", 32 bytes smem", ""))
    assert take_census(no_shared).registers == take_census(compiled).registers


def test_a_compile_whose_log_lost_the_resource_report_is_made_again_with_the_compute_cache_off(monkeypatch, tmp_path):
    # Where a driver is installed, NVRTC hands back PTX it has compiled before from the driver's compute cache,
    # without running ptxas, so the log reports nothing; stand that in for this process
    import subprocess

    from mage_gen import compile as compile_module

    monkeypatch.setenv("MAGE_GEN_CACHE", str(tmp_path))
    monkeypatch.delenv("CUDA_CACHE_DISABLE", raising=False)
    real_nvrtc, real_run = compile_module._nvrtc, subprocess.run
    monkeypatch.setattr(compile_module, "_nvrtc", lambda *a: (*real_nvrtc(*a)[:2], ""))
    children = []

    def run(args, **kwargs):
        children.append(kwargs["env"])
        return real_run(args, **kwargs)

    monkeypatch.setattr(subprocess, "run", run)
    op = get_op("layernorm")
    compiled = compile_source(op.source(op.shape(d=640), Params(threads=32, vector=16)))
    assert take_census(compiled).registers > 0  # the child's report
    assert [env.get("CUDA_CACHE_DISABLE") for env in children] == ["1"]
    assert "CUDA_CACHE_DISABLE" not in os.environ  # this process's environment untouched
    assert compile_source(op.source(op.shape(d=640), Params(threads=32, vector=16))).from_cache


def test_a_compile_error_in_the_child_is_the_same_one_line_error(monkeypatch, tmp_path):
    from mage_gen import compile as compile_module

    monkeypatch.setenv("MAGE_GEN_CACHE", str(tmp_path))
    op = get_op("layernorm")
    source = op.source(op.shape(d=640), Params(threads=32, vector=16))
    broken = dataclasses.replace(source, text=source.text + "\nthis is not C++;\n")
    with pytest.raises(CompileError, match="NVRTC could not compile layernorm_row_d640"):
        compile_module._nvrtc_without_compute_cache(broken, "sm_90", True)


def _parent_pid(_: object) -> int:
    return os.getppid()


def test_compile_workers_are_not_forks_of_the_caller():
    # A fork of a process with CUDA, torch or SQLite threads can inherit a lock held by one of them and wait
    # on it for ever: the workers come from a fork server instead.
    from mage_gen.variants import _workers

    with _workers(2) as results:
        parents = set(results(_parent_pid, list(range(4))))
    assert os.getpid() not in parents
