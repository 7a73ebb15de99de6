"""Emitted kernels: five files that stand alone, carry their provenance and build with plain nvcc; the C++
header launches the kernel as its launch formula says."""

import dataclasses
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import mage_gen
from mage_gen.compile import nvrtc_version
from mage_gen.emit import emit
from mage_gen.errors import ConfigError, MageError
from mage_gen.ops import get_op
from mage_gen.ops.layernorm import Params
from mage_gen import emit as emit_module
from mage_gen.store import load_winner, save_entry
from mage_gen.variants import build

OP = get_op("layernorm")
SHAPE = OP.shape(d=768)
C_TYPES = {"out": "float*", "in": "const float*", "i32": "int", "f32": "float"}
JINJA_LEFT = re.compile(r"\{%-?\s*(if|elif|else|endif|for|endfor|set|endset|macro|endmacro|call|endcall|"
                        r"import|from|include|filter|raw|block)\b")
NAMES = ["layernorm_d768.cu", "layernorm_d768.ptx", "layernorm_d768.cubin", "layernorm_d768.launch.json",
         "layernorm_d768.h"]
MM = get_op("matmul")
MM_SHAPE = MM.shape(m=1024, n=1024, k=1024)
# 4 stages of a 128×128×32 tile: 133120 B of dynamic shared memory, over the 48 KB a function gets unasked
MM_BIG = MM.params_type(bm=128, bn=128, bk=32, tm=8, tn=8, buffers=4)


def test_emit_writes_the_five_files_of_the_variant(tmp_path):
    params = Params(template="multirow", threads=64, rows_per_block=2, hint="stream")
    out = tmp_path / "new" / "kernels"  # made when missing
    paths = emit(OP, SHAPE, params, "sm_90", out, None)
    assert paths == [out / name for name in NAMES]
    variant = build(OP, SHAPE, params, "sm_90")
    assert (out / "layernorm_d768.cubin").read_bytes() == variant.compiled.cubin
    assert (out / "layernorm_d768.ptx").read_text() == variant.compiled.ptx
    assert (out / "layernorm_d768.cu").read_text().endswith(variant.source.text)
    assert not [p for p in out.iterdir() if p.name not in NAMES]  # no scratch files left


def test_source_header_carries_provenance(tmp_path, synthetic_entry):
    entry = synthetic_entry()
    emit(OP, SHAPE, Params(), "sm_90", tmp_path, entry)
    text = (tmp_path / "layernorm_d768.cu").read_text()
    header = text.split("\n\n", 1)[0]  # the provenance comment ends at the first blank line
    flat = " ".join(header.split())  # the key column's width is the header's business
    for expected in ("layernorm_row_d768_t128_v4_r1_approx_nc", "d=768", "threads=128", "sm_90",
                     f"layernorm/resident.cu.j2 (hash {entry['template_hash']})", mage_gen.__version__,
                     f"NVRTC {nvrtc_version()}", "NVIDIA H200", "grid (M, 1, 1), block (128, 1, 1)",
                     "float* y, const float* x, const float* w, const float* b, int M, float eps",
                     "5.120 us median, spread 0.030 us", "9.520 us median",
                     f"vs torch hot 6.410 us median; this kernel's hot median / torch's = {5.12 / 6.41:.3f}"):
        assert expected in flat, expected
    assert all(line.startswith("//") for line in header.strip().splitlines())
    # PTX operand lists open with "{%0", so Jinja is a tag keyword after "{%", or any "{{" / "{#"
    assert not JINJA_LEFT.search(text) and "{{" not in text and "{#" not in text


def test_without_provenance_the_header_says_so(tmp_path):
    emit(OP, SHAPE, Params(), "sm_90", tmp_path, None)
    text = (tmp_path / "layernorm_d768.cu").read_text()
    assert "timings none" in " ".join(text.split()) and "NVIDIA" not in text and " us median" not in text


def test_newline_in_a_stored_value_cannot_escape_the_comment(tmp_path, synthetic_entry):
    entry = synthetic_entry()
    entry["gpu"]["name"] = "NVIDIA H200\nint injected = 1;"
    emit(OP, SHAPE, Params(), "sm_90", tmp_path, entry)
    lines = (tmp_path / "layernorm_d768.cu").read_text().splitlines()
    assert not [line for line in lines if line.startswith("int injected")]


def test_launch_json_round_trips(tmp_path, synthetic_entry):
    entry = synthetic_entry()
    params = Params(template="multirow", threads=32, rows_per_block=4)
    emit(OP, OP.shape(d=1024), params, "sm_80", tmp_path, entry)
    doc = json.loads((tmp_path / "layernorm_d1024.launch.json").read_text())
    assert doc["kernel"] == "layernorm_multirow_d1024_t32_v4_r4_approx_nc" and doc["arch"] == "sm_80"
    assert doc["launch"] == {"grid": ["(M + 3) / 4", 1, 1], "block": [128, 1, 1], "cluster": [1, 1, 1],
                             "dynamic_shared_bytes": 0}
    assert [(a["name"], a["type"]) for a in doc["args"]] == [(a.name, C_TYPES[a.kind]) for a in OP.args(OP.shape(d=1024))]
    assert OP.params_from_dict(doc["params"]) == params
    assert OP.shape(**doc["shape"]) == OP.shape(d=1024)
    assert doc["provenance"] == json.loads(json.dumps(entry))
    assert doc["template_hash"] == OP.source(OP.shape(d=1024), params).template_hash


