"""mage_gen.torch.patch on the CPU: which layers it routes (only those tuned on the GPU named), that a model keeps its
parameters, that torch runs what the kernels cannot take, and the Inductor pass that fuses an add into the norm after
it."""

import operator

import pytest

torch = pytest.importorskip("torch")
FakeTensorMode = pytest.importorskip("torch._subclasses.fake_tensor").FakeTensorMode
make_fx = pytest.importorskip("torch.fx.experimental.proxy_tensor").make_fx

import mage_gen.torch as mt  # noqa: E402
from mage_gen import patch as routing  # noqa: E402

H200 = "NVIDIA H200"
BF16 = torch.bfloat16


@pytest.fixture(autouse=True)
def kernel_serves_every_product(monkeypatch):
    """The fusions ask tuned/ whether cuBLAS serves a product (mage_gen.torch.serves_cublas): here nothing does, the
    same on a machine with a GPU as without, unless a test says otherwise."""
    monkeypatch.setattr(mt, "serves_cublas", lambda *shape, **form: False)


class HFRMSNorm(torch.nn.Module):  # the Hugging Face kind: a class named *RMSNorm with variance_epsilon
    def __init__(self, d):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(d, dtype=BF16))
        self.variance_epsilon = 1e-5


class Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = HFRMSNorm(4096)
        self.o = torch.nn.Linear(4096, 4096, bias=False, dtype=BF16)  # tuned at several M on the H200
        self.head = torch.nn.Linear(4096, 1000, bias=False, dtype=BF16)  # (1000, 4096) tuned at no M
        self.fp32 = torch.nn.Linear(4096, 4096)
        self.ln = torch.nn.LayerNorm(768, dtype=BF16)
        self.odd = torch.nn.LayerNorm(1000)


def test_patch_routes_only_what_is_tuned_and_says_why_it_left_the_rest():
    model = Block()
    keys = set(model.state_dict())
    routes = mt.patch(model, gpu_name=H200)
    assert routes.linear == ["o"] and sorted(routes.norm) == ["ln", "norm"]
    assert routes.left["head"].startswith("nothing tuned for N=1000, K=4096 on this GPU: mage-gen tune gemm_sm90")
    assert routes.left["fp32"] == "weight is torch.float32; the Hopper kernel takes bf16"
    assert routes.left["odd"].startswith("no layernorm tuned for d=1000")
    assert isinstance(model.o, routing.Linear) and isinstance(model.norm, routing.RMSNorm)
    assert model.norm.eps == 1e-5 and set(model.state_dict()) == keys  # the same parameters under the same names
    assert str(routes) == "mage-gen routes 1 linear layers, 0 gated MLPs and 2 norms; left 3 to torch"


def test_a_routed_layer_runs_torch_where_the_kernel_cannot_take_the_input():
    model = Block()
    mt.patch(model, gpu_name=H200)
    x = torch.randn(3, 4096, dtype=BF16)  # on the CPU
    assert torch.equal(model.o(x), torch.nn.functional.linear(x, model.o.weight))
    assert torch.equal(model.norm(x), torch.nn.functional.rms_norm(x, (4096,), model.norm.weight, 1e-5))
    y = torch.randn(3, 768, dtype=BF16)
    assert torch.equal(model.ln(y), torch.nn.functional.layer_norm(y, (768,), model.ln.weight, model.ln.bias, 1e-5))


def traced(fn, *shapes):
    with FakeTensorMode():
        args = [torch.empty(*s, dtype=BF16, device="cuda") for s in shapes]
        return make_fx(fn, tracing_mode="fake")(*args)


def targets(gm):
    return [n.target for n in gm.graph.nodes if n.op == "call_function"]


