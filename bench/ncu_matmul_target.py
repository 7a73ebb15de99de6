"""The program bench/ncu_matmul.sh profiles: one matmul config (params as JSON) built at M,N,K, gated and
timed once (so launched a few times); or, with `cublas` in place of the JSON, torch.matmul with TF32 off."""
import json, sys
from mage_gen import gpu
from mage_gen.measure import Bench
from mage_gen.ops import get_op
from mage_gen.variants import build
op = get_op("matmul")
m, n, k = map(int, sys.argv[1].split(","))
shape = op.shape(m=m, n=n, k=k)
if sys.argv[2] == "cublas":
    import torch
    torch.backends.cuda.matmul.allow_tf32 = False
    a = torch.randn(m, k, device="cuda"); b = torch.randn(k, n, device="cuda")
    for _ in range(5): c = a @ b
    torch.cuda.synchronize(); sys.exit(0)
dev = gpu.open_device()
params = op.params_from_dict(json.loads(sys.argv[2]))
v = build(op, shape, params, dev.arch)
bench = Bench(op, shape, {}, seed=1)
ev = bench.evaluate(v, hot_replays=1, cold_count=1)
print(params.label(), v.census.registers, ev.gate.passed, ev.hot.median_us if ev.hot else None)
