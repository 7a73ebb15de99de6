"""An op variant run on the interpreter exactly as measure.gate runs it on a GPU: fresh inputs from
op.make_inputs for every gate run, outputs poisoned with NaN, op.reference and op.tolerance; a scratch buffer
(ops.base.Arg) poisoned with NaN, a zeroed one given as zeros and checked to be zeros again after the launch."""

from __future__ import annotations

from typing import Any

import numpy as np

from mage_gen.interp.errors import InterpError
from mage_gen.interp.hopper import TensorMap
from mage_gen.interp.launch import Stats, run
from mage_gen.ops.base import WORKING_KINDS, launch_args, tensor_maps
from mage_gen.verdict import GateResult, compare_outputs, relative_error, widen


def launch_with(op, shape: Any, variant: Any, run_sizes: dict[str, int], inputs: dict[str, np.ndarray],
                stats: Stats | None = None, reverse: bool = False,
                working: dict[str, np.ndarray] | None = None) -> dict[str, np.ndarray]:
    """One launch on the given inputs into NaN-poisoned outputs, returned (counted into `stats` where given), its
    blocks in reverse order where asked. Working buffers (scratch, zeroed) are made fresh, or taken from `working`
    where it names them (as they are: a second launch on the counters a first one left). Raises InterpError for
    what the interpreter catches, and where a zeroed buffer is not all zero after the launch."""
    launch = op.geometry(shape, variant.params, run_sizes)
    dtypes = op.output_dtypes(shape)
    outputs = {name: np.full(s, dtypes[name].nan_bits & 0xFFFF, dtype=np.uint16).view(dtypes[name].storage)
               if dtypes[name].half else np.full(s, np.nan, dtype=np.float32)
               for name, s in op.output_shapes(shape, run_sizes).items()}
    scalars = op.scalars(shape, run_sizes)
    args = []
    working = {} if working is None else working
    for arg in launch_args(op, shape, variant.params):
        if arg.kind == "scratch":
            args.append(working.setdefault(arg.name, np.full(arg.elements, np.nan, dtype=np.float32)))
        elif arg.kind == "zeroed":
            args.append(working.setdefault(arg.name, np.zeros(arg.elements, dtype=np.uint32)))
        elif arg.kind == "out":
            args.append(outputs[arg.name])
        elif arg.kind == "in":  # a copy: a kernel that writes into an input must not change the reference's
            args.append(np.array(inputs[arg.name]))
        elif arg.kind == "i32":
            args.append(int(scalars[arg.name]))
        else:
            args.append(float(np.float32(scalars[arg.name])))
    pointers = {arg.name: array for arg, array in zip(launch_args(op, shape, variant.params), args)
                if isinstance(array, np.ndarray)}
    args += [TensorMap(spec, pointers[spec.tensor]) for spec in tensor_maps(op, shape, variant.params).values()]
    run(variant.compiled.ptx, variant.source.kernel_name, launch.grid, launch.block, launch.dynamic_shared_bytes,
        args, stats, reverse, launch.cluster)
    for arg in launch_args(op, shape, variant.params):
        if arg.kind == "zeroed" and (left := int(np.count_nonzero(pointers[arg.name]))):
            raise InterpError(f"{arg.name}: {left} of {arg.elements} words are not zero after the launch, which "
                              "must leave them zero (as it found them) for the next one")
    return outputs


def run_once(op, shape: Any, variant: Any, run_sizes: dict[str, int], rng: np.random.Generator) -> dict:
    """One launch on fresh inputs: (inputs, outputs, reference). Raises InterpError for what the interpreter
    catches."""
    inputs = op.make_inputs(shape, run_sizes, rng)
    outputs = launch_with(op, shape, variant, run_sizes, inputs)
    return {"inputs": inputs, "outputs": outputs,
            "reference": op.reference(shape, inputs, op.scalars(shape, run_sizes))}


def worst_error(op, shape: Any, variant: Any, run_sizes: dict[str, int], rng: np.random.Generator,
                runs: list[dict[str, int]] | None = None) -> float:
    """The largest relative error over `runs` (default op.gate_runs, as the gate does; inf where an output
    holds NaN); raises an InterpError for a fault, race or stale read."""
    worst = 0.0
    for gate_run in (op.gate_runs(shape, run_sizes, variant.params) if runs is None else runs):
        result = run_once(op, shape, variant, gate_run, rng)
        for name, ref in result["reference"].items():
            out = result["outputs"][name]
            err = float("inf") if np.isnan(widen(out)).any() else relative_error(out, ref)
            worst = max(worst, err)
    return worst


def gate(op, shape: Any, variant: Any, run_sizes: dict[str, int], rng: np.random.Generator) -> GateResult:
    """measure.gate's verdict, on the CPU: a fault the interpreter catches fails the gate with its message. A kernel
    with working buffers (blocks that combine their results through them), or launched in clusters (whose CTAs
    reach each other's shared memory), runs a second time with its blocks in the reverse order, and must write the
    same bits: which block finishes first must not change the result."""
    errors: dict[str, float] = {}
    combines = (any(arg.kind in WORKING_KINDS for arg in launch_args(op, shape, variant.params))
                or op.geometry(shape, variant.params, run_sizes).cluster != (1, 1, 1))
    for gate_run in op.gate_runs(shape, run_sizes, variant.params):
        key = ",".join(f"{k}={v}" for k, v in gate_run.items()) or "fixed"
        try:
            result = run_once(op, shape, variant, gate_run, rng)
            again = launch_with(op, shape, variant, gate_run, result["inputs"], reverse=True) if combines else {}
        except InterpError as exc:
            return GateResult(False, f"{gate_run}: {exc}", float("inf"), errors)
        for name, out in again.items():
            if not np.array_equal(out.view(np.uint8), result["outputs"][name].view(np.uint8)):
                changed = int(np.count_nonzero(out.view(np.uint8) != result["outputs"][name].view(np.uint8)))
                return GateResult(False, f"{gate_run}: {name} is not the same bits with the blocks run in the reverse "
                                         f"order ({changed} bytes differ): the result depends on which block "
                                         "finishes first", float("inf"), errors)
        err, reason = compare_outputs(op, shape, result["outputs"], result["reference"])
        errors[key] = err
        if reason:
            return GateResult(False, f"{gate_run}: {reason}", err, errors)
    return GateResult(True, "", max(errors.values()), errors)
