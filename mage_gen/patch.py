"""A model's layers routed to mage-gen's kernels: what mage_gen.torch.patch does.

Layers are swapped in place for modules that keep the same parameters (and state_dict keys) and call
mage_gen.torch where the kernel takes the input, torch's own function where it does not (another dtype, a CPU or
non-contiguous tensor, autograd). Only layers with an entry tuned on this GPU are routed, so a routed layer runs a
measured winner, never a default config:

- nn.Linear in bf16 whose weight (N, K) has a gemm_sm90 entry at some M (K a multiple of 8) -> mage_gen.torch.linear,
  which calls cuBLAS at an M whose serving entry's tune timed cuBLAS faster (dispatch.PEER_RULE)
- nn.RMSNorm, nn.LayerNorm over their last dimension, and RMSNorm modules of the Hugging Face kind (a class named
  *RMSNorm with a 1-D weight and `variance_epsilon` or `eps`), whose d has a tuned norm entry -> mage_gen.torch's

Under torch.compile, an add whose sum feeds one of these norms is fused with it (FuseResidualNorms, a post-grad
pass of Inductor): x + r -> norm becomes the residual form, one kernel that writes both the sum and the norm, as
Inductor fuses them itself for torch's norms.
"""

from __future__ import annotations

import hashlib
import operator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch._inductor.custom_graph_pass import CustomGraphPass

import mage_gen.torch as mt
from mage_gen.ops import get_op
from mage_gen.store import tuned_shapes

_BF16 = torch.bfloat16


def _routable(x: torch.Tensor, *params: torch.Tensor | None) -> bool:
    """The kernel takes x with these parameters: else the layer runs torch's function (no backward here)."""
    return (x.is_cuda and x.is_contiguous() and x.numel() > 0
            and not (torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (x, *params))))


class Linear(nn.Module):
    """nn.Linear whose forward is mage_gen.torch.linear for bf16 CUDA input, and cuBLAS at an M whose serving entry's
    tune timed cuBLAS faster (dispatch.PEER_RULE): a patched model is never handed a kernel its tune saw lose."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight, self.bias = linear.weight, linear.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype is _BF16 and _routable(x, self.weight, self.bias):
            return mt.linear(x, self.weight, self.bias, cublas_where_faster=True)
        return F.linear(x, self.weight, self.bias)


class RMSNorm(nn.Module):
    """An RMSNorm over the last dimension whose forward is mage_gen.torch.rms_norm where the kernel takes x."""

    def __init__(self, weight: nn.Parameter, eps: float):
        super().__init__()
        self.weight, self.eps = weight, eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if (x.dtype in (torch.float32, _BF16, torch.float16) and self.weight.dtype in (x.dtype, torch.float32)
                and _routable(x, self.weight)):
            return mt.rms_norm(x, self.weight, self.eps)
        return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)


class LayerNorm(nn.Module):
    """nn.LayerNorm over the last dimension whose forward is mage_gen.torch.layer_norm where the kernel takes x."""

    def __init__(self, norm: nn.LayerNorm):
        super().__init__()
        self.weight, self.bias, self.eps = norm.weight, norm.bias, norm.eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if (x.dtype in (torch.float32, _BF16, torch.float16) and self.weight.dtype in (x.dtype, torch.float32)
                and _routable(x, self.weight, self.bias)):
            return mt.layer_norm(x, self.weight, self.bias, self.eps)
        return F.layer_norm(x, (x.shape[-1],), self.weight, self.bias, self.eps)


@dataclass(frozen=True)
class Routes:
    """What patch did: each routed layer's name by kind, and each layer of a routable kind it left, with why."""

    linear: list[str] = field(default_factory=list)
    norm: list[str] = field(default_factory=list)
    left: dict[str, str] = field(default_factory=dict)

    def __str__(self) -> str:
        return (f"mage-gen routes {len(self.linear)} linear layers and {len(self.norm)} norms"
                + (f"; left {len(self.left)} to torch" if self.left else ""))


def _rms_eps(module: nn.Module) -> float | None:
    """eps of an RMSNorm module over the last dimension with a 1-D weight (torch's, or the Hugging Face kind), or
    None where the module is not one."""
    weight = getattr(module, "weight", None)
    if not isinstance(weight, torch.Tensor) or weight.dim() != 1:
        return None
    if isinstance(module, nn.RMSNorm):
        return module.eps if len(module.normalized_shape) == 1 and module.eps is not None else None
    if type(module).__name__.endswith("RMSNorm"):
        eps = getattr(module, "variance_epsilon", getattr(module, "eps", None))
        return float(eps) if isinstance(eps, float) else None
    return None