def test_an_add_feeding_a_norm_becomes_its_residual_form_and_its_other_uses_take_the_sum():
    def block(x, r, w):
        h = x + r
        return torch.ops.mage_gen.rms_norm(h, w, 1e-6), h * 2

    gm = traced(block, (8, 4096), (8, 4096), (4096,))
    assert torch.ops.aten.add.Tensor in targets(gm)
    routing.fuse_residual_norms(gm.graph)
    gm.graph.lint()
    assert torch.ops.aten.add.Tensor not in targets(gm) and torch.ops.mage_gen.rms_norm.default not in targets(gm)
    (fused,) = [n for n in gm.graph.nodes if n.target is torch.ops.mage_gen.rms_norm_residual.default]
    y, h = sorted(fused.users, key=lambda n: n.args[1])
    assert y.args[1] == 0 and h.args[1] == 1 and y.target is h.target is operator.getitem
    (doubled,) = h.users
    assert doubled.target is torch.ops.aten.mul.Tensor


def test_a_broadcast_add_or_a_norm_of_no_sum_is_left_alone():
    def block(x, r, w):
        return torch.ops.mage_gen.layer_norm(x + r, w, w, 1e-5), torch.ops.mage_gen.rms_norm(x, w, 1e-6)

    gm = traced(block, (8, 768), (768,), (768,))
    before = targets(gm)
    routing.fuse_residual_norms(gm.graph)
    assert targets(gm) == before


def test_the_pass_is_installed_once_before_any_pass_already_there():
    import torch._inductor.config as inductor

    seen = []
    # set and put back by hand: after monkeypatch's undo, Inductor's config module reports the attribute as missing
    # to every later reader
    was = inductor.post_grad_custom_pre_pass
    inductor.post_grad_custom_pre_pass = seen.append
    try:
        routing.install_fusion()
        routing.install_fusion()
        installed = inductor.post_grad_custom_pre_pass
        assert isinstance(installed, routing.Fusions) and installed.then == seen.append
        installed(torch.fx.Graph())
        assert len(seen) == 1
    finally:
        inductor.post_grad_custom_pre_pass = was


def decomposed(fn, *shapes):
    """fn traced as Inductor's post-grad pass sees it: after Inductor's decompositions (silu as x / (1 + exp(-x)))."""
    from torch._inductor.decomposition import select_decomp_table

    with FakeTensorMode():
        args = [torch.empty(*s, dtype=BF16, device="cuda") for s in shapes]
        return make_fx(fn, tracing_mode="fake", decomposition_table=select_decomp_table())(*args)


def gated(gm):
    return [n for n in gm.graph.nodes if n.target is torch.ops.mage_gen.linear.default and "silu" in n.args]


def test_silu_of_a_routed_products_first_half_times_its_second_becomes_one_gated_linear():
    def mlp(x, w):
        gate, up = torch.ops.mage_gen.linear(x, w, None, None, None, True).chunk(2, -1)
        return torch.nn.functional.silu(gate) * up

    def sliced(x, w, b):  # split_with_sizes, silu written out as x·sigmoid(x), the product on the left, a bias
        gate, up = torch.ops.mage_gen.linear(x, w, b).split([1024, 1024], dim=1)
        return up * (gate * torch.sigmoid(gate))

    for fn, shapes in ((mlp, [(8, 4096), (2048, 4096)]), (sliced, [(8, 4096), (2048, 4096), (2048,)])):
        gm = decomposed(fn, *shapes)
        routing.fuse_gated_linears(gm.graph)
        gm.graph.lint()
        (node,) = gated(gm)
        assert targets(gm) == [torch.ops.mage_gen.linear.default]  # nothing else is left
        inputs = [n for n in gm.graph.nodes if n.op == "placeholder"]
        assert node.args[:3] == (*inputs[:2], inputs[2] if len(inputs) > 2 else None)  # x, weight and the bias
        assert tuple(node.meta["val"].shape) == (8, 1024)
    gm = decomposed(mlp, (8, 4096), (2048, 4096))
    assert gated(gm) == []


