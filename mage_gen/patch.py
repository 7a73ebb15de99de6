"""A model's layers routed to mage-gen's kernels: what mage_gen.torch.patch does.

Layers are swapped in place for modules that keep the same parameters (and state_dict keys) and call
mage_gen.torch where the kernel takes the input, torch's own function where it does not (another dtype, a CPU or
non-contiguous tensor, autograd). Only layers with an entry tuned on this GPU are routed, so a routed layer runs a
measured winner, never a default config:

- nn.Linear in bf16 whose weight (N, K) has a gemm_sm90 entry at some M (K a multiple of 8) -> mage_gen.torch.linear,
  which calls cuBLAS at an M whose serving entry's tune timed cuBLAS faster (dispatch.PEER_RULE)
- a SwiGLU MLP of the Hugging Face kind (a module with nn.Linear gate_proj, up_proj and down_proj and a SiLU act_fn,
  as Llama's, Mistral's and Qwen's are) whose (2·intermediate, hidden) has an entry -> GatedMLP: the gate and up
  projections' weights become the two halves of one tensor (views: the same parameters, names and values), and
  one gated kernel (mage_gen.torch.linear(..., gate="silu")) computes act_fn(gate_proj(x)) * up_proj(x)
- nn.RMSNorm, nn.LayerNorm over their last dimension, and RMSNorm modules of the Hugging Face kind (a class named
  *RMSNorm with a 1-D weight and `variance_epsilon` or `eps`), whose d has a tuned norm entry -> mage_gen.torch's

Under torch.compile, an Inductor post-grad pass (Fusions) fuses what a custom op would keep apart:
- an add whose sum feeds one of these norms (fuse_residual_norms): x + r -> norm becomes the residual form, one
  kernel that writes both the sum and the norm, as Inductor fuses them itself for torch's norms;
- a routed linear whose product is split in halves that only feed silu(first) * second, SwiGLU over a fused
  gate_up weight (fuse_gated_linears): one gated kernel (mage_gen.torch.linear(..., gate="silu")) computes it
  from the sums, and the product is never written nor read back;
- an add of a routed linear's product, its only use, and a tensor of its shape (fuse_residual_linears, after the
  norms have taken the sums they normalize): the kernel adds it in its epilogue (linear(..., residual=r)).
The gate and the add are fused only where the fused form runs mage-gen's kernel at the graph's M: where its serving
entry's tune timed cuBLAS faster (dispatch.PEER_RULE), the custom op would run torch's gate or add after cuBLAS's
product, unfused and out of Inductor's reach, so the product is left apart and Inductor fuses the gate its own way,
as for torch's layer; a product whose add is so left is handed back to Inductor at once (below), which folds the add
into cuBLAS's epilogue. And a routed linear that its serving entry hands to cuBLAS at the graph's M is handed
back to Inductor (hand_back_cublas_linears, last): the aten product torch's own layer traces to, which Inductor
compiles as it would unpatched (an add folded into cuBLAS's epilogue, a pointwise fused after it), where the custom
op would call cuBLAS with nothing around it fused.
"""

from __future__ import annotations

import hashlib
import math
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
from mage_gen.store import tuned_dirs, tuned_shapes

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