def patch_model(model: nn.Module, gpu_name: str | None = None) -> Routes:
    gpu_name = gpu_name or torch.cuda.get_device_name()
    gemm = {(s.n, s.k) for s in tuned_shapes(get_op("gemm_sm90"), gpu_name)
            if (s.precision, s.c_dtype, s.b_layout) == ("bf16", "bf16", "nk")}
    norm_ds = {name: {s.d for s in tuned_shapes(get_op(name), gpu_name)} for name in ("rmsnorm", "layernorm")}
    routes = Routes()
    for parent_name, parent in list(model.named_modules()):
        for child_name, child in list(parent.named_children()):
            name = f"{parent_name}.{child_name}" if parent_name else child_name
            swapped, why = _swap(child, gemm, norm_ds)
            if swapped is not None:
                setattr(parent, child_name, swapped)
                (routes.linear if isinstance(swapped, Linear) else routes.norm).append(name)
            elif why:
                routes.left[name] = why
    install_fusion()
    return routes


def _swap(module: nn.Module, gemm: set[tuple[int, int]], norm_ds: dict[str, set[int]]) -> tuple[Any, str]:
    """(the routed module, "") or (None, why a module of a routable kind was left; "" for any other module)."""
    if isinstance(module, nn.Linear):
        n, k = module.out_features, module.in_features
        if module.weight.dtype is not _BF16:
            return None, f"weight is {module.weight.dtype}; the Hopper kernel takes bf16"
        if k % 8 or (n, k) not in gemm:
            return None, f"nothing tuned for N={n}, K={k} on this GPU: mage-gen tune gemm_sm90 --m 128 --n {n} --k {k}"
        return Linear(module), ""
    eps = _rms_eps(module)
    if eps is not None:
        d = module.weight.numel()
        if d not in norm_ds["rmsnorm"]:
            return None, f"no rmsnorm tuned for d={d} on this GPU: mage-gen tune rmsnorm --d {d} --m auto"
        return RMSNorm(module.weight, eps), ""
    if isinstance(module, nn.LayerNorm):
        if len(module.normalized_shape) != 1 or module.weight is None or module.bias is None:
            return None, "a layer norm over more than the last dimension, or without weight and bias"
        d = module.normalized_shape[0]
        if d not in norm_ds["layernorm"]:
            return None, f"no layernorm tuned for d={d} on this GPU: mage-gen tune layernorm --d {d} --m auto"
        return LayerNorm(module), ""
    return None, ""


class FuseResidualNorms(CustomGraphPass):
    """add(x, r) feeding mage_gen::rms_norm (layer_norm) -> their residual form, whose second output takes the
    sum's other uses. Only where x, r and the sum have one shape and dtype and are contiguous, and the norm's other
    arguments exist where the sum is made; then runs the pass it was installed over, if any."""

    def __init__(self, then: Any = None):
        self.then = then

    def __call__(self, graph: torch.fx.Graph) -> None:
        fused = {torch.ops.mage_gen.rms_norm.default: torch.ops.mage_gen.rms_norm_residual.default,
                 torch.ops.mage_gen.layer_norm.default: torch.ops.mage_gen.layer_norm_residual.default}
        order = {node: i for i, node in enumerate(graph.nodes)}
        for norm in list(graph.nodes):
            residual_form = fused.get(norm.target) if norm.op == "call_function" else None
            total = norm.args[0] if residual_form is not None else None
            if not _fusable_sum(total) or any(isinstance(a, torch.fx.Node) and order[a] > order[total]
                                              for a in norm.args[1:]):
                continue
            with graph.inserting_after(total):
                pair = graph.call_function(residual_form, (*total.args, *norm.args[1:]))
            with graph.inserting_after(pair):
                y = graph.call_function(operator.getitem, (pair, 0))
            with graph.inserting_after(y):
                h = graph.call_function(operator.getitem, (pair, 1))
            pair.meta["val"] = (norm.meta["val"], total.meta["val"])
            y.meta["val"], h.meta["val"] = norm.meta["val"], total.meta["val"]
            norm.replace_all_uses_with(y)
            total.replace_all_uses_with(h)
            graph.erase_node(norm)
            graph.erase_node(total)
            order = {node: i for i, node in enumerate(graph.nodes)}
        if self.then is not None:
            self.then(graph)

    def uuid(self) -> Any:
        mine = hashlib.sha256(Path(__file__).read_bytes()).hexdigest()
        return (mine, self.then.uuid() if isinstance(self.then, CustomGraphPass) else repr(self.then))


def _fusable_sum(node: Any) -> bool:
    """An aten add of two tensors of one shape and dtype, contiguous, with no alpha."""
    if not (isinstance(node, torch.fx.Node) and node.op == "call_function" and node.target is torch.ops.aten.add.Tensor
            and len(node.args) == 2 and not node.kwargs and all(isinstance(a, torch.fx.Node) for a in node.args)):
        return False
    values = [a.meta.get("val") for a in (*node.args, node)]
    return all(isinstance(v, torch.Tensor) and v.shape == values[2].shape and v.dtype == values[2].dtype
               and v.is_contiguous() for v in values)


def install_fusion() -> None:
    """Inductor's post-grad pass runs FuseResidualNorms, before any pass installed there already (once)."""
    import torch._inductor.config as inductor

    current = inductor.post_grad_custom_pre_pass
    if not isinstance(current, FuseResidualNorms):
        inductor.post_grad_custom_pre_pass = FuseResidualNorms(then=current)