@pytest.mark.parametrize("why, fn", [
    ("the product is used elsewhere", lambda x, w, b: (lambda y: (torch.nn.functional.silu(y.chunk(2, -1)[0])
                                                                   * y.chunk(2, -1)[1], y))(
        torch.ops.mage_gen.linear(x, w, None))),
    ("silu of the second half", lambda x, w, b: (lambda g, u: torch.nn.functional.silu(u) * g)(
        *torch.ops.mage_gen.linear(x, w, None).chunk(2, -1))),
    ("quarters, not halves", lambda x, w, b: (lambda g, u, *rest: torch.nn.functional.silu(g) * u)(
        *torch.ops.mage_gen.linear(x, w, None).chunk(4, -1))),
    ("another function than silu", lambda x, w, b: (lambda g, u: torch.nn.functional.gelu(g) * u)(
        *torch.ops.mage_gen.linear(x, w, None).chunk(2, -1))),
    ("halves of the first dimension", lambda x, w, b: (lambda g, u: torch.nn.functional.silu(g) * u)(
        *torch.ops.mage_gen.linear(x, w, None).chunk(2, 0))),
])
def test_a_product_the_gated_kernel_cannot_stand_for_is_left_alone(why, fn):
    gm = decomposed(fn, (8, 4096), (2048, 4096), (2048,))
    before = targets(gm)
    routing.fuse_gated_linears(gm.graph)
    assert targets(gm) == before and gated(gm) == [], why


def test_an_add_of_a_routed_product_becomes_its_residual_unless_a_norm_takes_the_sum():
    def layer(x, w, r, g):
        h = r + torch.ops.mage_gen.linear(x, w, None)  # feeds the norm: the norm's residual form takes it
        y = torch.ops.mage_gen.rms_norm(h, g, 1e-6)
        return torch.ops.mage_gen.linear(y, w, None) + h  # the epilogue's residual

    gm = decomposed(layer, (8, 4096), (4096, 4096), (8, 4096), (4096,))
    routing.Fusions()(gm.graph)
    gm.graph.lint()
    assert torch.ops.aten.add.Tensor not in targets(gm)
    assert targets(gm).count(torch.ops.mage_gen.rms_norm_residual.default) == 1
    linears = [n for n in gm.graph.nodes if n.target is torch.ops.mage_gen.linear.default]
    assert [n.args[-1] is not None for n in linears] == [False, True]
    (_, h) = sorted(next(iter(linears[0].users)).users, key=lambda n: n.args[1])
    assert linears[1].args[-1] is h and gm.graph.output_node().args[0] is linears[1]


@pytest.mark.parametrize("why, fn, r", [
    ("the product is used elsewhere", lambda x, w, r: (lambda y: (y + r, y))(torch.ops.mage_gen.linear(x, w, None)),
     (8, 4096)),
    ("a broadcast add", lambda x, w, r: torch.ops.mage_gen.linear(x, w, None) + r, (4096,)),
    ("a sum of two tensors", lambda x, w, r: x + r, (8, 4096)),
])
def test_an_add_the_epilogue_cannot_take_is_left_alone(why, fn, r):
    gm = decomposed(fn, (8, 4096), (4096, 4096), r)
    before = targets(gm)
    routing.fuse_residual_linears(gm.graph)
    assert targets(gm) == before, why


class LlamaMLP(torch.nn.Module):  # the Hugging Face kind: gate_proj, up_proj, down_proj, act_fn SiLU
    def __init__(self, hidden, intermediate, bias=False):
        super().__init__()
        self.gate_proj = torch.nn.Linear(hidden, intermediate, bias=bias, dtype=BF16)
        self.up_proj = torch.nn.Linear(hidden, intermediate, bias=bias, dtype=BF16)
        self.down_proj = torch.nn.Linear(intermediate, hidden, bias=False, dtype=BF16)
        self.act_fn = torch.nn.SiLU()

    def forward(self, x):
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


