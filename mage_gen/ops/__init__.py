"""The op families mage-gen can generate, by name."""

from importlib import import_module

from mage_gen.errors import ConfigError
from mage_gen.ops.base import Arg, Launch, Op

# The module of mage_gen/ops/ that defines each op family as OP, in the order the command line lists what they take
FAMILIES = ("layernorm", "rmsnorm", "matmul", "matmul_tc", "gemm_sm90")
OPS: dict[str, Op] = {op.name: op for op in (import_module(f"mage_gen.ops.{family}").OP for family in FAMILIES)}


def get_op(name: str) -> Op:
    try:
        return OPS[name]
    except KeyError:
        raise ConfigError(f"op: unknown op {name!r}; known: {', '.join(sorted(OPS))}") from None


__all__ = ["Arg", "Launch", "Op", "OPS", "get_op"]
