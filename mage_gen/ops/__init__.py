"""The op families mage-gen can generate, by name."""

from mage_gen.errors import ConfigError
from mage_gen.ops import gemm_sm90, layernorm, matmul, matmul_tc, rmsnorm
from mage_gen.ops.base import Arg, Launch, Op

OPS: dict[str, Op] = {op.name: op for op in (layernorm.OP, rmsnorm.OP, matmul.OP, matmul_tc.OP, gemm_sm90.OP)}


def get_op(name: str) -> Op:
    try:
        return OPS[name]
    except KeyError:
        raise ConfigError(f"op: unknown op {name!r}; known: {', '.join(sorted(OPS))}") from None


__all__ = ["Arg", "Launch", "Op", "OPS", "get_op"]