@pytest.mark.parametrize("bias", [False, True])
def test_a_swiglu_mlp_runs_its_gate_and_up_as_one_weight_keeping_its_parameters(bias):
    model = torch.nn.Sequential(LlamaMLP(4096, 3072, bias))  # gate and up joined: 6144×4096, tuned at some M
    before = {k: v.clone() for k, v in model.state_dict().items()}
    x = torch.randn(3, 4096, dtype=BF16)
    expected = model(x)
    routes = mt.patch(model, gpu_name=H200)
    mlp = model[0]
    assert isinstance(mlp, routing.GatedMLP) and routes.gated == ["0"] and routes.linear == []
    assert routes.left == {"0.down_proj": "nothing tuned for N=4096, K=3072 on this GPU: mage-gen tune gemm_sm90 "
                                          "--m 128 --n 4096 --k 3072"}
    assert mlp.gate_up.shape == (6144, 4096) and (mlp.gate_up_bias is not None) == bias
    assert mlp.gate_proj.weight.data_ptr() == mlp.gate_up.data_ptr()  # views of the one weight the kernel reads
    assert mlp.up_proj.weight.data_ptr() == mlp.gate_up[3072:].data_ptr()
    after = model.state_dict()
    assert after.keys() == before.keys() and all(torch.equal(after[k], v) for k, v in before.items())
    assert torch.equal(model(x), expected)  # on the CPU: the MLP's own arithmetic
    model.load_state_dict({k: torch.zeros_like(v) for k, v in before.items()})
    assert not mlp.gate_up.any()  # loaded weights reach the joined one


def test_an_mlp_whose_joined_weight_is_untuned_is_left_to_its_layers_and_says_why():
    model = torch.nn.Sequential(LlamaMLP(4096, 1000))
    routes = mt.patch(model, gpu_name=H200)
    assert isinstance(model[0], LlamaMLP) and routes.gated == [] and routes.linear == []
    assert routes.left["0 (gate and up as one)"] == ("nothing tuned for their joined weight N=2000, K=4096 on this GPU: "
                                                     "mage-gen tune gemm_sm90 --m 128 --n 2000 --k 4096 --config gate=silu")
    assert set(routes.left) == {"0 (gate and up as one)", "0.gate_proj", "0.up_proj", "0.down_proj"}


def test_a_fusion_is_left_where_cublas_serves_the_fused_form_and_asked_only_where_cublas_may_serve(monkeypatch):
    """Where the fused form's serving entry timed cuBLAS faster, linear(..., cublas_where_faster=True) would compute the
    gate or the add after cuBLAS's product as torch's own ops inside the custom op: the fusions leave the product to
    Inductor's own gate instead, and hand a product whose add is left back to Inductor as aten ops, whose add it folds
    into cuBLAS's epilogue, though the kernel serves the plain product. A product not asked to defer to cuBLAS is
    fused without asking."""
    asked = []

    def serves(index, m, n, k, gate="none", bias=False, residual=False):
        asked.append((m, n, k, gate, bias, residual))
        return gate == "silu" or residual

    monkeypatch.setattr(mt, "serves_cublas", serves)

    def mlp(x, w, r):
        gate, up = torch.ops.mage_gen.linear(x, w, None, None, None, True).chunk(2, -1)
        return torch.nn.functional.silu(gate) * up

    gm = decomposed(mlp, (8, 4096), (2048, 4096), (8, 1024))
    before = targets(gm)
    routing.Fusions()(gm.graph)
    assert targets(gm) == before
    # the gated form, then (for the hand-back to Inductor) the plain product, which the kernel serves here
    assert asked == [(8, 2048, 4096, "silu", False, False), (8, 2048, 4096, "none", False, False)]

    def residual(x, w, r):
        return torch.ops.mage_gen.linear(x, w, None, None, None, True) + r

    gm = decomposed(residual, (8, 4096), (4096, 4096), (8, 4096))
    routing.Fusions()(gm.graph)
    gm.graph.lint()
    gm.recompile()
    aten = torch.ops.aten
    assert torch.ops.mage_gen.linear.default not in targets(gm)
    assert {aten.mm.default, aten.add.Tensor} <= set(targets(gm))
    assert asked[2:] == [(8, 4096, 4096, "none", False, True)]  # the residual form's answer decides; the plain's unasked
    x, w, r = (torch.randn(*shape, dtype=BF16) for shape in ((8, 4096), (4096, 4096), (8, 4096)))
    assert torch.equal(gm(x, w, r), torch.nn.functional.linear(x, w) + r)

    def gated_residual(x, w, r):  # a gated product has no aten form: it stays, its add a pass of its own
        return torch.ops.mage_gen.linear(x, w, None, None, None, True, "silu") + r

    gm = decomposed(gated_residual, (8, 4096), (2048, 4096), (8, 1024))
    before = targets(gm)
    routing.Fusions()(gm.graph)
    assert targets(gm) == before and asked[-1] == (8, 2048, 4096, "silu", False, True)

    def unasked(x, w, r):
        return torch.ops.mage_gen.linear(x, w, None) + r

    gm = decomposed(unasked, (8, 4096), (4096, 4096), (8, 4096))
    routing.Fusions()(gm.graph)
    assert torch.ops.aten.add.Tensor not in targets(gm) and len(asked) == 4


