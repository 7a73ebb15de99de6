"""Planted faults on the CPU: each edit applies once and changes the compiled code the way the fault needs.
What the worker makes of them on the GPU is tests/test_gpu_faults.py."""

import re

import pytest

from mage_gen.errors import CompileError
from mage_gen.variants import build
from planted import FAULTS, LAUNCHED, OP, REFUSED_AT_COMPILE, REGISTER_FILE, SHAPE, fault_variant

ARCH = "sm_90"


def strip_names(ptx: str) -> str:
    return re.sub(r"layernorm_\w+", "K", ptx)


def block_threads(params) -> int:
    return OP.geometry(SHAPE, params, {"m": 1}).threads


@pytest.mark.parametrize("fault", LAUNCHED)
def test_each_fault_compiles_and_changes_the_ptx(fault):
    clean = build(OP, SHAPE, FAULTS[fault].params, ARCH)
    planted = fault_variant(ARCH, fault)
    assert planted.compiled.cubin and planted.source.kernel_name == clean.source.kernel_name
    assert strip_names(planted.compiled.ptx) != strip_names(clean.compiled.ptx)


@pytest.mark.parametrize("fault", REFUSED_AT_COMPILE)
def test_a_fault_ptxas_refuses_says_why(fault):
    with pytest.raises(CompileError, match="too much shared data"):
        fault_variant(ARCH, fault)


def test_the_out_of_bounds_store_is_in_the_ptx():
    ptx = fault_variant(ARCH, "out_of_bounds_write").compiled.ptx
    assert ptx.count("st.global.f32 ") == 1 and str(4 << 36) in ptx  # 2^36 floats (256 GB) past y


def test_the_endless_loop_rereads_a_volatile_flag():
    ptx = fault_variant(ARCH, "endless_loop").compiled.ptx
    assert "st.volatile.shared.u32" in ptx and "ld.volatile.shared.u32" in ptx


def test_the_register_hog_needs_more_registers_than_a_block_of_its_threads_has():
    params = FAULTS["too_many_registers"].params
    clean, planted = build(OP, SHAPE, params, ARCH), fault_variant(ARCH, "too_many_registers")
    threads = block_threads(params)
    assert threads == 1024 and "__launch_bounds__" not in planted.source.text
    assert clean.census.registers * threads <= REGISTER_FILE  # the clean variant launches
    assert planted.census.registers * threads > REGISTER_FILE, planted.census.registers
    assert planted.census.spill_bytes == 0  # held in registers, not in local memory
