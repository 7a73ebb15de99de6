"""Gate cases drawn on the GPU by torch: fresh inputs and their float64 reference made where the kernel reads them,
for ops whose inputs take most of a trial to draw and multiply on the host (a GEMM's weights: 70B's gate_up is 470M
elements). Each builder is an op's declared `device_case` (ops.base.OpFamily), called as (shape, run, seed, device)
-> (inputs, reference): the inputs laid out as the op's make_inputs lays them out (the same storage, rows, padding
and ranges of values), the reference as its reference computes it, in float64; torch tensors on `device`. The
tests hold each builder to its op's numpy make_inputs and reference, on the CPU."""

from __future__ import annotations

from typing import Any

import torch

from mage_gen.dtypes import DType

# the integer type of each storage width, as the host's arrays hold an element's bits
_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32}


def _stored(values: torch.Tensor, element: DType) -> torch.Tensor:
    """float32 values rounded to the element type as torch casts (the host's DType.round rounds the same way),
    as that type's bits."""
    return values.to(getattr(torch, element.name)).view(_BITS[element.itemsize])


def widened(bits: torch.Tensor, element: DType) -> torch.Tensor:
    """Stored bits as float64, through float32 (which holds every element type here exactly and which every type
    converts to)."""
    return bits.view(getattr(torch, element.name)).to(torch.float32).to(torch.float64)


def _nan_bits(element: DType) -> int:
    """The element type's NaN as its storage integer holds it (signed where torch's is)."""
    bits = element.nan_bits & (1 << 8 * element.itemsize) - 1
    signed = _BITS[element.itemsize].is_signed
    return bits - (1 << 8 * element.itemsize) if signed and bits >= 1 << 8 * element.itemsize - 1 else bits


def gemm_sm90_case(shape: Any, run: dict[str, int], seed: int, device: str = "cuda"
                   ) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """gemm_sm90's make_inputs and reference (ops/gemm_sm90.py), drawn by torch's generator from the seed."""
    from mage_gen.ops.gemm_sm90 import OUTPUTS, SCALE_BLOCK, SCALE_RANGE, _scale_shapes, input_sizes

    generator = torch.Generator(device).manual_seed(seed)
    element, out = shape.element, OUTPUTS[shape.c_dtype]
    spread, size = input_sizes(shape)

    def normal(*dims: int) -> torch.Tensor:
        return torch.randn(dims, generator=generator, device=device, dtype=torch.float32)

    def rows(count: int, length: int, stride: int, kind: DType, scale: float) -> torch.Tensor:
        held = torch.empty((count, stride), dtype=_BITS[kind.itemsize], device=device)
        held[:, :length] = _stored(scale * normal(count, length), kind)
        held[:, length:] = _nan_bits(kind)  # a kernel that read past K would read NaN
        return held

    b_rows, b_cols = (shape.n, shape.k) if shape.b_layout == "nk" else (shape.k, shape.n)
    inputs = {"A": rows(shape.m, shape.k, shape.lda, element, spread),
              "B": rows(b_rows, b_cols, shape.ldb, element, spread)}
    low, high = SCALE_RANGE
    for name, dims in _scale_shapes(shape).items():
        inputs[name] = low + (high - low) * torch.rand(dims, generator=generator, device=device, dtype=torch.float32)
    if shape.bias:
        inputs["bias"] = _stored(size * normal(shape.n), out)
    if shape.residual:
        inputs["residual"] = rows(shape.m, shape.c_cols, shape.c_cols, out, size)

    with torch.no_grad():
        a = widened(inputs["A"][:, :shape.k], element)
        if shape.precision == "e4m3_block":
            blocks = torch.arange(shape.k, device=device) // SCALE_BLOCK
            b_blocks = torch.arange(shape.n, device=device) // SCALE_BLOCK
            a = a * inputs["scale_a"].double()[:, blocks]
            b = widened(inputs["B"][:, :shape.k], element) * inputs["scale_b"].double()[b_blocks][:, blocks]
            c = a @ b.T
        else:
            b = (widened(inputs["B"][:, :shape.n], element) if shape.b_layout == "kn"
                 else widened(inputs["B"][:, :shape.k], element).T)
            c = a @ b
            if shape.precision == "e4m3":  # the scales as the kernel applies them: their fp32 product
                c = c * float(inputs["scale_a"][0] * inputs["scale_b"][0])
        if shape.bias:
            c = c + widened(inputs["bias"], out)
        if shape.gate == "silu":
            gate, up = c[:, :shape.c_cols], c[:, shape.c_cols:]
            c = gate / (1 + torch.exp(-gate)) * up
        if shape.residual:
            c = c + widened(inputs["residual"], out)
    return inputs, {"C": c.contiguous()}
