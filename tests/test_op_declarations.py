"""What each op declares for the code that serves every op (peers, runtime defaults, the torch ops, the store, the
command line's help), and that this code asks the op rather than a table of op names."""

import inspect
import re
import subprocess
import sys
from pathlib import Path

import pytest

from mage_gen import runtime
from mage_gen.errors import ConfigError
from mage_gen.ops import FAMILIES, OPS, get_op
from mage_gen.ops.base import LazyFunction, OpFamily, Rule, check_rules
from mage_gen.space import Tally, expand, load_space, rejection, tally, valid_params

ROOT = Path(__file__).resolve().parent.parent
# A shape each op is typically asked for
TYPICAL = {"layernorm": [{"d": 768}, {"d": 4096, "dtype": "bfloat16"},
                         {"d": 8192, "dtype": "bfloat16", "residual": True}],
           "rmsnorm": [{"d": 768}, {"d": 4096, "dtype": "bfloat16"}, {"d": 8192, "dtype": "float16", "residual": True}],
           "matmul": [{"m": 1024, "n": 1024, "k": 1024}, {"m": 1000, "n": 999, "k": 998}],
           "matmul_tc": [{"m": 1024, "n": 1024, "k": 1024, "precision": p} for p in ("bf16", "tf32", "fp32x3")],
           "gemm_sm90": [{"m": 4096, "n": 4096, "k": 4096}, {"m": 1000, "n": 1001, "k": 999, "b_layout": "kn"}]}


def test_every_registered_op_is_its_modules_op_and_has_typical_shapes_here():
    assert list(OPS) == [__import__(f"mage_gen.ops.{family}", fromlist=["OP"]).OP.name for family in FAMILIES]
    assert set(TYPICAL) == set(OPS)
    for op in OPS.values():
        assert isinstance(op, OpFamily), op.name


@pytest.mark.parametrize("name", list(OPS))
def test_an_op_declares_a_torch_name_of_mage_gen_torch_or_none(name):
    op = get_op(name)
    assert op.torch_name is None or re.fullmatch(r"mage_gen\.torch\.[a-z_]+", op.torch_name), op.torch_name
    if op.torch_name is not None:
        torch_ops = pytest.importorskip("mage_gen.torch")
        assert callable(getattr(torch_ops, op.torch_name.rpartition(".")[2]))


def test_the_torch_names_are_the_public_functions_of_mage_gen_torch():
    assert {op.name: op.torch_name for op in OPS.values() if op.torch_name} == {
        "layernorm": "mage_gen.torch.layer_norm", "rmsnorm": "mage_gen.torch.rms_norm",
        "matmul": "mage_gen.torch.matmul", "gemm_sm90": "mage_gen.torch.linear"}


@pytest.mark.parametrize("name", list(OPS))
def test_the_default_candidates_are_params_the_op_knows_and_one_is_valid_for_each_typical_shape(name):
    op = get_op(name)
    assert op.default_candidates, "an empty tuple leaves the runtime nothing to run"
    for dims in TYPICAL[name]:
        shape = op.shape(**dims)
        for values in op.default_candidates:
            op.params_from_dict({**op.defaults(shape), **values})  # names only fields of the op's Params
        params = runtime._default_params(op, shape)
        op.validate(shape, params)
        first = next(values for values in op.default_candidates if _valid(op, shape, values))
        assert params == op.params_from_dict({**op.defaults(shape), **first})  # the first valid one, in order


def _valid(op, shape, values) -> bool:
    try:
        op.validate(shape, op.params_from_dict({**op.defaults(shape), **values}))
    except ConfigError:
        return False
    return True


def test_the_runtime_defaults_are_read_from_the_ops():
    assert dict(runtime.DEFAULT_CANDIDATES) == {name: op.default_candidates for name, op in OPS.items()}
    with pytest.raises(TypeError):
        runtime.DEFAULT_CANDIDATES["layernorm"] = ()


def test_a_norm_without_a_tuned_entry_runs_a_row_at_16_bytes_and_a_long_row_template_wide():
    ln = get_op("layernorm")
    assert ln.params_to_dict(runtime._default_params(ln, ln.shape(d=768))) == ln.params_to_dict(
        ln.params_from_dict({"template": "row", "threads": 128, "vector": 16}))
    assert runtime._default_params(ln, ln.shape(d=1 << 20)).template == "wide"


@pytest.mark.parametrize("name", [name for name, op in OPS.items() if op.peer_builder is not None])
def test_a_peer_builder_resolves_to_a_function_that_takes_what_make_peers_passes(name):
    pytest.importorskip("torch")
    op = get_op(name)
    assert isinstance(op.peer_builder, LazyFunction) and op.peer_builder.module == "mage_gen.peers"
    builder = op.peer_builder.resolve()
    assert callable(builder)
    inspect.signature(builder).bind("shape", {}, 1e-5, False, lambda n, d: None, lambda *a: None)


