"""Where trial measurements come from: the GPU, or a file recorded on one (for tests on the CPU)."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Protocol

from mage_gen.errors import MageError
from mage_gen.measure import Bench, Evaluation, common_to_every_placement, interleave_rounds, pool_rounds
from mage_gen.verdict import GateResult
from mage_gen.ops import Op
from mage_gen.timing import Timing

FINAL_PLACEMENTS = 4  # of the inputs and outputs (measure.Placement); each round at the next
# Eight rounds: each placement twice, and a paired-ratio interval (timing.median_interval) that covers the median
# at least 95% (four rounds cover 87.5%).
FINAL_ROUNDS = 8
FINAL_PER_ROUND = 4


Progress = Callable[[int, int], None]
# the final round's steps: the finalists gated, the peers built and gated at each placement, the hot rounds, the
# cold rounds
FINAL_STEPS = 1 + FINAL_PLACEMENTS + 2


class Backend(Protocol):
    device: dict[str, Any]  # name, cc, sms, l2_bytes, driver
    arch: str

    def evaluate(self, variant: Any) -> Evaluation: ...

    def close(self) -> None: ...

    def final(self, variants: Sequence[Any], progress: Progress | None = None
              ) -> tuple[dict[str, dict[str, Timing]], dict[str, dict[str, Any]], dict[str, str]]:
        """Re-gate the finalists and time them interleaved with the peers, hot and cold; progress(done, total) is
        told of each step. Returns ({kernel or peer name: {'hot': Timing, 'cold': Timing}}, {peer: config},
        {name: why dropped}); where every finalist was timed in the same interleaved rounds, each name's entry also
        holds 'rounds': {'hot': [its samples in round r, ...], 'cold': [...]}, for comparisons by paired rounds."""
        ...


class GpuBackend:
    def __init__(self, op: Op, shape: Any, run: dict[str, int], seed: int | None = None):
        self.op, self.shape, self.run = op, shape, run
        self.bench = Bench(op, shape, run, seed)
        self.device = self.bench.device.to_dict()
        self.arch = self.bench.device.arch

    def evaluate(self, variant: Any) -> Evaluation:
        return self.bench.evaluate(variant)

    def close(self) -> None:
        pass  # the context is the process's; it goes with it

    def final(self, variants, progress=None):
        from mage_gen.peers import make_peers  # torch and Triton: imported where peers are timed, not before

        step = _stepper(progress)
        placed: list[list[Any]] = []
        loaded, kernels, opened, dropped = [], [], [], {}
        try:
            for v in variants:
                kernel = self.bench.load(v)
                kernels.append(kernel)
                # every finalist and peer reads one copy of the inputs and writes one set of outputs, at each of
                # the placements in turn: the same bytes read or written at other addresses can take a few
                # percent more or less, and at one placement favour one finalist, at another another
                subject, result = self.bench.checked_subject(v, kernel, placement=0)
                if subject is not None:
                    opened.append(subject)
                    loaded.append((v, kernel, [subject]))
                else:
                    dropped[v.source.kernel_name] = result.reason
            step()
            if not loaded:  # nothing left to compare the peers with
                return {}, {}, dropped
            inputs = self.bench.timing_inputs()  # the finalists' own, judged against the reference on the GPU
            peer_configs: dict[str, list[dict[str, Any]]] = {}
            for p in range(FINAL_PLACEMENTS):
                group = []
                for entry in list(loaded):
                    v, kernel, at = entry
                    if p:
                        subject, _, reason = self.bench.checked_at(v, kernel, placement=p)
                        if subject is None:  # timed nowhere: common_to_every_placement leaves it out
                            dropped[v.source.kernel_name] = f"placement {p}: {reason}"
                            loaded.remove(entry)
                            continue
                        opened.append(subject)
                        at.append(subject)
                    group.append(at[p])
                place = self.bench.placement(p)
                peers, missing = make_peers(self.op, self.shape, self.run, inputs, None, check=self.bench.check_tensor,
                                            device_inputs=place.input_pointers(),
                                            device_outputs=place.output_pointers())
                dropped.update(missing)
                opened.extend(peers)
                for peer in peers:
                    peer_configs.setdefault(peer.name, []).append(peer.config)
                placed.append([*group, *peers])
                step()
            placed, _ = common_to_every_placement(placed)
            taken = {}
            for method in ("hot", "cold"):
                taken[method] = interleave_rounds(placed, method, FINAL_ROUNDS, FINAL_PER_ROUND)
                step()
            hot, _ = pool_rounds(taken["hot"], "hot", len(placed))
            cold, _ = pool_rounds(taken["cold"], "cold", len(placed))
            changed = self.bench.inputs_changed()
            if changed:
                raise MageError(f"tune: after the final round the shared inputs {', '.join(changed)} no longer hold "
                                "what was uploaded: a finalist or peer writes into its inputs; the trials are kept, "
                                "rerun with a preset that leaves that config out")
            timings = {name: {"hot": hot[name], "cold": cold[name],
                              "rounds": {method: [r[name] for r in taken[method]] for method in taken}}
                       for name in hot}
            # a peer's config as picked at the first placement; Triton's num_warps is picked again at each
            configs = {name: {**c[0], "at the other placements": c[1:]} for name, c in peer_configs.items()
                       if name in hot}
            return timings, configs, dropped
        finally:
            for subject in opened:
                subject.close()
            for k in kernels:
                k.unload()
            self.bench.free_placements()


def _stepper(progress: Progress | None) -> Callable[[], None]:
    """A step counter of the final round: tells progress of 0 at once, then of each step as it ends."""
    done = 0

    def step() -> None:
        nonlocal done
        done += 1
        if progress:
            progress(done, FINAL_STEPS)
    if progress:
        progress(0, FINAL_STEPS)
    return step


class ReplayBackend:
    """Answers from a bench/probes/layernorm_trials.py recording: the tuner's logic tested without a GPU."""

    def __init__(self, path: Path):
        remedy = "give a recording written by bench/probes/layernorm_trials.py"
        try:
            self.path = Path(path)
            self.recording = json.loads(self.path.read_text())
            self.device = self.recording["gpu"]
            self.arch = "sm_" + self.device["cc"].replace(".", "")
            self._by_kernel = {r["kernel"]: r for r in self.recording["variants"]}
        except OSError as exc:
            raise MageError(f"replay: cannot read {path}: {exc.strerror or exc}; {remedy}") from None
        except (ValueError, KeyError, TypeError, AttributeError) as exc:  # not JSON, or not shaped like one
            why = f"no {exc} key" if isinstance(exc, KeyError) else " ".join(str(exc).split())
            raise MageError(f"replay: {path} is not a recording ({why}); {remedy}") from None
        self.evaluated: list[str] = []  # what was measured, in order: tests assert on it

    def close(self) -> None:
        pass

    def _record(self, variant: Any) -> dict:
        try:
            return self._by_kernel[variant.source.kernel_name]
        except KeyError:
            raise KeyError(f"{variant.source.kernel_name} is not in the recording") from None

    def evaluate(self, variant: Any) -> Evaluation:
        self.evaluated.append(variant.source.kernel_name)
        # the time a measurement takes, where a test needs a worker to be caught mid-trial
        time.sleep(float(os.environ.get("MAGE_GEN_REPLAY_SECONDS", "0")))
        if variant.source.kernel_name not in self._by_kernel:
            # A config the recording never measured (the space grew since): a failed trial, not a guess.
            return Evaluation(GateResult(False, "replay: the recording has no measurement of this variant",
                                         float("inf")))
        r = self._record(variant)
        g = r["gate"]
        return Evaluation(GateResult(g["passed"], g["reason"], g["worst_error"]),
                          Timing.from_dict(r["hot"]) if r["hot"] else None,
                          Timing.from_dict(r["cold"]) if r["cold"] else None)

    def final(self, variants, progress=None):
        if progress:  # a recording answers every step at once
            progress(0, FINAL_STEPS)
            progress(FINAL_STEPS, FINAL_STEPS)
        timings, dropped = {}, {}
        for v in variants:
            r = self._record(v)
            if r["hot"]:
                timings[r["kernel"]] = {"hot": Timing.from_dict(r["hot"]), "cold": Timing.from_dict(r["cold"]),
                                        **({"rounds": r["rounds"]} if "rounds" in r else {})}
            else:
                dropped[r["kernel"]] = r["gate"]["reason"]
        peers = self.recording.get("peers", {})
        for name, p in peers.items():
            timings[name] = {"hot": Timing.from_dict(p["hot"]), "cold": Timing.from_dict(p["cold"]),
                             **({"rounds": p["rounds"]} if "rounds" in p else {})}
        return timings, {name: p.get("config", {}) for name, p in peers.items()}, dropped