class GatedMLP(nn.Module):
    """A SwiGLU MLP of the Hugging Face kind, down_proj(act_fn(gate_proj(x)) * up_proj(x)), whose gate and up
    projections run as one gated kernel over one weight (gate_up: gate_proj's rows over up_proj's; their
    parameters become views of it, so the model keeps its parameters, names and values). Where the kernel cannot
    take x, the MLP's own arithmetic runs. Patch a model where it will run: moved to another device or dtype
    afterwards, its parameters would no longer be views of gate_up."""

    def __init__(self, mlp: nn.Module, down_proj: nn.Module):
        super().__init__()
        self.gate_proj, self.up_proj, self.down_proj, self.act_fn = mlp.gate_proj, mlp.up_proj, down_proj, mlp.act_fn
        self.register_buffer("gate_up", _views_of_one(self.gate_proj, self.up_proj, "weight"), persistent=False)
        biased = self.gate_proj.bias is not None
        self.register_buffer("gate_up_bias", _views_of_one(self.gate_proj, self.up_proj, "bias") if biased else None,
                             persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype is _BF16 and _routable(x, self.gate_proj.weight, self.up_proj.weight, self.gate_proj.bias,
                                          self.up_proj.bias):
            hidden = mt.linear(x, self.gate_up, self.gate_up_bias, cublas_where_faster=True, gate="silu")
        else:
            hidden = self.act_fn(self.gate_proj(x)) * self.up_proj(x)
        return self.down_proj(hidden)


def _views_of_one(first: nn.Linear, second: nn.Linear, name: str) -> torch.Tensor:
    """first's and second's parameter `name` concatenated along dim 0, each module's parameter replaced by its view of
    the result (the same values, requires_grad and name)."""
    joined = torch.cat([getattr(first, name).detach(), getattr(second, name).detach()])
    rows = getattr(first, name).shape[0]
    for module, part in ((first, joined[:rows]), (second, joined[rows:])):
        setattr(module, name, nn.Parameter(part, requires_grad=getattr(module, name).requires_grad))
    return joined


@dataclass(frozen=True)
class Routes:
    """What patch did: each routed layer's name by kind (gated: the MLPs whose gate and up projections run as one
    gated kernel), and each layer of a routable kind it left, with why."""

    linear: list[str] = field(default_factory=list)
    norm: list[str] = field(default_factory=list)
    gated: list[str] = field(default_factory=list)
    left: dict[str, str] = field(default_factory=dict)

    def __str__(self) -> str:
        return (f"mage-gen routes {len(self.linear)} linear layers, {len(self.gated)} gated MLPs and "
                f"{len(self.norm)} norms" + (f"; left {len(self.left)} to torch" if self.left else ""))


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
    _patch_children(model, "", gemm, norm_ds, routes)
    install_fusion()
    return routes


def _patch_children(parent: nn.Module, prefix: str, gemm: set[tuple[int, int]], norm_ds: dict[str, set[int]],
                    routes: Routes) -> None:
    for child_name, child in list(parent.named_children()):
        name = prefix + child_name
        why = _gated_mlp_refusal(child, gemm)
        if why == "":
            down, down_why = _swap(child.down_proj, gemm, norm_ds)
            setattr(parent, child_name, GatedMLP(child, down or child.down_proj))
            routes.gated.append(name)
            _record(routes, f"{name}.down_proj", down, down_why)
            continue
        if why is not None:
            routes.left[f"{name} (gate and up as one)"] = why
        swapped, why = _swap(child, gemm, norm_ds)
        if swapped is not None:
            setattr(parent, child_name, swapped)
        _record(routes, name, swapped, why)
        if swapped is None:
            _patch_children(child, name + ".", gemm, norm_ds, routes)


def _record(routes: Routes, name: str, swapped: nn.Module | None, why: str) -> None:
    if swapped is not None:
        (routes.linear if isinstance(swapped, Linear) else routes.norm).append(name)
    elif why:
        routes.left[name] = why


def _gated_mlp_refusal(module: nn.Module, gemm: set[tuple[int, int]]) -> str | None:
    """None where module is no SwiGLU MLP of the Hugging Face kind; "" where GatedMLP takes it; else why not."""
    parts = [getattr(module, name, None) for name in ("gate_proj", "up_proj", "down_proj")]
    act = getattr(module, "act_fn", None)
    if not (all(isinstance(p, nn.Linear) for p in parts) and isinstance(act, nn.Module)
            and type(act).__name__ in ("SiLU", "SiLUActivation")):
        return None
    gate, up, _ = parts
    n, k = 2 * gate.out_features, gate.in_features
    if (up.out_features, up.in_features) != (gate.out_features, k):
        return f"gate_proj {tuple(gate.weight.shape)} and up_proj {tuple(up.weight.shape)} differ"
    if {gate.weight.dtype, up.weight.dtype} != {_BF16} or gate.weight.device != up.weight.device:
        return "gate_proj and up_proj are not both bf16 on one device; the Hopper kernel takes bf16"
    if (gate.bias is None) != (up.bias is None):
        return "one of gate_proj and up_proj has a bias and the other not"
    if k % 8 or (n, k) not in gemm:
        return (f"nothing tuned for their joined weight N={n}, K={k} on this GPU: mage-gen tune gemm_sm90 --m 128 "
                f"--n {n} --k {k} --config gate=silu")
    return ""


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


class Fusions(CustomGraphPass):
    """Inductor's post-grad pass: fuse_gated_linears, fuse_residual_norms, fuse_residual_linears,
    hand_back_cublas_linears, then the pass it was installed over, if any."""

    def __init__(self, then: Any = None):
        self.then = then

    def __call__(self, graph: torch.fx.Graph) -> None:
        fuse_gated_linears(graph)
        fuse_residual_norms(graph)
        fuse_residual_linears(graph)
        hand_back_cublas_linears(graph)
        if self.then is not None:
            self.then(graph)

    def uuid(self) -> Any:
        mine = hashlib.sha256(Path(__file__).read_bytes())
        # the fusions ask tuned/ which products cuBLAS serves (_kernel_runs): Inductor must not reuse a graph
        # compiled before a tune changed the answer
        for folder in tuned_dirs():
            for entries in sorted(folder.glob("*/gemm_sm90.json")):
                mine.update(entries.read_bytes())
        return (mine.hexdigest(), self.then.uuid() if isinstance(self.then, CustomGraphPass) else repr(self.then))


def fuse_residual_norms(graph: torch.fx.Graph) -> None:
    """add(x, r) feeding mage_gen::rms_norm (layer_norm) -> their residual form, whose second output takes the
    sum's other uses. Only where x, r and the sum have one shape and dtype and are contiguous, and the norm's other
    arguments exist where the sum is made."""
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


# mage_gen::linear's arguments in order, with their defaults
_LINEAR_ARGS = (("x", None), ("weight", None), ("bias", None), ("scale_x", None), ("scale_weight", None),
                ("cublas_where_faster", False), ("gate", "none"), ("residual", None))


def fuse_residual_linears(graph: torch.fx.Graph) -> None:
    """add(y, r) (either order), where y is a mage_gen::linear product with no residual whose only use is the add,
    and r a tensor of y's shape and dtype -> mage_gen::linear(..., residual=r), one kernel; or, where that form's
    serving entry hands it to cuBLAS (PEER_RULE: its tune timed cuBLAS faster, or was tuned too far from this M to
    say; the product asked to defer to it), y -> the aten product (_to_aten), whose add Inductor folds into cuBLAS's
    epilogue as it does for torch's own layer, whatever the plain product's entry says. Where the fused form was
    timed, that beats our plain product followed by the add as a pass of its own: the fused kernel costs at most
    those two, and its tune timed it slower than cuBLAS's product and the same pass."""
    for total in list(graph.nodes):
        if not _fusable_sum(total):
            continue
        for product, residual in (total.args, total.args[::-1]):
            if not (product.target is torch.ops.mage_gen.linear.default and _only_feeds([product], {total})):
                continue
            values = _linear_values(product)
            if values["residual"] is not None:
                continue
            if not _kernel_runs(values, residual=True):
                if values["gate"] == "none":  # a gated product has no aten form: its add stays a pass of its own
                    _to_aten(graph, product, values)
                    break
                continue
            with graph.inserting_before(total):
                fused = graph.call_function(torch.ops.mage_gen.linear.default,
                                            tuple({**values, "residual": residual}.values()))
            fused.meta["val"] = total.meta["val"]
            total.replace_all_uses_with(fused)
            graph.erase_node(total)
            graph.erase_node(product)
            break


def hand_back_cublas_linears(graph: torch.fx.Graph) -> None:
    """mage_gen::linear with no gate or residual whose serving entry hands the product to cuBLAS at the graph's M
    (_kernel_runs, which finds x's and weight's shapes static) -> the aten ops nn.Linear traces to: x's rows as a
    matrix (the op takes x contiguous only), mm (addmm with a bias) by weight transposed, viewed back to x's leading
    dimensions."""
    for node in list(graph.nodes):
        if not (node.op == "call_function" and node.target is torch.ops.mage_gen.linear.default):
            continue
        values = _linear_values(node)
        if values["gate"] != "none" or values["residual"] is not None or _kernel_runs(values):
            continue
        _to_aten(graph, node, values)


def _to_aten(graph: torch.fx.Graph, node: torch.fx.Node, values: dict[str, Any]) -> None:
    """A mage_gen::linear node with no gate or residual, whose x and weight have static shapes -> the aten ops
    nn.Linear traces to, in its place."""
    aten = torch.ops.aten

    def call(op: Any, *args: Any) -> torch.fx.Node:
        made = graph.call_function(op, args)
        made.meta["val"] = op(*(a.meta["val"] if isinstance(a, torch.fx.Node) else a for a in args))
        return made

    x, weight, bias = values["x"], values["weight"], values["bias"]
    *lead, k = x.meta["val"].shape
    with graph.inserting_before(node):
        rows = call(aten.view.default, x, [math.prod(lead), k])
        transposed = call(aten.permute.default, weight, [1, 0])
        product = (call(aten.mm.default, rows, transposed) if bias is None
                   else call(aten.addmm.default, bias, rows, transposed))
        out = call(aten.view.default, product, [*lead, weight.meta["val"].shape[0]])
    node.replace_all_uses_with(out)
    graph.erase_node(node)


def fuse_gated_linears(graph: torch.fx.Graph) -> None:
    """mul(silu(g), u), where g and u are the first and second halves (along the last dimension) of a
    mage_gen::linear product with no other use -> mage_gen::linear(..., gate="silu") of the same x, weight and bias
    (added before the gate, as in the product), one kernel. silu as Inductor's decompositions leave it (x / (1 + exp(-x)), with dtype conversions
    around it), as x·sigmoid(x), or whole; every node between the product and the mul must have no other use."""
    aten = torch.ops.aten
    for mul in list(graph.nodes):
        if not (mul.op == "call_function" and mul.target is aten.mul.Tensor and len(mul.args) == 2
                and all(isinstance(a, torch.fx.Node) for a in mul.args)):
            continue
        for act, up in (mul.args, mul.args[::-1]):
            found = _silu_input(act)
            if found is None:
                continue
            gate_half, chain = found
            linear = _halves_of(gate_half, up)
            if linear is None or not _only_feeds([*chain, gate_half, up], {mul}):
                continue
            values = _linear_values(linear)
            if values["gate"] != "none" or values["residual"] is not None or not _kernel_runs(values, gate="silu"):
                continue
            with graph.inserting_before(mul):
                gated = graph.call_function(torch.ops.mage_gen.linear.default,
                                            tuple({**values, "gate": "silu"}.values()))
            gated.meta["val"] = mul.meta["val"]
            mul.replace_all_uses_with(gated)
            graph.erase_node(mul)
            for node in [*chain, gate_half, up, gate_half.args[0], linear]:  # the last: the split, the product
                if node.graph is graph and not node.users:
                    graph.erase_node(node)
            break


def _kernel_runs(values: dict[str, Any], **form: Any) -> bool:
    """Whether mage_gen::linear with these arguments, in this form (gate, residual: what a fusion would add), runs
    mage-gen's kernel: not where cublas_where_faster hands the product to cuBLAS (dispatch.PEER_RULE), which computes
    the gate or the add after it as torch's own ops, unfused and hidden from Inductor inside the custom op. Where M is
    symbolic the launch decides, and a fusion is kept."""
    if not values["cublas_where_faster"] or values["scale_x"] is not None:
        return True
    x, weight = (values[name].meta.get("val") if isinstance(values[name], torch.fx.Node) else None
                 for name in ("x", "weight"))
    if not (isinstance(x, torch.Tensor) and isinstance(weight, torch.Tensor)
            and all(isinstance(d, int) for d in (*x.shape, *weight.shape))):
        return True
    m, (n, k) = math.prod(x.shape[:-1]), weight.shape
    forms = {"gate": values["gate"], "bias": values["bias"] is not None, "residual": values["residual"] is not None}
    return not mt.serves_cublas(x.device.index or 0, m, n, k, **{**forms, **form})


def _linear_values(node: torch.fx.Node) -> dict[str, Any]:
    given = dict(zip((name for name, _ in _LINEAR_ARGS), node.args)) | dict(node.kwargs)
    return {name: given.get(name, default) for name, default in _LINEAR_ARGS}


def _silu_input(node: Any) -> tuple[Any, list[torch.fx.Node]] | None:
    """(g, the nodes that compute silu(g) from it) where node is silu(g) in one of the forms fuse_gated_linears
    knows; else None."""
    aten = torch.ops.aten
    node, chain = _past_conversions(node, [])
    if not (isinstance(node, torch.fx.Node) and node.op == "call_function"):
        return None
    chain.append(node)
    if node.target is aten.silu.default:
        return _past_conversions(node.args[0], chain)
    if node.target is aten.div.Tensor and len(node.args) == 2:  # g / (1 + exp(-g))
        g, denominator = node.args
        one_plus = denominator if isinstance(denominator, torch.fx.Node) else None
        if not (one_plus is not None and one_plus.target is aten.add.Tensor and 1 in one_plus.args[1:]):
            return None
        exp = one_plus.args[0]
        if not (isinstance(exp, torch.fx.Node) and exp.target is aten.exp.default):
            return None
        neg = exp.args[0]
        if not (isinstance(neg, torch.fx.Node) and neg.target is aten.neg.default and neg.args[0] is g):
            return None
        chain += [one_plus, exp, neg]
        return _past_conversions(g, chain)
    if node.target is aten.mul.Tensor and len(node.args) == 2:  # g · sigmoid(g)
        for g, sigmoid in (node.args, node.args[::-1]):
            if (isinstance(sigmoid, torch.fx.Node) and sigmoid.target is aten.sigmoid.default
                    and sigmoid.args[0] is g):
                return _past_conversions(g, [*chain, sigmoid])
    return None


def _past_conversions(g: Any, chain: list[torch.fx.Node]) -> tuple[Any, list[torch.fx.Node]]:
    """(g past the dtype conversions Inductor puts around it, chain with those conversions added)."""
    while (isinstance(g, torch.fx.Node) and g.op == "call_function"
           and g.target is torch.ops.prims.convert_element_type.default):
        chain.append(g)
        g = g.args[0]
    return g, chain


def _halves_of(gate_half: Any, up_half: Any) -> torch.fx.Node | None:
    """The mage_gen::linear whose product's first half (last dimension) gate_half is and second half up_half is, as
    getitem 0 and 1 of one split in two equal parts; else None."""
    if not all(isinstance(h, torch.fx.Node) and h.target is operator.getitem for h in (gate_half, up_half)):
        return None
    split = gate_half.args[0]
    if up_half.args[0] is not split or (gate_half.args[1], up_half.args[1]) != (0, 1):
        return None
    aten = torch.ops.aten
    if not (isinstance(split, torch.fx.Node) and split.target in (aten.split.Tensor, aten.split_with_sizes.default)):
        return None
    product = split.args[0]
    if not (isinstance(product, torch.fx.Node) and product.target is torch.ops.mage_gen.linear.default):
        return None
    value = product.meta.get("val")
    if not isinstance(value, torch.Tensor) or value.dim() < 1:
        return None
    n, dim = value.shape[-1], split.args[2] if len(split.args) > 2 else split.kwargs.get("dim", 0)
    sizes = split.args[1]
    halves = sizes == n // 2 if isinstance(sizes, int) else list(sizes) == [n // 2, n // 2]
    if not (n % 2 == 0 and halves and dim in (-1, value.dim() - 1)):
        return None
    return product if _only_feeds([product], {split}) and _only_feeds([split], {gate_half, up_half}) else None


def _only_feeds(nodes: list[torch.fx.Node], allowed: set[torch.fx.Node]) -> bool:
    """Every use of these nodes is by one of them or by `allowed`."""
    inside = set(nodes) | allowed
    return all(user in inside for node in nodes for user in node.users)


def _fusable_sum(node: Any) -> bool:
    """An aten add of two tensors of one shape and dtype, contiguous, with no alpha."""
    if not (isinstance(node, torch.fx.Node) and node.op == "call_function" and node.target is torch.ops.aten.add.Tensor
            and len(node.args) == 2 and not node.kwargs and all(isinstance(a, torch.fx.Node) for a in node.args)):
        return False
    values = [a.meta.get("val") for a in (*node.args, node)]
    return all(isinstance(v, torch.Tensor) and v.shape == values[2].shape and v.dtype == values[2].dtype
               and v.is_contiguous() for v in values)


def install_fusion() -> None:
    """Inductor's post-grad pass runs Fusions, before any pass installed there already (once)."""
    import torch._inductor.config as inductor

    current = inductor.post_grad_custom_pre_pass
    if not isinstance(current, Fusions):
        inductor.post_grad_custom_pre_pass = Fusions(then=current)