@pytest.mark.parametrize("name", [name for name, op in OPS.items() if op.device_case is not None])
def test_a_device_case_resolves_to_a_function_that_takes_what_the_gate_passes(name):
    pytest.importorskip("torch")
    op = get_op(name)
    assert isinstance(op.device_case, LazyFunction) and op.device_case.module == "mage_gen.device_cases"
    inspect.signature(op.device_case.resolve()).bind("shape", {}, 7, "cuda")


def test_every_op_has_peers_and_the_norms_name_their_own_torch_function_and_triton_kernel():
    assert all(op.peer_builder is not None for op in OPS.values())
    bound = {name: dict(OPS[name].peer_builder.bound) for name in ("layernorm", "rmsnorm")}
    assert bound == {"layernorm": {"torch_fn": "F.layer_norm", "triton_kernel": "triton_layernorm"},
                     "rmsnorm": {"torch_fn": "F.rms_norm", "triton_kernel": "triton_rmsnorm"}}


def test_the_norms_triton_kernels_are_in_the_peers_where_triton_is():
    pytest.importorskip("triton")
    import mage_gen.peers as peers

    for op in OPS.values():
        kernel = dict(op.peer_builder.bound).get("triton_kernel")
        assert kernel is None or hasattr(peers, kernel), (op.name, kernel)


def test_an_op_without_a_peer_builder_has_no_peers():
    class Bare(OpFamily):
        name = "bare"

    assert Bare().peers(None, {}, 0.0, False, lambda n, d: None, lambda *a: None) == {}


