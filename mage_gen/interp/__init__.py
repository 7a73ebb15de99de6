"""A CPU interpreter for the PTX NVRTC makes from mage-gen's templates, so that CI checks numbers.

    run(ptx, entry, grid, block, dynamic_shared, args)   one launch over numpy buffers
    gate(op, shape, variant, run, rng)                    measure.gate's verdict, on the CPU
    worst_error(op, shape, variant, run, rng)             its relative error, or an InterpError

Modules: parse (PTX text → statements), program (operands, decoded entry), alu / memops (one builder
per opcode; memops also global atomics and fences), decode (statements → instructions), fp (fp32 rounding),
memory (global and shared memory with fault and race checks, and what a release and an acquire make visible
across blocks), warp (32 lanes, min-PC reconvergence, cp.async groups), launch (blocks,
barriers, warps scheduled around their waits), hopper (mbarriers, TMA over tensor maps, wgmma over
descriptors and swizzles, the proxy fence), gate (an op variant as the gate runs it).
"""

from mage_gen.interp.errors import (DivergenceError, InterpError, MemoryFault, RaceError, StaleReadError,
                                    UnknownInstruction)
from mage_gen.interp.gate import gate, launch_with, run_once, worst_error
from mage_gen.interp.hopper import HangError, TensorMap
from mage_gen.interp.launch import Stats, run

__all__ = ["run", "Stats", "gate", "launch_with", "run_once", "worst_error", "InterpError", "UnknownInstruction", "MemoryFault",
           "RaceError", "StaleReadError", "DivergenceError", "HangError", "TensorMap"]