def test_launch_json_carries_the_contract(tmp_path):
    params = Params(template="multirow", threads=64, rows_per_block=2)
    emit(OP, SHAPE, params, "sm_90", tmp_path, None)
    doc = json.loads((tmp_path / "layernorm_d768.launch.json").read_text())
    assert doc["format"] == 2 and doc["size_classes"] is None
    contract = doc["contract"]
    assert list(contract["tensors"]) == [a.name for a in OP.args(SHAPE) if a.kind in ("in", "out")]
    assert contract["tensors"]["x"] == {"dtype": "float32", "shape": ["M", 768],
                                        "layout": "row-major, contiguous, row stride 768 elements",
                                        "alignment_bytes": 16}
    assert contract["tensors"]["w"]["shape"] == [768]
    assert contract["scalars"]["M"]["range"] == [1, 2**31 - 1024]
    assert contract["scalars"]["eps"]["default"] == OP.eps == 1e-5
    assert "y must not overlap x, w or b" in contract["aliasing"]
    assert doc["dynamic_shared_memory"] == {"bytes": 0, "opt_in_required": False}


@pytest.mark.parametrize("params, nbytes, opt_in", [(MM_BIG, 133120, True), (MM.params_type(), 33792, False)])
def test_launch_json_says_when_shared_memory_needs_an_opt_in(tmp_path, params, nbytes, opt_in):
    emit(MM, MM_SHAPE, params, "sm_90", tmp_path, None)
    doc = json.loads((tmp_path / "matmul_m1024_n1024_k1024.launch.json").read_text())
    shared = doc["dynamic_shared_memory"]
    assert shared["bytes"] == doc["launch"]["dynamic_shared_bytes"] == nbytes
    assert shared["opt_in_required"] is opt_in
    assert ("how" in shared) is opt_in
    if opt_in:
        assert shared["how"] == (f"cuFuncSetAttribute(f, CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, {nbytes}) "
                                 "before the first launch")
    assert doc["contract"]["scalars"] == {} and doc["contract"]["tensors"]["A"]["shape"] == [1024, 1024]


def test_static_shared_memory_counts_towards_the_opt_in(tmp_path, monkeypatch):
    # 33792 B dynamic alone fits the 48 KB; with 16 KB of static shared memory beside it, a launch needs the opt-in
    real = build(MM, MM_SHAPE, MM.params_type(), "sm_90")
    static = dataclasses.replace(real, census=dataclasses.replace(real.census, shared_bytes=16384))
    monkeypatch.setattr(emit_module, "build", lambda *args: static)
    emit(MM, MM_SHAPE, MM.params_type(), "sm_90", tmp_path, None)
    doc = json.loads((tmp_path / "matmul_m1024_n1024_k1024.launch.json").read_text())
    assert doc["dynamic_shared_memory"]["opt_in_required"] is True
    header = (tmp_path / "matmul_m1024_n1024_k1024.h").read_text()
    assert "CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, 33792" in header


@pytest.mark.parametrize("d, params, rows, columns", [
    (768, Params(vector=4), 4, 4),
    (768, Params(vector=8), 8, 8),
    (768, Params(vector=16), 16, 16),
    # V does not divide d: rows are peeled relative to a V-aligned base, w and b read one float at a time
    (1001, Params(vector=8, threads=32), 8, 4),
    (1001, Params(template="wide", vector=16, threads=32), 16, 4),
])
def test_layernorm_alignment_follows_the_vector_width(d, params, rows, columns):
    tensors = OP.contract(OP.shape(d=d), params)["tensors"]
    assert {name: t["alignment_bytes"] for name, t in tensors.items()} == {"y": rows, "x": rows, "w": columns,
                                                                            "b": columns}


@pytest.mark.parametrize("n, params, a, b, c", [
    (256, MM.params_type(), 4, 16, 16),  # A transposed: 4-byte copies that scatter
    (256, MM.params_type(a_layout="direct", a_width=8, b_width=8), 8, 8, 16),
    (256, MM.params_type(a_layout="direct", a_width=16, b_width=4), 16, 4, 16),
    (258, MM.params_type(b_width=8), 4, 8, 4),  # N not a multiple of 4: C is stored a float at a time
])
def test_matmul_alignment_follows_the_copy_and_store_widths(n, params, a, b, c):
    tensors = MM.contract(MM.shape(m=256, n=n, k=256), params)["tensors"]
    assert {name: t["alignment_bytes"] for name, t in tensors.items()} == {"C": c, "A": a, "B": b}


def test_stem_and_size_classes_are_the_callers(tmp_path):
    size_classes = {"rule": "m <= 4096: l2; else hbm",
                    "classes": [{"m": 4096, "regime": "l2", "stem": "layernorm_d768_m4096",
                                 "kernel": "layernorm_row_d768_t128_v4_r1_approx_nc", "objective": "hot"}]}
    paths = emit(OP, SHAPE, Params(), "sm_90", tmp_path, None, stem="layernorm_d768_m4096",
                 size_classes=size_classes)
    assert [p.name for p in paths] == [name.replace("layernorm_d768", "layernorm_d768_m4096") for name in NAMES]
    assert json.loads(paths[3].read_text())["size_classes"] == size_classes
    header = paths[4].read_text()
    assert "layernorm_d768_m4096_launch(" in header and "layernorm_d768_m4096_kernel_name[]" in header


def test_a_stem_that_is_no_c_identifier_is_refused_before_anything_is_written(tmp_path):
    with pytest.raises(ConfigError, match="stem") as raised:
        emit(OP, SHAPE, Params(), "sm_90", tmp_path / "out", None, stem="layernorm-d768")
    assert "\n" not in str(raised.value) and not (tmp_path / "out").exists()