def test_a_lazy_function_imports_its_module_only_when_resolved_and_binds_its_arguments():
    code = ("import sys; from mage_gen.ops.base import LazyFunction; "
            "f = LazyFunction('mage_gen.ops.base', 'shape_dict'); assert f.resolve().__name__ == 'shape_dict'; "
            "g = LazyFunction('wave', 'open', (('mode', 'rb'),)); print('wave' in sys.modules); "
            "print(g.resolve().keywords, 'wave' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split("\n")[:2] == ["False", "{'mode': 'rb'} True"]


def test_importing_the_ops_imports_neither_torch_nor_triton_nor_the_peers():
    code = ("import sys, mage_gen.ops; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'triton', 'optuna') "
            "or m in ('mage_gen.peers', 'mage_gen.gpu', 'mage_gen.measure')))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


@pytest.mark.parametrize("name", list(OPS))
def test_an_op_declares_a_function_of_mage_gen_runtime_or_none(name):
    op = get_op(name)
    assert op.runtime_name is None or re.fullmatch(r"mage_gen\.runtime\.[a-z_]+", op.runtime_name), op.runtime_name
    if op.runtime_name is not None:
        assert callable(getattr(runtime, op.runtime_name.rpartition(".")[2]))


def test_the_runtime_names_are_the_public_launch_functions_of_mage_gen_runtime():
    assert {op.name: op.runtime_name for op in OPS.values() if op.runtime_name} == {
        "layernorm": "mage_gen.runtime.layer_norm", "rmsnorm": "mage_gen.runtime.rms_norm",
        "matmul": "mage_gen.runtime.matmul", "gemm_sm90": "mage_gen.runtime.gemm"}


def test_no_module_outside_the_ops_names_an_op_that_has_no_public_function():
    """An op is added in its own module (and templates and search space) and registered in FAMILIES; the generic
    modules ask it what they need. The ops with functions of their own in mage_gen.runtime and mage_gen.torch are
    named there, by those functions."""
    unnamed = [op.name for op in OPS.values() if op.torch_name is None and op.runtime_name is None]
    assert unnamed
    for path in sorted((ROOT / "mage_gen").rglob("*.py")):
        if path.parent.name == "ops":
            continue
        text = path.read_text()
        for name in unnamed:
            assert not re.search(rf"\b{name}\b", text), f"{path.relative_to(ROOT)} names {name}"


def test_the_command_lines_size_options_say_what_each_op_takes_them_for():
    from mage_gen.cli import _field_help

    assert _field_help("d") == "layernorm, rmsnorm: row length"
    assert _field_help("precision").startswith("matmul_tc: bf16, tf32 or fp32x3")
    assert "gemm_sm90: bf16" in _field_help("precision")
    assert _field_help("m").startswith("layernorm, rmsnorm: rows at launch (default 4096); matmul, matmul_tc")


def test_a_format_2_entry_keeps_the_params_of_an_op_whose_params_did_not_change():
    matmul = get_op("matmul")
    params = {"bm": 64, "a_width": 4}
    assert matmul.params_from_format_2(params, {"m": 8, "n": 8, "k": 8}) is params
    ln = get_op("layernorm")
    assert ln.params_from_format_2({"vector": 4}, {"d": 768}) == {"vector": 16}
    assert ln.params_from_format_2({"vector": 8}, {"d": 768, "dtype": "bfloat16"}) == {"vector": 16}
    assert ln.params_from_format_2({"threads": 128}, {"d": 768}) == {"threads": 128}


def test_the_first_rule_a_config_breaks_is_the_one_reported():
    rules = (Rule("first", lambda s, p: p > 0, lambda s, p: f"{p} is not positive"),
             Rule("second", lambda s, p: p % 2 == 0, lambda s, p: f"{p} is odd"))
    check_rules(rules, None, 4)
    with pytest.raises(ConfigError, match=r"^first: -3 is not positive$"):
        check_rules(rules, None, -3)
    with pytest.raises(ConfigError, match=r"^second: 3 is odd$"):
        check_rules(rules, None, 3)


@pytest.mark.parametrize("name, values, says", [
    ("layernorm", {"template": "bogus", "threads": 33}, "template: unknown layernorm template 'bogus'"),
    ("layernorm", {"threads": 33, "vector": 2}, "threads-multiple-of-32"),
    ("layernorm", {"vector": 2, "rsqrt": "fast"}, "vector-width: vector is the bytes of one access"),
    ("rmsnorm", {"stats": "one_pass", "template": "bogus"}, "stats: rmsnorm has one statistic"),
    ("rmsnorm", {"template": "bogus"}, "template: unknown layernorm template 'bogus'"),
    ("matmul", {"bm": 0, "tm": 3}, "tile: bm must be a positive whole number, got 0"),
    ("matmul", {"tm": 3, "lanes_m": 3}, "thread-tile"),
    ("matmul", {"plant": "bogus", "buffers": 9}, "buffers: 1 to 4 shared-memory stages, got 9"),
    ("matmul_tc", {"warps_m": True}, "tile: warps_m must be a positive whole number, got True"),
    ("matmul_tc", {"pad_a": -1, "bk": 20}, "pad: pad_a is a whole number of elements, got -1"),
    ("matmul_tc", {"prefetch": "next", "plant": "bogus"}, "prefetch: fragments loaded ahead go with one barrier"),
])
def test_each_ops_rules_report_the_earlier_of_two_broken_rules(name, values, says):
    op = get_op(name)
    shape = op.shape(**TYPICAL[name][0])
    params = op.params_type(**{**op.params_to_dict(op.params_from_dict(op.defaults(shape))), **values})
    with pytest.raises(ConfigError) as caught:
        op.validate(shape, params)
    assert str(caught.value).startswith(says), str(caught.value)


@pytest.mark.parametrize("name, dims, preset", [
    ("layernorm", {"d": 1000}, "long"),
    ("layernorm", {"d": 4096, "dtype": "bfloat16", "residual": True}, "short"),
    ("rmsnorm", {"d": 8192, "dtype": "bfloat16"}, "long"),
    ("matmul", {"m": 1000, "n": 1000, "k": 1000}, "explore"),
    ("matmul_tc", {"m": 64, "n": 64, "k": 64}, "quick"),
    ("gemm_sm90", {"m": 4096, "n": 4096, "k": 4096}, "quick"),
])
def test_expand_gives_what_validate_gives_config_by_config(name, dims, preset):
    # expand asks the rules of partial configs and rejects whole sub-products at once: the same lists, in the same
    # order, with the same first broken rule, as checking each combination; valid_params, the valid ones alone
    op = get_op(name)
    shape = op.shape(**dims)
    space = load_space(op, preset, shape, sms=132)
    for arch in (None, "sm_80"):
        each = [(p, rejection(op, shape, p, arch)) for p in map(op.params_from_dict, space.combinations())]
        valid, rejected = expand(op, shape, space, arch)
        assert valid == [p for p, reason in each if reason is None]
        assert valid or arch  # gemm_sm90's are sm_90 kernels
        assert rejected == [(p, reason) for p, reason in each if reason is not None]
        assert len({reason for _, reason in rejected}) > 5
        assert valid_params(op, shape, space, arch) == valid
        # tally: what a command says of the space, the rejections counted rather than made
        assert tally(op, shape, space, arch) == Tally(valid, len(rejected), rejected[0][1])


@pytest.mark.parametrize("name", ["layernorm", "rmsnorm"])
def test_a_row_norms_rules_are_data_whose_names_are_the_errors_prefixes(name):
    op = get_op(name)
    assert op.rules and all(isinstance(rule, Rule) for rule in op.rules)
    assert all(re.fullmatch(r"[a-z0-9]+(-[a-z0-9]+)*", rule.name) for rule in op.rules)
    shape = op.shape(d=768)
    for values in ({"threads": 48}, {"hold": "packed"}, {"template": "multirow", "rows_per_block": 1}):
        params = op.params_type(**{**op.params_to_dict(op.params_from_dict({})), **values})
        with pytest.raises(ConfigError) as caught:
            op.validate(shape, params)
        assert str(caught.value).split(":")[0] in {rule.name for rule in op.rules}

