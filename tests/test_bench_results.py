"""What the benches write and conclude, on a stand-in GPU: bench/gemm_llm.py's sweep file when a run is cut short,
bench/decoder_layer.py's verdict."""

import json

import pytest

from bench import decoder_layer, gemm_llm
from mage_gen.errors import StoreError


class StandInDevice:
    name = "Stand-in GPU"
    l2_bytes = 50 << 20

    def to_dict(self) -> dict:
        return {"name": self.name}


def measured_row(layer: str, m: int, n: int, k: int, ratio: float) -> dict:
    return {"model": "8b", "layer": layer, "m": m, "n": n, "k": k, "chosen": "tuned", "params": {}, "source_hash": "x",
            "timings": {}, "measured": "earlier", "hot_launches_per_graph": 20,
            "time_over_cublas_by_round": {"hot": {"mage-gen": {"median": ratio}},
                                          "cold": {"mage-gen": {"median": ratio}}}}


def test_a_sweep_stopped_by_a_shape_nothing_serves_exits_2_and_keeps_the_earlier_rows_of_the_shapes_after_it(
        tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    device = StandInDevice()
    monkeypatch.setattr(gemm_llm.gpu, "open_device", lambda: device)
    monkeypatch.setattr(gemm_llm, "provenance", lambda d: {"gpu": d.to_dict(), "date": "now"})
    earlier = {"gpu": device.to_dict(), "precision": "bf16",
               "shapes": [measured_row("gate_up", 16, 28672, 4096, 0.9), measured_row("down", 16, 4096, 14336, 1.1)]}
    out = tmp_path / "bench/results/stand-in-gpu/gemm_llm.json"
    out.parent.mkdir(parents=True)
    out.write_text(json.dumps(earlier))

    def product_params(op, shape, device, tune_missing, untuned, tune_flags, classes):
        if shape.n == 4096 and shape.k == 4096:  # o: the second shape of the sweep
            raise StoreError("nothing tuned serves it; tune it: mage-gen tune gemm_sm90 --m 16 --n 4096 --k 4096")
        return op.params_from_dict(op.defaults(shape)), "tuned"

    monkeypatch.setattr(gemm_llm, "product_params", product_params)
    monkeypatch.setattr(gemm_llm, "bench_one", lambda op, shape, params, chosen, device: {
        **measured_row("qkv", shape.m, shape.n, shape.k, 0.8), "measured": None})
    monkeypatch.setattr("sys.argv", ["gemm_llm", "--model", "8b", "--m", "16", "--resume"])
    with pytest.raises(SystemExit) as stopped:
        gemm_llm.main()
    assert stopped.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: 8b o 16x4096x4096: nothing tuned serves it")
    doc = json.loads(out.read_text())
    assert [(r["layer"], r["measured"]) for r in doc["shapes"]] == [
        ("qkv", "now"), ("gate_up", "earlier"), ("down", "earlier")]
    assert doc["summary"]["complete"] is False


def test_resume_keeps_a_row_timed_in_the_order_the_method_takes_now_and_times_again_one_that_was_not(
        tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    device = StandInDevice()
    monkeypatch.setattr(gemm_llm.gpu, "open_device", lambda: device)
    monkeypatch.setattr(gemm_llm, "provenance", lambda d: {"gpu": d.to_dict(), "date": "now"})
    op = gemm_llm.get_op("gemm_sm90")

    def stored(layer: str, n: int, k: int, **order) -> dict:
        shape = op.shape(m=16, n=n, k=k)
        params = op.params_from_dict(op.defaults(shape))
        return {**measured_row(layer, 16, n, k, 0.9), "params": op.params_to_dict(params),
                "source_hash": op.source(shape, params).source_hash, **order}

    earlier = {"gpu": device.to_dict(), "precision": "bf16",
               "shapes": [stored("qkv", 6144, 4096, round_order="alternating"), stored("o", 4096, 4096)]}
    out = tmp_path / "bench/results/stand-in-gpu/gemm_llm.json"
    out.parent.mkdir(parents=True)
    out.write_text(json.dumps(earlier))
    monkeypatch.setattr(gemm_llm, "product_params", lambda op, shape, *args: (
        op.params_from_dict(op.defaults(shape)), "tuned"))
    timed = []

    def bench_one(op, shape, params, chosen, device):
        timed.append((shape.n, shape.k))
        row = measured_row("", shape.m, shape.n, shape.k, 0.8)
        return {**{key: row[key] for key in row if key not in ("model", "layer")}, "round_order": "alternating"}

    monkeypatch.setattr(gemm_llm, "bench_one", bench_one)
    monkeypatch.setattr("sys.argv", ["gemm_llm", "--model", "8b", "--m", "16", "--resume"])
    gemm_llm.main()
    assert timed == [(4096, 4096), (28672, 4096), (4096, 14336)]  # o's row, from the fixed order, timed again
    doc = json.loads(out.read_text())
    assert [(r["layer"], r["measured"]) for r in doc["shapes"]] == [
        ("qkv", "earlier"), ("o", "now"), ("gate_up", "now"), ("down", "now")]


def test_the_decoder_layer_s_verdict_takes_the_patched_layer_in_its_faster_mode():
    def ratio(median: float, low: float, high: float) -> dict:
        return {"median": median, "low": low, "high": high}

    faster_default = {"best": "compile", "best patched": "mage-gen patched, compile",
                      "mage-gen patched, compile": ratio(0.965, 0.96, 0.97),
                      "mage-gen patched, compile-max-autotune": ratio(1.01, 1.0, 1.02)}
    faster_autotuned = {**faster_default, "best patched": "mage-gen patched, compile-max-autotune"}
    kept = {"best": "compile", "mage-gen patched, compile-max-autotune": ratio(0.96, 0.95, 0.97)}
    rows = [{"tokens": 2048, "over_best_compile": {"hot": faster_default}},
            {"tokens": 16384, "over_best_compile": {"hot": faster_autotuned}},
            {"tokens": 8192, "over_best_compile": {"hot": kept}},
            {"tokens": 128, "over_best_compile": {"hot": faster_autotuned}}]
    assert decoder_layer.verdict(rows) == {2048: True, 16384: False, 8192: True, 128: True}


def test_a_tune_that_fails_under_tune_missing_stops_the_sweep_with_one_line(tmp_path, monkeypatch, capsys):
    import subprocess

    from bench import _common

    monkeypatch.chdir(tmp_path)
    device = StandInDevice()
    monkeypatch.setattr(gemm_llm.gpu, "open_device", lambda: device)
    monkeypatch.setattr(gemm_llm, "provenance", lambda d: {"gpu": d.to_dict(), "date": "now"})

    def nothing_stored(*args, **kwargs):
        raise StoreError("no entry")

    monkeypatch.setattr(_common, "load_winner", nothing_stored)
    monkeypatch.setattr(_common.subprocess, "run", lambda args, **kwargs: subprocess.CompletedProcess(args, 2))
    monkeypatch.setattr("sys.argv", ["gemm_llm", "--model", "8b", "--m", "16", "--tune-missing"])
    with pytest.raises(SystemExit) as stopped:
        gemm_llm.main()
    assert stopped.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: 8b qkv 16x6144x4096: mage-gen tune gemm_sm90 --m 16 --n 6144 "
                                               "--k 4096 --precision bf16") and "failed (exit 2)" in err[0]


def test_the_decoder_layer_records_who_computes_each_product_in_each_form_it_may_be_fused_in(monkeypatch):
    asked = []

    def serves_cublas(index, m, n, k, gate="none", bias=False, residual=False):
        asked.append((index, m, n, k, gate, bias, residual))
        return residual or n == 128  # cuBLAS: every residual form, and qkv (8 heads of 16)

    monkeypatch.setattr(decoder_layer.mt, "serves_cublas", serves_cublas)
    layer = decoder_layer.LlamaLayer(d=64, heads=4, kv_heads=2, hidden=128)
    assert decoder_layer.products(layer, 2048, device=1) == {
        "qkv": {"plain": "cublas"},
        "o": {"plain": "mage-gen", "residual": "cublas"},
        "gate_up": {"plain": "mage-gen", "gate=silu": "mage-gen"},
        "down": {"plain": "mage-gen", "residual": "cublas"}}
    assert (1, 2048, 256, 64, "silu", False, False) in asked and (1, 2048, 64, 128, "none", False, True) in asked
    block = decoder_layer.Gpt2Block(d=64, heads=4)
    assert decoder_layer.products(block, 128)["proj"] == {"plain": "mage-gen", "residual": "cublas"}
    assert asked[-1][5] is True  # GPT-2's linears have biases


class MeteredSubject:
    """A subject whose every launch takes `us` and draws `mj` from the meter, its hot() logged in `calls`."""

    def __init__(self, name: str, us: float, mj: float, meter: "CountingMeter", calls: list):
        self.name, self.us, self.mj, self.meter, self.calls = name, us, mj, meter, calls

    def hot(self, replays: int, launches: int = 20) -> list[float]:
        self.calls.append((self.name, replays))
        self.meter.drawn += (replays + 1) * launches * self.mj  # a warm-up replay before the timed ones
        return [self.us * 1.1] * (replays // 4) + [self.us] * (replays - replays // 4)


class CountingMeter:
    drawn = 0.0

    def energy_mj(self) -> float:
        return self.drawn


def test_sustained_windows_give_each_subject_its_energy_per_launch_and_alternate_the_order():
    from bench import _power

    meter, calls = CountingMeter(), []
    ours = MeteredSubject("mage-gen", us=100.0, mj=3.0, meter=meter, calls=calls)
    cublas = MeteredSubject("cublas", us=125.0, mj=2.0, meter=meter, calls=calls)
    taken = _power.sustained_rounds([ours, cublas], rounds=2, seconds=0.1, launches=4, meter=meter)
    timed = [name for name, replays in calls if replays != 3]  # the short replays that size the windows aside
    assert timed == ["mage-gen", "cublas", "cublas", "mage-gen"]
    assert [replays for name, replays in calls if replays != 3] == [250, 200, 200, 250]  # 0.1 s of 4 launches
    table = _power.summary(taken, [("cublas", 1500, 690.0, 0x4), ("cublas", 1700, 650.0, 0)], "cublas")
    assert table["mage-gen"]["mj_per_launch"] == pytest.approx(3.0)
    assert table["mage-gen"]["settled_us"] == 100.0 and table["mage-gen"]["first_us"] == pytest.approx(110.0)
    assert table["mage-gen"]["over_reference"] == pytest.approx({"settled_us": 0.8, "mj_per_launch": 1.5})
    assert table["cublas"]["sm_mhz"] == {"median": 1600, "min": 1500, "max": 1700}
    assert table["cublas"]["share_of_readings_power_capped"] == 0.5 and "readings" not in table["mage-gen"]


def test_clock_reasons_name_the_bits_nvml_sets_and_keep_the_rest_as_hex():
    from bench._power import clock_reasons

    assert clock_reasons(0x4 | 0x40) == ["sw_power_cap", "hw_thermal"]
    assert clock_reasons(0x1000 | 0x1) == ["gpu_idle", "0x1000"]