def test_header_carries_the_provenance_and_contract(tmp_path, synthetic_entry):
    emit(OP, SHAPE, Params(), "sm_90", tmp_path, synthetic_entry())
    header = (tmp_path / "layernorm_d768.h").read_text()
    source_header = (tmp_path / "layernorm_d768.cu").read_text().split("\n\n", 1)[0]
    assert header.startswith(source_header + "\n")  # the same provenance lines, timings included
    assert 'static const char layernorm_d768_kernel_name[] = "layernorm_row_d768_t128_v4_r1_approx_nc";' in header
    assert "cuModuleLoad" in header and "cuModuleLoadData" in header and "#include <cuda.h>" in header
    assert ("x: float32 [M, 768], row-major, contiguous, row stride 768 elements; address a multiple of 16 bytes"
            in header)
    assert [line for line in header.splitlines() if line.startswith("#include")] == ["#include <cuda.h>"]
    assert "cuFuncSetAttribute" not in header  # no opt-in where the kernel needs none


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc is not on PATH")
@pytest.mark.parametrize("d, params", [
    (768, Params()),
    (1000, Params(template="multirow", threads=32, vector=16, rows_per_block=4, hint="stream")),
    (65536, Params(template="wide", threads=256, rsqrt="exact", hint="none")),
])
def test_emitted_source_builds_with_plain_nvcc(tmp_path, synthetic_entry, d, params):
    paths = emit(OP, OP.shape(d=d), params, "sm_90", tmp_path, synthetic_entry())
    cubin = tmp_path / "nvcc.cubin"
    done = subprocess.run(["nvcc", "-cubin", "-arch=sm_90", str(paths[0]), "-o", str(cubin)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert cubin.read_bytes()[:4] == b"\x7fELF"
    # extern "C": the entry keeps its plain name, so a driver-API caller finds it by the name in launch.json
    assert OP.kernel_name(OP.shape(d=d), params).encode() + b"\0" in cubin.read_bytes()


# A libcuda.so of the two entry points the headers call, each printing what it was given: this machine has no
# driver, and the test is about what the header passes, not about a GPU.
STUB_LIBCUDA = r"""
#include <cuda.h>
#include <stdio.h>

CUresult CUDAAPI cuFuncSetAttribute(CUfunction f, CUfunction_attribute attrib, int value)
{
    printf("set_attribute %p %d %d\n", (void*)f, (int)attrib, value);
    return CUDA_SUCCESS;
}

CUresult CUDAAPI cuLaunchKernel(CUfunction f, unsigned int gx, unsigned int gy, unsigned int gz, unsigned int bx,
                                unsigned int by, unsigned int bz, unsigned int shared, CUstream stream,
                                void** params, void** extra)
{
    printf("launch %p grid %u %u %u block %u %u %u shared %u stream %p arg0 %p extra %p\n", (void*)f, gx, gy, gz,
           bx, by, bz, shared, (void*)stream, *(void**)params[0], (void*)extra);
    return CUDA_SUCCESS;
}
"""

CALLER = r"""
#include <stdio.h>
#include "layernorm_d768.h"
#include "layernorm_d768_capped.h"
#include "matmul_m1024_n1024_k1024.h"

#define CALL(label, expr) do { printf("call %s\n", label); printf("result %d\n", (int)(expr)); } while (0)

int main()
{
    CUfunction f = (CUfunction)0x1000;
    CUstream s = (CUstream)0x2000;
    float* y = (float*)0x100000;
    const float* x = (const float*)0x200000;
    const float* w = (const float*)0x300000;
    const float* b = (const float*)0x400000;
    CALL("rows37", layernorm_d768_launch(f, y, x, w, b, 37, 1e-5f, s));
    CALL("capped", layernorm_d768_capped_launch(f, y, x, w, b, 37, 1e-5f, s));
    CALL("misaligned_x", layernorm_d768_launch(f, y, x + 1, w, b, 37, 1e-5f, s));
    CALL("misaligned_b", layernorm_d768_launch(f, y, x, w, b + 2, 37, 1e-5f, s));
    CALL("no_rows", layernorm_d768_launch(f, y, x, w, b, 0, 1e-5f, s));
    CALL("matmul", matmul_m1024_n1024_k1024_launch(f, y, x, w, s));
    return 0;
}
"""


def run_checked(command: list[str], **kwargs) -> str:
    done = subprocess.run(command, capture_output=True, text=True, timeout=300, **kwargs)
    assert done.returncode == 0, (command, done.stdout, done.stderr)
    return done.stdout


def run_against_stub(tmp_path, stub: str, caller: str) -> dict[str, list[str]]:
    """calls() of a C++ caller of emitted headers in tmp_path, built against a stub libcuda.so and run."""
    (tmp_path / "stub.c").write_text(stub)
    (tmp_path / "main.cpp").write_text(caller)
    run_checked(["nvcc", "-shared", "-Xcompiler", "-fPIC", str(tmp_path / "stub.c"),
                 "-o", str(tmp_path / "libcuda.so")])
    # host code only, no CUDA runtime: the header needs cuda.h and libcuda and nothing else
    run_checked(["nvcc", "-cudart", "none", "-Xcompiler", "-Wall,-Wextra,-Werror", str(tmp_path / "main.cpp"),
                 "-I", str(tmp_path), "-L", str(tmp_path), "-lcuda", "-o", str(tmp_path / "main")])
    return calls(run_checked([str(tmp_path / "main")], env={**os.environ, "LD_LIBRARY_PATH": str(tmp_path)}))


def calls(stdout: str) -> dict[str, list[str]]:
    """The stub's lines between one `call LABEL` and the next, by label."""
    out: dict[str, list[str]] = {}
    for line in stdout.splitlines():
        if line.startswith("call "):
            label = line.split()[1]
            out[label] = []
        else:
            out[label].append(line)
    return out


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc is not on PATH")
def test_header_compiles_links_and_launches_as_the_formula_says(tmp_path):
    multirow = Params(template="multirow", threads=64, rows_per_block=2)
    capped = Params(template="multirow", threads=64, rows_per_block=2, grid_cap=8)
    emit(OP, SHAPE, multirow, "sm_90", tmp_path, None)
    emit(OP, SHAPE, capped, "sm_90", tmp_path, None, stem="layernorm_d768_capped")
    emit(MM, MM_SHAPE, MM_BIG, "sm_90", tmp_path, None)
    got = run_against_stub(tmp_path, STUB_LIBCUDA, CALLER)

    def launched(params, m: int) -> str:
        launch = OP.geometry(SHAPE, params, {"m": m})
        return (f"launch 0x1000 grid {' '.join(map(str, launch.grid))} block {' '.join(map(str, launch.block))} "
                f"shared 0 stream 0x2000 arg0 0x100000 extra (nil)")

    assert OP.geometry(SHAPE, multirow, {"m": 37}).grid == (19, 1, 1)  # (37 + 1) / 2
    assert got["rows37"] == [launched(multirow, 37), "result 0"]
    assert OP.geometry(SHAPE, capped, {"m": 37}).grid == (8, 1, 1)  # min(19, 8)
    assert got["capped"] == [launched(capped, 37), "result 0"]
    invalid = f"result {1}"  # CUDA_ERROR_INVALID_VALUE, and cuLaunchKernel never reached
    assert got["misaligned_x"] == got["misaligned_b"] == got["no_rows"] == [invalid]
    # the opt-in (CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES = 8) comes first, at the launch's size
    assert got["matmul"] == ["set_attribute 0x1000 8 133120",
                             "launch 0x1000 grid 8 8 1 block 256 1 1 shared 133120 stream 0x2000 arg0 0x100000 "
                             "extra (nil)", "result 0"]


GEMM = get_op("gemm_sm90")
GEMM_SHAPE = GEMM.shape(m=1025, n=1032, k=1041, c_dtype="fp32")


@pytest.mark.parametrize("cluster", [1, 2])
def test_launch_json_and_the_header_carry_a_gemms_cluster(tmp_path, cluster):
    params = GEMM.params_from_dict({"bn": 128, "stages": 4, "epilogue": "tma", "grid": 132, "cluster": cluster})
    emit(GEMM, GEMM_SHAPE, params, "sm_90", tmp_path, None, stem="gemm")
    launch = json.loads((tmp_path / "gemm.launch.json").read_text())["launch"]
    geometry = GEMM.geometry(GEMM_SHAPE, params, {})
    assert launch == {"grid": list(geometry.grid), "block": [384, 1, 1], "cluster": [cluster, 1, 1],
                      "dynamic_shared_bytes": geometry.dynamic_shared_bytes}
    assert launch["grid"][0] % cluster == 0
    header = (tmp_path / "gemm.h").read_text()
    source = (tmp_path / "gemm.cu").read_text()
    assert "__cluster_dims__" not in source
    if cluster == 1:
        assert "cuLaunchKernelEx" not in header and "return cuLaunchKernel(f," in header
        assert "clusters of" not in source.split("\n\n", 1)[0]
    else:
        assert "return cuLaunchKernelEx(&config, f, params, NULL);" in header and "cuLaunchKernel(f," not in header
        assert "cluster.id = CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION;" in header
        assert "clusters of (2, 1, 1) CTAs" in " ".join(source.split("\n\n", 1)[0].split())


# A libcuda.so of what a GEMM's header calls, each printing what it was given
STUB_GEMM_LIBCUDA = r"""
#include <cuda.h>
#include <stdio.h>

CUresult CUDAAPI cuFuncSetAttribute(CUfunction f, CUfunction_attribute attrib, int value)
{
    printf("set_attribute %p %d %d\n", (void*)f, (int)attrib, value);
    return CUDA_SUCCESS;
}

CUresult CUDAAPI cuTensorMapEncodeTiled(CUtensorMap* map, CUtensorMapDataType type, cuuint32_t rank, void* address,
    const cuuint64_t* dims, const cuuint64_t* strides, const cuuint32_t* box, const cuuint32_t* element_strides,
    CUtensorMapInterleave interleave, CUtensorMapSwizzle swizzle, CUtensorMapL2promotion promotion,
    CUtensorMapFloatOOBfill fill)
{
    (void)strides; (void)element_strides; (void)interleave; (void)promotion; (void)fill;
    printf("encode %p type %d rank %u dims %llu %llu box %u %u swizzle %d\n", address, (int)type, rank,
           (unsigned long long)dims[0], (unsigned long long)dims[1], box[0], box[1], (int)swizzle);
    map->opaque[0] = (cuuint64_t)address;  // the map's first word: where it maps
    return CUDA_SUCCESS;
}

CUresult CUDAAPI cuLaunchKernel(CUfunction f, unsigned int gx, unsigned int gy, unsigned int gz, unsigned int bx,
                                unsigned int by, unsigned int bz, unsigned int shared, CUstream stream,
                                void** params, void** extra)
{
    printf("launch %p grid %u %u %u block %u %u %u shared %u stream %p arg0 %p map0 %p extra %p\n", (void*)f, gx, gy,
           gz, bx, by, bz, shared, (void*)stream, *(void**)params[0], (void*)((CUtensorMap*)params[3])->opaque[0],
           (void*)extra);
    return CUDA_SUCCESS;
}

CUresult CUDAAPI cuLaunchKernelEx(const CUlaunchConfig* config, CUfunction f, void** params, void** extra)
{
    printf("launch_ex %p grid %u %u %u block %u %u %u shared %u stream %p arg0 %p map0 %p extra %p\n", (void*)f,
           config->gridDimX, config->gridDimY, config->gridDimZ, config->blockDimX, config->blockDimY,
           config->blockDimZ, config->sharedMemBytes, (void*)config->hStream, *(void**)params[0],
           (void*)((CUtensorMap*)params[3])->opaque[0], (void*)extra);
    for (unsigned i = 0; i < config->numAttrs; ++i)
        printf("attribute %d cluster %u %u %u\n", (int)config->attrs[i].id, config->attrs[i].value.clusterDim.x,
               config->attrs[i].value.clusterDim.y, config->attrs[i].value.clusterDim.z);
    return CUDA_SUCCESS;
}
"""

GEMM_CALLER = r"""
#include <stdio.h>
#include "gemm_x1.h"
#include "gemm_x2.h"

#define CALL(label, expr) do { printf("call %s\n", label); printf("result %d\n", (int)(expr)); } while (0)

int main()
{
    CUfunction f = (CUfunction)0x1000;
    CUstream s = (CUstream)0x2000;
    float* c = (float*)0x100000;
    const unsigned short* a = (const unsigned short*)0x200000;
    const unsigned short* b = (const unsigned short*)0x300000;
    CALL("x1", gemm_x1_launch(f, c, a, b, s));
    CALL("x2", gemm_x2_launch(f, c, a, b, s));
    CALL("misaligned", gemm_x2_launch(f, c + 1, a, b, s));
    return 0;
}
"""


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc is not on PATH")
def test_a_gemm_header_launches_a_cluster_with_cuLaunchKernelEx_and_its_cluster_attribute(tmp_path):
    geometry = {}
    for cluster in (1, 2):
        params = GEMM.params_from_dict({"bn": 128, "stages": 4, "epilogue": "tma", "grid": 132, "cluster": cluster})
        emit(GEMM, GEMM_SHAPE, params, "sm_90", tmp_path, None, stem=f"gemm_x{cluster}")
        geometry[cluster] = GEMM.geometry(GEMM_SHAPE, params, {})
    got = run_against_stub(tmp_path, STUB_GEMM_LIBCUDA, GEMM_CALLER)
    shared = geometry[1].dynamic_shared_bytes
    assert geometry[2].dynamic_shared_bytes == shared
    opt_in = f"set_attribute 0x1000 8 {shared}"  # CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES

    def launched(kind: str, cluster: int) -> str:
        grid = " ".join(map(str, geometry[cluster].grid))
        return (f"{kind} 0x1000 grid {grid} block 384 1 1 shared {shared} stream 0x2000 arg0 0x100000 map0 0x200000 "
                "extra (nil)")

    from cuda.bindings import driver as cu  # the driver's enum values, as cuda.h numbers them

    bf16, fp32 = (int(getattr(cu.CUtensorMapDataType, f"CU_TENSOR_MAP_DATA_TYPE_{t}")) for t in ("BFLOAT16", "FLOAT32"))
    swizzle = int(cu.CUtensorMapSwizzle.CU_TENSOR_MAP_SWIZZLE_128B)
    cluster_dimension = int(cu.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION)

    def encodes(b_box: int) -> list[str]:  # A, B, C; a cluster of 2 copies half the B tile in each CTA
        return [f"encode 0x200000 type {bf16} rank 2 dims 1041 1025 box 64 128 swizzle {swizzle}",
                f"encode 0x300000 type {bf16} rank 2 dims 1041 1032 box 64 {b_box} swizzle {swizzle}",
                f"encode 0x100000 type {fp32} rank 2 dims 1032 1025 box 32 64 swizzle {swizzle}"]

    assert got["x1"] == [opt_in, *encodes(128), launched("launch", 1), "result 0"]
    assert got["x2"] == [opt_in, *encodes(64), launched("launch_ex", 2),
                         f"attribute {cluster_dimension} cluster 2 1 1", "result 0"]
    assert geometry[2].grid[0] % 2 == 0 and geometry[2].cluster == (2, 1, 1)
    assert got["misaligned"] == ["result 1"]  # CUDA_ERROR_INVALID_VALUE, nothing launched


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc is not on PATH")
def test_a_bf16_residual_kernel_is_emitted_with_its_types_and_its_header_compiles(tmp_path):
    rms = get_op("rmsnorm")
    shape = rms.shape(d=4096, dtype="bf16", weight_dtype="fp32", residual=True)
    params = rms.params_from_dict({"threads": 256, "vector": 16})
    paths = emit(rms, shape, params, "sm_90", tmp_path, None)
    doc = json.loads((tmp_path / "rmsnorm_d4096_bf16_wfp32_res.launch.json").read_text())
    assert [(a["name"], a["type"]) for a in doc["args"]] == [
        ("y", "unsigned short*"), ("residual_out", "unsigned short*"), ("x", "const unsigned short*"),
        ("residual", "const unsigned short*"), ("w", "const float*"), ("M", "int"), ("eps", "float")]
    assert doc["contract"]["tensors"]["residual"]["dtype"] == "bfloat16"
    assert doc["contract"]["tensors"]["x"]["alignment_bytes"] == 16 and doc["contract"]["tensors"]["w"]["alignment_bytes"] == 16
    run_checked(["nvcc", "-cubin", "-arch=sm_90", str(paths[0]), "-o", str(tmp_path / "k.cubin")])
    (tmp_path / "caller.cpp").write_text(
        '#include "rmsnorm_d4096_bf16_wfp32_res.h"\n'
        "CUresult call(CUfunction f, unsigned short* y, unsigned short* h, const unsigned short* x,\n"
        "              const unsigned short* r, const float* w, CUstream s)\n"
        "{ return rmsnorm_d4096_bf16_wfp32_res_launch(f, y, h, x, r, w, 37, 1e-6f, s); }\n")
    run_checked(["nvcc", "-cudart", "none", "-Xcompiler", "-Wall,-Wextra,-Werror", "-c", str(tmp_path / "caller.cpp"),
                 "-I", str(tmp_path), "-o", str(tmp_path / "caller.o")])


def test_unwritable_out_dir_is_a_one_line_error(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    with pytest.raises(MageError) as raised:
        emit(OP, SHAPE, Params(), "sm_90", blocker / "kernels", None)
    assert str(blocker / "kernels") in str(raised.value) and "\n" not in str(raised.value)


def test_failed_write_keeps_the_previous_file(tmp_path, monkeypatch):
    emit(OP, SHAPE, Params(), "sm_90", tmp_path, None)
    before = (tmp_path / "layernorm_d768.cu").read_bytes()

    def refuse(src, dst):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "replace", refuse)
    with pytest.raises(MageError, match="No space left on device"):
        emit(OP, SHAPE, Params(threads=64), "sm_90", tmp_path, None, replace=True)
    assert (tmp_path / "layernorm_d768.cu").read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(NAMES)


# ---- the command line ----

def mage_gen_cli(*args, tuned=None, gpu=None, cwd=None):
    env = {k: v for k, v in os.environ.items() if k not in ("MAGE_GEN_TUNED", "MAGE_GEN_GPU")}
    if tuned is not None:
        env["MAGE_GEN_TUNED"] = str(tuned)
    if gpu is not None:
        env["MAGE_GEN_GPU"] = gpu
    return subprocess.run([sys.executable, "-m", "mage_gen", *args], capture_output=True, text=True,
                          timeout=300, env=env, cwd=cwd)


def assert_one_line_error(done, says):
    assert done.returncode == 2, (done.stdout, done.stderr)
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and says in lines[0], done.stderr
    assert "Traceback" not in done.stderr and done.stdout == ""


def test_cli_emits_this_gpus_winner(tmp_path, synthetic_entry):
    # a SYNTHETIC entry: real census and template hash, made-up timings
    winner = {"template": "multirow", "threads": 64, "rows_per_block": 2, "hint": "stream"}
    save_entry("layernorm", "NVIDIA H200", "d=768/float32/m=4096", synthetic_entry(params=winner, run={"m": 4096}),
               directory=tmp_path / "tuned")
    out = tmp_path / "out"
    done = mage_gen_cli("emit", "layernorm", "--d", "768", "-o", str(out), tuned=tmp_path / "tuned",
                        gpu="NVIDIA H200")
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == [str(out / name.replace("_d768", "_d768_m4096")) for name in NAMES]
    doc = json.loads((out / "layernorm_d768_m4096.launch.json").read_text())
    assert doc["kernel"] == "layernorm_multirow_d768_t64_v4_r2_approx_stream"
    assert doc["provenance"]["gpu"]["name"] == "NVIDIA H200"
    assert doc["size_classes"]["classes"] == [{"m": 4096, "regime": "l2", "stem": "layernorm_d768_m4096",
                                               "kernel": doc["kernel"], "objective": "hot"}]
    assert "5.120 us median" in (out / "layernorm_d768_m4096.cu").read_text()


def test_cli_emits_every_size_class_or_the_one_that_serves_m(tmp_path, synthetic_entry):
    # SYNTHETIC entries of two size classes
    tuned = tmp_path / "tuned"
    save_entry("layernorm", "NVIDIA H200", "d=768/float32/m=4096", synthetic_entry(run={"m": 4096}), directory=tuned)
    save_entry("layernorm", "NVIDIA H200", "d=768/float32/m=65536",
               synthetic_entry(params={"template": "row", "threads": 96, "vector": 8}, run={"m": 65536}),
               directory=tuned)
    done = mage_gen_cli("emit", "layernorm", "--d", "768", "-o", str(tmp_path / "all"), tuned=tuned,
                        gpu="NVIDIA H200")
    assert done.returncode == 0, done.stderr
    stems = sorted({Path(line).name.split(".")[0] for line in done.stdout.splitlines()})
    assert stems == ["layernorm_d768_m4096", "layernorm_d768_m65536"]
    doc = json.loads((tmp_path / "all" / "layernorm_d768_m65536.launch.json").read_text())
    assert doc["kernel"] == "layernorm_row_d768_t96_v2_r1_approx_nc"
    assert [(c["m"], c["regime"]) for c in doc["size_classes"]["classes"]] == [(4096, "l2"), (65536, "dram")]
    assert "L2" in doc["size_classes"]["rule"]
    one = mage_gen_cli("emit", "layernorm", "--d", "768", "--m", "20000", "-o", str(tmp_path / "one"), tuned=tuned,
                       gpu="NVIDIA H200")
    assert one.returncode == 0, one.stderr
    assert sorted(p.name for p in (tmp_path / "one").iterdir()) == sorted(
        name.replace("_d768", "_d768_m65536") for name in NAMES)


def test_cli_emits_an_untuned_matmul_shape_with_the_nearest_tuned_params_and_says_so(tmp_path, synthetic_entry):
    done = mage_gen_cli("emit", "matmul", "--m", "1000", "--n", "1024", "--k", "1024", "-o", str(tmp_path / "k"),
                        tuned=Path(__file__).resolve().parent.parent / "tuned", gpu="NVIDIA H200")
    assert done.returncode == 0, done.stderr
    assert "nearest tuned shape {'m': 1024, 'n': 1024, 'k': 1024}" in " ".join(done.stderr.split())
    assert json.loads((tmp_path / "k" / "matmul_m1000_n1024_k1024.launch.json").read_text())["provenance"] is None


def test_cli_emits_a_gemm_at_an_untuned_m_with_the_params_the_runtime_runs_there(tmp_path):
    done = mage_gen_cli("emit", "gemm_sm90", "--m", "300", "--n", "4096", "--k", "4096", "-o", str(tmp_path / "k"),
                        tuned=Path(__file__).resolve().parent.parent / "tuned", gpu="NVIDIA H200")
    assert done.returncode == 0, done.stderr
    assert "the size class the runtime runs here, tuned at {'m': 256, 'n': 4096, 'k': 4096}" in " ".join(
        done.stderr.split())
    gemm = get_op("gemm_sm90")
    served = load_winner(gemm, gemm.shape(m=256, n=4096, k=4096), "NVIDIA H200").params
    doc = json.loads((tmp_path / "k" / "gemm_sm90_bf16_nk_bf16_m300_n4096_k4096.launch.json").read_text())
    assert doc["kernel"] == gemm.kernel_name(gemm.shape(m=300, n=4096, k=4096), served)


def test_cli_gpu_option_beats_the_environment_and_out_defaults_to_kernels(tmp_path, synthetic_entry):
    # a SYNTHETIC entry for another GPU model
    save_entry("layernorm", "NVIDIA GeForce RTX 4090", "d=768/float32/m=4096", synthetic_entry(run={"m": 4096}),
               directory=tmp_path / "tuned")
    done = mage_gen_cli("emit", "layernorm", "--d", "768", "--gpu", "NVIDIA GeForce RTX 4090",
                        gpu="NVIDIA H200", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "kernels" / "layernorm_d768_m4096.cubin").is_file()


def test_cli_config_needs_no_gpu_and_gives_no_timings(tmp_path):
    done = mage_gen_cli("emit", "layernorm", "--d", "1024", "-o", str(tmp_path), "--arch", "sm_80",
                        "--config", "template=multirow,threads=32", "--config", "rows_per_block=4",
                        tuned=tmp_path / "empty")
    assert done.returncode == 0, done.stderr
    doc = json.loads((tmp_path / "layernorm_d1024.launch.json").read_text())
    assert doc["provenance"] is None and doc["arch"] == "sm_80"
    # unnamed params keep the op's defaults
    assert doc["params"] == OP.params_to_dict(Params(template="multirow", threads=32, rows_per_block=4))
    assert "timings none" in " ".join((tmp_path / "layernorm_d1024.cu").read_text().split())


def test_the_regenerate_line_of_a_matmul_header_rebuilds_the_same_kernel(tmp_path):
    mm = get_op("matmul")
    shape = mm.shape(m=256, n=256, k=256)
    params = mm.params_type(bm=128, bn=128, bk=16, tm=16, tn=8, buffers=3, split=True, sync="one")
    emit(mm, shape, params, "sm_90", tmp_path / "first", None)
    name = "matmul_m256_n256_k256"
    header = (tmp_path / "first" / f"{name}.cu").read_text().split("\n\n", 1)[0]
    command = next(line for line in header.splitlines() if "mage-gen emit" in line).split("mage-gen ", 1)[1].split()
    done = mage_gen_cli(*command, "-o", str(tmp_path / "again"), tuned=tmp_path / "empty")
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "again" / f"{name}.ptx").read_bytes() == (tmp_path / "first" / f"{name}.ptx").read_bytes()


def test_cli_without_a_winner(tmp_path):
    # neither the user's tuned/ nor the winners shipped with mage-gen hold one for this GPU
    done = mage_gen_cli("emit", "layernorm", "--d", "768", "-o", str(tmp_path / "out"), tuned=tmp_path,
                        gpu="NVIDIA A100-SXM4-80GB")
    assert_one_line_error(done, "run `mage-gen tune layernorm --d 768` on this GPU, or pass --config")
    assert not (tmp_path / "out").exists()


def test_cli_emits_the_winners_shipped_with_mage_gen_where_the_users_tuned_holds_none(tmp_path):
    done = mage_gen_cli("emit", "layernorm", "--d", "768", "-o", str(tmp_path / "out"), tuned=tmp_path,
                        gpu="NVIDIA H200")
    assert done.returncode == 0, done.stderr
    header = next((tmp_path / "out").glob("*.cu")).read_text()
    assert re.search(r"tuned on\s+NVIDIA H200", header), header[:400]


def test_cli_without_a_gpu_name(tmp_path):
    # No GPU on the test machine: device_name() cannot answer, so --gpu or --config is needed.
    if shutil.which("nvidia-smi") and subprocess.run(["nvidia-smi"], capture_output=True).returncode == 0:
        pytest.skip("a GPU answers here, so its name is found")
    done = mage_gen_cli("emit", "layernorm", "--d", "768", "-o", str(tmp_path / "out"), tuned=tmp_path)
    assert_one_line_error(done, "pass --gpu NAME")


def test_cli_stale_winner(tmp_path, synthetic_entry):
    # a SYNTHETIC entry whose kernel has changed since it was tuned
    save_entry("layernorm", "NVIDIA H200", "d=768/float32", synthetic_entry(source_hash="0123456789abcdef"),
               directory=tmp_path)
    done = mage_gen_cli("emit", "layernorm", "--d", "768", "-o", str(tmp_path / "out"), tuned=tmp_path,
                        gpu="NVIDIA H200")
    assert_one_line_error(done, "its kernel has changed since it was tuned")
    assert not (tmp_path / "out").exists()


def test_cli_corrupt_store(tmp_path):
    path = tmp_path / "h200" / "layernorm.json"
    path.parent.mkdir()
    path.write_text("{ half a file")
    done = mage_gen_cli("emit", "layernorm", "--d", "768", "-o", str(tmp_path / "out"), tuned=tmp_path,
                        gpu="NVIDIA H200")
    assert_one_line_error(done, f"{path} is corrupt")
    assert path.read_text() == "{ half a file"


def test_cli_unwritable_out_dir(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    done = mage_gen_cli("emit", "layernorm", "--d", "768", "-o", str(blocker / "kernels"), "--config", "threads=64")
    assert_one_line_error(done, f"cannot write kernels to {blocker / 'kernels'}")


@pytest.mark.parametrize("args, says", [
    (["emit", "layernorm", "--config", "threads=64"], "needs --d"),
    (["emit", "layernorm", "--d", "768", "--config", "threads=100"], "threads-multiple-of-32"),
    (["emit", "layernorm", "--d", "768", "--config", "threads=64", "--arch", "sm_10"], "arch"),
    (["emit", "softmax", "--d", "768", "--config", "threads=64"], "unknown op"),
])
def test_cli_bad_input(tmp_path, args, says):
    assert_one_line_error(mage_gen_cli(*args, cwd=tmp_path), says)
    assert not (tmp_path / "kernels").exists()


def test_cli_emit_never_replaces_another_kernel_without_force(tmp_path):
    out = tmp_path / "k"
    first = mage_gen_cli("emit", "layernorm", "--d", "768", "--config", "threads=128", "-o", str(out))
    assert first.returncode == 0, first.stderr
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    again = mage_gen_cli("emit", "layernorm", "--d", "768", "--config", "threads=128", "-o", str(out))
    assert again.returncode == 0, again.stderr  # the same kernel again is no change
    for other in (["--config", "threads=96"], ["--config", "threads=128", "--arch", "sm_80"]):
        refused = mage_gen_cli("emit", "layernorm", "--d", "768", *other, "-o", str(out))
        assert refused.returncode == 2
        assert "holds another kernel or build" in refused.stderr and "--force" in refused.stderr
        assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    forced = mage_gen_cli("emit", "layernorm", "--d", "768", "--config", "threads=96", "-o", str(out), "--force")
    assert forced.returncode == 0, forced.stderr
    assert json.loads((out / "layernorm_d768.launch.json").read_text())["params"]["threads"] == 96


@pytest.mark.parametrize("op_name, dims, values", [
    ("layernorm", {"d": 768, "dtype": "bf16", "weight_dtype": "fp32", "residual": True}, {"threads": 96}),
    ("matmul_tc", {"m": 130, "n": 258, "k": 66, "precision": "bf16"}, {}),
    ("gemm_sm90", {"m": 1024, "n": 1032, "k": 1040, "c_dtype": "fp32"}, {"epilogue": "tma", "grid": 132}),
])
def test_the_command_an_emitted_kernel_names_regenerates_its_files_verbatim(tmp_path, op_name, dims, values):
    op = get_op(op_name)
    shape = op.shape(**dims)
    written = emit(op, shape, op.params_from_dict({**op.defaults(shape), **values}), "sm_90", tmp_path / "first", None)
    command = next(line for line in written[0].read_text().splitlines() if "mage-gen emit" in line)
    argv = command.removeprefix("//").split()
    assert argv[:2] == ["mage-gen", "emit"]
    done = subprocess.run([sys.executable, "-m", "mage_gen", *argv[1:], "-o", str(tmp_path / "again")],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    for path in written:
        assert (tmp_path / "again" / path.name).read_bytes() == path.read_bytes(), path.name


def test_a_tensors_alignment_in_launch_json_is_that_of_the_widest_access_the_kernel_makes_to_it(tmp_path):
    # matmul_tc copies A and B 4 bytes at a time but stores C as v2.f32: a C 4- but not 8-byte aligned faulted with
    # MISALIGNED_ADDRESS where the contract said 4
    op = get_op("matmul_tc")
    shape = op.shape(m=130, n=258, k=66, precision="bf16")
    params = op.params_from_dict({**op.defaults(shape), "copy": 4})
    paths = emit(op, shape, params, "sm_90", tmp_path, None)
    launch = json.loads(next(p for p in paths if p.name.endswith(".launch.json")).read_text())
    assert {k: t["alignment_bytes"] for k, t in launch["contract"]["tensors"].items()} == {"C": 8, "A": 4, "B": 4}
    header = next(p for p in paths if p.suffix == ".h").read_text()
    assert "(CUdeviceptr)C % 8 != 0" in header
    census = build(op, shape, params, "sm_90").census
    assert census.widest_access == {"A": 4, "B": 4, "C": 8}
