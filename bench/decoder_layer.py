"""A transformer layer end to end, as a user would measure it: a Llama-3-8B decoder layer (d = 4096, 32 heads, 8 KV
heads, MLP 14336, RMSNorm, residual adds, SDPA for attention, rotary embeddings) or a GPT-2 block (d = 768, 12
heads, MLP 3072, layer norm, biases), bf16, forward only, at 128, 2048 and 16384 tokens (one causal sequence).
Five ways, each under CUDA graphs: eager torch, torch.compile in its two modes (default and
max-autotune-no-cudagraphs), and torch.compile in the same two modes of the same layer after mage_gen.torch.patch
(max-autotune tunes whatever GEMM patch left to torch, and Inductor's other kernels: it can be slower than the
default mode). Every output is first checked against the layer in float32 (relative norm ≤ TOLERANCE), then all five
are timed hot and cold in interleaved rounds; each way's time over the best compiled mode's is taken by paired
rounds, and the patched layer's figure is that of its faster mode (the best compiled mode of each layer against
the other's). Writes bench/results/<gpu>/decoder_layer.json, rewritten
after every token count.

    python -m bench.decoder_layer --model llama3-8b --tokens 2048
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import mage_gen.torch as mt
from mage_gen import gpu
from mage_gen.measure import interleave_rounds, launches_for, pool_rounds
from mage_gen.peers import TorchSubject
from mage_gen.timing import round_ratio

from bench import _power
from bench._common import earlier_result, provenance, timing_method, write_result

TOKENS = (128, 2048, 16384)
# a round of every way costs seconds beside their compiles' minutes, and the paired interval narrows with rounds: six
# left the patched layer's at 16384 tokens [0.862, 1.028] of the best compile's time (bench/NOTES.md, Hopper GEMM §12)
ROUNDS, PER_ROUND = 12, 3
SUSTAIN_ROUNDS = 4  # --sustain: five ways a round, each window about a second
# bf16 activations rounded at every op of a layer: a few units of bf16's roundoff (2^-8) in relative norm
TOLERANCE = 2 ** -6
# The figures: the patched, compiled layer against the best compiled mode of the same layer
FASTER_BY, AT_LEAST_TOKENS = 0.03, 2048
MODES = {"compile": "default", "compile-max-autotune": "max-autotune-no-cudagraphs"}
PATCHED = tuple(f"mage-gen patched, {way}" for way in MODES)
WAYS = ("eager", *MODES, *PATCHED)


# The fused forms of a linear the patched graph may run (mage_gen.patch's Fusions), as mage_gen.torch.linear takes them
FORM_ARGS = {"gate=silu": {"gate": "silu"}, "residual": {"residual": True}}


class LlamaLayer(nn.Module):
    FUSED_FORMS = {"o": ("residual",), "gate_up": ("gate=silu",), "down": ("residual",)}

    def __init__(self, d: int = 4096, heads: int = 32, kv_heads: int = 8, hidden: int = 14336, eps: float = 1e-5):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, d // heads
        self.input_norm, self.post_norm = nn.RMSNorm(d, eps=eps), nn.RMSNorm(d, eps=eps)
        self.qkv = nn.Linear(d, (heads + 2 * kv_heads) * self.head_dim, bias=False)
        self.o = nn.Linear(d, d, bias=False)
        self.gate_up = nn.Linear(d, 2 * hidden, bias=False)
        self.down = nn.Linear(hidden, d, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        hd = self.head_dim
        q, k, v = self.qkv(self.input_norm(x)).split([self.heads * hd, self.kv_heads * hd, self.kv_heads * hd], -1)
        q, k, v = (heads_first(u, hd) for u in (q, k, v))
        q, k = rotate(q, cos, sin), rotate(k, cos, sin)
        # each KV head repeated for its queries, as Hugging Face's Llama does
        k, v = (u.repeat_interleave(self.heads // self.kv_heads, dim=1) for u in (k, v))
        attn = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        h = x + self.o(tokens_first(attn))
        gate, up = self.gate_up(self.post_norm(h)).chunk(2, -1)
        return h + self.down(F.silu(gate) * up)


def heads_first(u: torch.Tensor, head_dim: int) -> torch.Tensor:
    """(tokens, heads · head_dim) as (1, heads, tokens, head_dim): SDPA's fused kernels (flash, memory-efficient)
    take only 4-D inputs; 3-D ones fall to its math path, which holds heads × tokens² scores in float32."""
    return u.view(1, u.shape[0], -1, head_dim).transpose(1, 2)


def tokens_first(u: torch.Tensor) -> torch.Tensor:
    """heads_first's inverse: (1, heads, tokens, head_dim) as (tokens, heads · head_dim)."""
    return u.transpose(1, 2).reshape(u.shape[2], -1)