@pytest.mark.parametrize("bias", [False, True])
def test_a_product_cublas_serves_is_handed_back_to_inductor_as_the_aten_product_of_torch_s_layer(monkeypatch, bias):
    """Where the plain product's serving entry timed cuBLAS faster, the custom op would call cuBLAS with nothing
    around it fused: the pass gives Inductor nn.Linear's own aten product instead (mm, or addmm with the bias), which
    computes what the op computes, and its add stays an aten add for Inductor to fold in."""
    monkeypatch.setattr(mt, "serves_cublas", lambda index, m, n, k, gate="none", bias=False, residual=False: True)

    def layer(x, w, b, r):
        return torch.ops.mage_gen.linear(x, w, b if bias else None, None, None, True) + r

    gm = decomposed(layer, (2, 8, 256), (128, 256), (128,), (2, 8, 128))
    routing.Fusions()(gm.graph)
    gm.graph.lint()
    gm.recompile()
    aten = torch.ops.aten
    assert torch.ops.mage_gen.linear.default not in targets(gm)
    assert (aten.addmm.default if bias else aten.mm.default) in targets(gm) and aten.add.Tensor in targets(gm)
    x, w, b, r = (torch.randn(*s, dtype=BF16) for s in ((2, 8, 256), (128, 256), (128,), (2, 8, 128)))
    assert torch.equal(gm(x, w, b, r), torch.nn.functional.linear(x, w, b if bias else None) + r)


@pytest.mark.parametrize("why, fn, x, w", [
    ("not asked to defer to cuBLAS", lambda x, w: torch.ops.mage_gen.linear(x, w, None), (8, 256), (128, 256)),
    ("the kernel serves it", lambda x, w: torch.ops.mage_gen.linear(x, w, None, None, None, True), (8, 256),
     (64, 256)),
])
def test_a_product_is_left_to_the_kernel_unless_asked_to_defer_and_cublas_serves_it(
        monkeypatch, why, fn, x, w):
    monkeypatch.setattr(mt, "serves_cublas", lambda index, m, n, k, **form: n != 64)
    gm = decomposed(fn, x, w)
    routing.Fusions()(gm.graph)
    assert torch.ops.mage_gen.linear.default in targets(gm), why


def test_the_fusions_key_inductors_cache_on_the_tuned_gemm_entries_they_read(monkeypatch, tmp_path):
    """A compiled graph's fusions follow which products cuBLAS serves, read from tuned/: a tune that changes a gemm
    entry must change the pass's key, or Inductor would reuse a graph fused by the old answer."""
    monkeypatch.setenv("MAGE_GEN_TUNED", str(tmp_path))
    (tmp_path / "h200").mkdir()
    keys = []
    for text in ('{"entries": {}}', '{"entries": {"m=16": {}}}'):
        (tmp_path / "h200" / "gemm_sm90.json").write_text(text)
        keys.append(routing.Fusions().uuid())
        (tmp_path / "h200" / "rmsnorm.json").write_text(text + " ")  # another op's file: not read by the fusions
        assert routing.Fusions().uuid() == keys[-1]
    assert keys[0] != keys[1]