def rotate(u: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    first, second = u.chunk(2, -1)
    return u * cos + torch.cat((-second, first), -1) * sin


class Gpt2Block(nn.Module):
    FUSED_FORMS = {"attn_out": ("residual",), "proj": ("residual",)}

    def __init__(self, d: int = 768, heads: int = 12):
        super().__init__()
        self.heads = heads
        self.ln_1, self.ln_2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.attn_in, self.attn_out = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.fc, self.proj = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        head_dim = x.shape[1] // self.heads
        q, k, v = (heads_first(u, head_dim) for u in self.attn_in(self.ln_1(x)).chunk(3, -1))
        attn = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        h = x + self.attn_out(tokens_first(attn))
        return h + self.proj(F.gelu(self.fc(self.ln_2(h)), approximate="tanh"))


MODELS = {"llama3-8b": (LlamaLayer, 4096, 128), "gpt2": (Gpt2Block, 768, 64)}


def inputs(d: int, head_dim: int, tokens: int, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    g = torch.Generator(device="cuda").manual_seed(tokens)
    x = torch.randn(tokens, d, device="cuda", generator=g)
    angles = torch.arange(tokens, device="cuda")[:, None] / 500000 ** (torch.arange(0, head_dim, 2, device="cuda") / head_dim)
    angles = torch.cat((angles, angles), -1)
    return x.to(dtype), angles.cos().to(dtype), angles.sin().to(dtype)


def products(layer: nn.Module, tokens: int, device: int = 0) -> dict[str, dict[str, str]]:
    """Who computes each linear's product at `tokens` in the patched layer, in each form the Fusions pass may give it:
    "cublas" or "mage-gen", by the rule that pass and the runtime read (dispatch.PEER_RULE on the serving entry)."""
    out = {}
    for name, module in layer.named_modules():
        if isinstance(module, nn.Linear):
            forms = {"plain": {}, **{form: FORM_ARGS[form] for form in layer.FUSED_FORMS.get(name, ())}}
            out[name] = {form: "cublas" if mt.serves_cublas(device, tokens, module.out_features, module.in_features,
                                                             bias=module.bias is not None, **args) else "mage-gen"
                         for form, args in forms.items()}
    return out


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float(torch.linalg.vector_norm(out.double() - ref.double()) / torch.linalg.vector_norm(ref.double()))


def make_ways(name: str, tokens: int) -> tuple[dict, tuple, torch.Tensor, Any]:
    """(each way's callable, the bf16 inputs, the float32 layer's output, what patch routed) at `tokens`."""
    make, d, head_dim = MODELS[name]
    torch.manual_seed(0)
    reference = make().cuda().eval()
    layer = copy.deepcopy(reference).to(torch.bfloat16)
    patched = [copy.deepcopy(layer) for _ in MODES]  # one each: a module compiled once per mode
    routes = [mt.patch(module) for module in patched][0]
    args = inputs(d, head_dim, tokens, torch.bfloat16)
    with torch.no_grad():
        expected = reference(*(a.float() for a in args))
    torch._dynamo.reset()
    compiled = [torch.compile(module, mode=mode) for modules in ([layer, copy.deepcopy(layer)], patched)
                for module, mode in zip(modules, MODES.values())]
    ways = dict(zip(WAYS, (layer, *compiled)))
    return ways, args, expected, routes


def bench_tokens(name: str, tokens: int, sustain: float = 0.0) -> dict:
    ways, args, expected, routes = make_ways(name, tokens)
    errors, subjects = {}, []
    with torch.inference_mode():
        for way, fn in ways.items():
            print(f"{name} {tokens}: {way}: compiling and checking", flush=True)
            errors[way] = relative_error(fn(*args), expected)
            subjects.append(TorchSubject(way, lambda fn=fn: fn(*args)))
        row = {"tokens": tokens, "routes": {"linear": routes.linear, "gated": routes.gated, "norm": routes.norm,
                                            "left": routes.left},
               "products": products(ways["eager"], tokens, torch.cuda.current_device()),
               "relative_error_vs_float32": errors, "tolerance": TOLERANCE, "timings": {}, "over_best_compile": {}}
        failed = [way for way, err in errors.items() if not err <= TOLERANCE]
        if failed:
            return {**row, "error": f"outputs outside the tolerance: {failed}; nothing timed"}
        try:
            row["hot_launches_per_graph"] = launches = launches_for(subjects)
            for method in ("hot", "cold"):
                taken = interleave_rounds([subjects], method, ROUNDS, PER_ROUND, launches)
                pooled, _ = pool_rounds(taken, method, 1)
                row["timings"][method] = {way: t.to_dict() for way, t in pooled.items()}
                best = min(MODES, key=lambda way: pooled[way].median_us)
                row["over_best_compile"][method] = {
                    "best": best, "best patched": min(PATCHED, key=lambda way: pooled[way].median_us),
                    **{way: round_ratio([r[way] for r in taken], [r[best] for r in taken]).to_dict()
                       for way in ways if way != best}}
            if sustain:
                row["sustained"] = _power.sustained(subjects, sustain, SUSTAIN_ROUNDS, launches,
                                                    row["over_best_compile"]["hot"]["best"], f"{name} {tokens}")
        finally:
            for subject in subjects:  # each way's graph and its memory pool, before the next token count's
                subject.close()
    return row


def verdict(rows: list[dict]) -> dict:
    """The issue's figures, hot (the layer replayed in a graph): at ≥ AT_LEAST_TOKENS tokens the patched layer in
    its faster mode at most (1 − FASTER_BY) of the best compiled mode's time, and below that never slower (its
    ratio's interval reaching 1 at most)."""
    out = {}
    for row in rows:
        hot = row.get("over_best_compile", {}).get("hot", {})
        ratio = hot.get(hot.get("best patched", PATCHED[-1]))  # a kept row from before both modes were timed
        if ratio is None:
            out[row["tokens"]] = "not measured" if "error" not in row else row["error"]
        elif row["tokens"] >= AT_LEAST_TOKENS:
            out[row["tokens"]] = ratio["median"] <= 1 - FASTER_BY
        else:
            out[row["tokens"]] = ratio["low"] <= 1
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=list(MODELS), default="llama3-8b")
    parser.add_argument("--tokens", type=int, action="append", help=f"default: {', '.join(map(str, TOKENS))}")
    parser.add_argument("--keep", action="store_true", help="keep the result file's rows at the token counts this run "
                                                            "does not measure (each row is its own run's comparison)")
    parser.add_argument("--sustain", type=float, default=0.0, metavar="SECONDS",
                        help=f"after the rounds, {SUSTAIN_ROUNDS} rounds of each way run back to back for this long, "
                             "with its energy per launch and clocks (NVML), against the faster compiled mode hot")
    args = parser.parse_args()
    if any(t < 1 for t in args.tokens or ()) or args.sustain < 0:
        parser.error("--tokens takes a positive count and --sustain seconds ≥ 0")
    device = gpu.open_device()
    name = f"decoder_layer_{args.model}.json"
    counts = args.tokens or TOKENS
    # a kept row carries the date of the run that measured it
    earlier = earlier_result(device, name) if args.keep else {}
    rows = [{"measured": earlier.get("date", "unknown"), **row} for row in earlier.get("rows", [])
            if row.get("tokens") not in counts]
    for tokens in counts:
        rows.append({**bench_tokens(args.model, tokens, args.sustain), "measured": provenance(device)["date"]})
        rows.sort(key=lambda row: row["tokens"])
        torch.cuda.empty_cache()
        doc = {"what": f"a {args.model} layer, bf16, forward, under CUDA graphs: eager, torch.compile (two modes) and "
                       "torch.compile after mage_gen.torch.patch, recorded by bench/decoder_layer.py",
               "method": {**timing_method(ROUNDS, PER_ROUND),
                          "check": f"each way's output against the layer in float32, relative norm ≤ {TOLERANCE}",
                          "ratio": "a way's time over the faster compiled mode's, by paired rounds"},
               **provenance(device), "model": args.model, "rows": rows,
               "targets met (hot)": verdict(rows) if args.model == "llama3-8b" else "the targets are Llama's"}
        out = write_result(device, name, json.dumps(doc, indent=1) + "\n")
        print(json.dumps({k: row[k] for row in rows if row["tokens"] == tokens
                          for k in ("tokens", "relative_error_vs_float32")}), flush=True)
    print(json.dumps(doc["targets met (hot)"], indent=1))
    print(f"wrote {out}", file=sys.stderr)


if __name__ == "__main__":
    main()
