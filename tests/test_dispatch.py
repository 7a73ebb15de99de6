"""Size classes: which tuned entry serves a launch, --m auto, nearest-shape lookup, and tuned/ keys."""

import json

import pytest

from mage_gen import dispatch
from mage_gen.ops import get_op
from mage_gen.store import entry_key, load_winner, load_winners, save_entry

LN, MM = get_op("layernorm"), get_op("matmul")
H200 = "NVIDIA H200"
L2 = 60 << 20
D768 = LN.shape(d=768)


def classes(*ms):
    return [dispatch.SizeClass(f"m={m}", {"m": m}) for m in ms]


@pytest.mark.parametrize("m, picked", [
    (1, 4096), (37, 4096), (512, 4096), (4096, 4096), (8192, 4096),  # x and y fit the L2: the L2 class
    (16384, 65536), (65536, 65536), (262144, 65536),  # DRAM-bound: the DRAM class, however near 4096 is
])
def test_a_launch_takes_the_class_on_its_side_of_the_l2(m, picked):
    assert dispatch.choose(LN, D768, {"m": m}, classes(4096, 65536), L2).run == {"m": picked}


def test_on_one_side_the_nearest_tuned_size_wins_on_a_log_scale():
    # 2048 is 2× from 1024 and 2× from 4096: a tie goes to the larger
    assert dispatch.choose(LN, D768, {"m": 2048}, classes(1024, 4096), L2).run == {"m": 4096}
    assert dispatch.choose(LN, D768, {"m": 1500}, classes(1024, 4096), L2).run == {"m": 1024}


def test_with_no_class_on_its_side_a_launch_takes_the_nearest_of_all():
    assert dispatch.choose(LN, D768, {"m": 262144}, classes(512, 4096), L2).run == {"m": 4096}
    assert dispatch.choose(LN, D768, {"m": 1}, classes(65536, 32768), L2).run == {"m": 32768}


def test_the_boundary_is_the_l2_size_read_from_the_caller():
    # 4096×768 moves 25 MB: L2-resident on a 60 MB L2, DRAM-bound on a 16 MB one
    assert dispatch.choose(LN, D768, {"m": 4096}, classes(1024, 65536), L2).run == {"m": 1024}
    assert dispatch.choose(LN, D768, {"m": 4096}, classes(1024, 65536), 16 << 20).run == {"m": 65536}


@pytest.mark.parametrize("d, l2, expected", [(768, L2, [4096, 65536]), (4096, L2, [512, 8192]),
                                             (768, 16 << 20, [1024, 16384])])
def test_auto_is_one_size_well_inside_the_l2_and_one_well_outside(d, l2, expected):
    shape = LN.shape(d=d)
    runs = dispatch.auto_runs(LN, shape, l2)
    assert [r["m"] for r in runs] == expected
    small, large = (LN.bytes_moved(shape, r) for r in runs)
    assert small <= dispatch.AUTO_L2_SHARE * l2 < LN.bytes_moved(shape, {"m": 2 * runs[0]["m"]})
    assert large >= dispatch.AUTO_DRAM_L2S * l2 > LN.bytes_moved(shape, {"m": runs[1]["m"] // 2})


def test_auto_is_refused_for_an_op_with_no_run_size():
    with pytest.raises(Exception, match="m-auto"):
        dispatch.auto_runs(MM, MM.shape(m=64, n=64, k=64), L2)


def test_nearest_shape_skips_params_invalid_for_the_shape_and_prefers_the_closest():
    default = MM.params_from_dict({})
    tuned = {MM.shape(m=1024, n=1024, k=1024): default, MM.shape(m=4096, n=4096, k=4096): default}
    other, params = dispatch.nearest_shape(MM, MM.shape(m=1000, n=1024, k=1024), tuned)
    assert vars(other) == {"m": 1024, "n": 1024, "k": 1024} and params == default
    # 16-byte B copies cannot serve N = 255: no tuned shape's params are valid there
    assert dispatch.nearest_shape(MM, MM.shape(m=128, n=255, k=64), tuned) is None


def test_entry_keys_carry_the_size_class_only_for_ops_sized_at_launch():
    assert entry_key(LN, D768, {"m": 65536}) == "d=768/float32/m=65536"
    assert entry_key(MM, MM.shape(m=8, n=16, k=32), {}) == "m=8,n=16,k=32/float32"


def store_two_classes(tmp_path, synthetic_entry):
    small = synthetic_entry(run={"m": 4096})
    large = synthetic_entry(params={"template": "row", "threads": 96, "vector": 8}, run={"m": 65536})
    save_entry("layernorm", H200, entry_key(LN, D768, {"m": 4096}), small, directory=tmp_path)
    save_entry("layernorm", H200, entry_key(LN, D768, {"m": 65536}), large, directory=tmp_path)


def test_winners_of_every_class_and_the_one_a_launch_takes(tmp_path, synthetic_entry):
    store_two_classes(tmp_path, synthetic_entry)
    winners = load_winners(LN, D768, H200, tmp_path)
    assert [w.run for w in winners] == [{"m": 4096}, {"m": 65536}]
    assert load_winner(LN, D768, H200, {"m": 37}, tmp_path).params.threads == 128
    assert load_winner(LN, D768, H200, {"m": 100000}, tmp_path).params.threads == 96
    # 12000 rows move 74 MB: DRAM-bound beside the 50 MiB L2 the entries record, L2-resident beside 1 GiB,
    # where the nearer tuned size (4096) takes it
    assert load_winner(LN, D768, H200, {"m": 12000}, tmp_path).params.threads == 96
    assert load_winner(LN, D768, H200, {"m": 12000}, tmp_path, l2_bytes=1 << 30).params.threads == 128


def older(entry: dict, elements: int) -> dict:
    """An entry as formats 1 and 2 wrote it: a norm's vector counted elements."""
    return {**entry, "params": {**entry["params"], "vector": elements}}


def test_a_format_1_file_is_read_with_size_classes_and_rewritten_as_format_3(tmp_path, synthetic_entry):
    path = tmp_path / "h200" / "layernorm.json"
    path.parent.mkdir()
    path.write_text(json.dumps({"format": 1, "op": "layernorm", "gpu": H200,
                                "entries": {"d=768/float32": older(synthetic_entry(run={"m": 4096}), 4)}}))
    (winner,) = load_winners(LN, D768, H200, tmp_path)
    assert winner.key == "d=768/float32/m=4096" and winner.params.vector == 16  # 4 floats: 16 bytes
    save_entry("layernorm", H200, "d=1024/float32/m=4096", synthetic_entry(d=1024, run={"m": 4096}),
               directory=tmp_path)
    doc = json.loads(path.read_text())
    assert doc["format"] == 3 and sorted(doc["entries"]) == ["d=1024/float32/m=4096", "d=768/float32/m=4096"]
    assert doc["entries"]["d=768/float32/m=4096"]["params"]["vector"] == 16


def test_a_format_2_entry_of_16_bit_rows_gets_its_vector_in_bytes(tmp_path, synthetic_entry):
    from mage_gen.store import _read

    path = tmp_path / "rmsnorm.json"
    entry = {**older(synthetic_entry(run={"m": 4096}), 8), "shape": {"d": 768, "dtype": "bfloat16"},
             "runner_ups": [{"kernel": "k", "params": {"vector": 4}}]}
    path.write_text(json.dumps({"format": 2, "op": "rmsnorm", "gpu": H200, "entries": {"d=768/bfloat16/m=4096": entry}}))
    migrated = _read(path, "rmsnorm")["entries"]["d=768/bfloat16/m=4096"]
    assert migrated["params"]["vector"] == 16 and migrated["runner_ups"][0]["params"]["vector"] == 8


def test_the_committed_winners_are_keyed_by_size_class():
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent / "tuned"
    for winner in load_winners(LN, D768, H200, root):
        assert winner.key == entry_key(LN, D768, winner.run)


def test_an_entry_records_its_size_class_and_the_rule():
    recorded = dispatch.record(LN, D768, {"m": 65536}, L2)
    assert recorded == {"m": 65536, "regime": "dram", "bytes_moved": LN.bytes_moved(D768, {"m": 65536}),
                        "l2_bytes": L2, "rule": dispatch.RULE}
    assert dispatch.record(MM, MM.shape(m=8, n=8, k=8), {}, L2) is None


GEMM = get_op("gemm_sm90")


def gemm_entries(*ms, n=4096, k=4096, **options):
    return {GEMM.shape(m=m, n=n, k=k, **options): GEMM.params_from_dict(
        {"bm": 64, "consumers": 1, "stages": m % 7 + 2} if m < 256 else {"stages": m % 7 + 2})
            for m in ms}


@pytest.mark.parametrize("m, served", [(1, 16), (16, 16), (40, 16), (64, 128), (100, 128), (256, 512),
                                       (1448, 512), (1449, 4096), (100000, 4096)])
def test_a_gemm_at_an_untuned_m_takes_the_entry_tuned_at_the_nearest_m_on_a_log_scale(m, served):
    # 64 is 4× from 16 and 2× from 128; 1448 < √(512·4096) = 1448.2 < 1449
    other, params = dispatch.choose_class(GEMM, GEMM.shape(m=m, n=4096, k=4096), gemm_entries(16, 128, 512, 4096))
    assert other.m == served and params == gemm_entries(served)[other]


def test_a_tie_between_two_classes_goes_to_the_larger_m():
    other, _ = dispatch.choose_class(GEMM, GEMM.shape(m=64, n=4096, k=4096), gemm_entries(32, 128))
    assert other.m == 128


def test_a_class_serves_only_its_own_n_k_and_types():
    tuned = {**gemm_entries(16), **gemm_entries(4096, n=8192), **gemm_entries(512, c_dtype="fp32"),
             **gemm_entries(128, b_layout="kn")}
    assert dispatch.choose_class(GEMM, GEMM.shape(m=4096, n=4096, k=4096), tuned)[0].m == 16
    assert dispatch.choose_class(GEMM, GEMM.shape(m=16, n=4096, k=4096, c_dtype="fp32"), tuned)[0].m == 512
    assert dispatch.choose_class(GEMM, GEMM.shape(m=16, n=4096, k=4096, b_layout="kn"), tuned)[0].m == 128
    assert dispatch.choose_class(GEMM, GEMM.shape(m=16, n=4096, k=2048), tuned) is None


def test_a_class_whose_params_are_invalid_at_the_launch_m_is_passed_over():
    tuned = gemm_entries(16, 4096)
    broken = GEMM.params_from_dict({"bm": 64, "cluster": 2, "multicast": "a"})  # a cluster of rows needs two tile rows
    tuned[GEMM.shape(m=16, n=4096, k=4096)] = broken
    with pytest.raises(Exception):
        GEMM.validate(GEMM.shape(m=32, n=4096, k=4096), broken)
    assert dispatch.choose_class(GEMM, GEMM.shape(m=32, n=4096, k=4096), tuned)[0].m == 4096


def test_an_op_without_class_dims_borrows_nothing_at_launch():
    default = MM.params_from_dict({})
    assert dispatch.choose_class(MM, MM.shape(m=1000, n=1024, k=1024), {MM.shape(m=1024, n=1024, k=1024): default}) is None


def test_a_new_class_is_searched_from_the_winners_of_the_nearest_tuned_shapes_each_once():
    def entry(stages, m, n=4096, k=4096, **options):
        return GEMM.shape(m=m, n=n, k=k, **options), GEMM.params_from_dict({"bm": 64, "consumers": 1, "stages": stages})
    tuned = dict([entry(2, 16), entry(3, 128), entry(4, 128, n=6144), entry(5, 2048, n=6144),
                  entry(6, 128, n=28672, c_dtype="fp32", precision="e4m3"), entry(8, 128, n=28672, gate="silu"),
                  entry(4, 16, n=14336)])
    seeds = dispatch.neighbours(GEMM, GEMM.shape(m=128, n=28672, k=4096), tuned, 4)
    # at its own sizes, the gated entry (one field apart) before the fp8 one with an fp32 C (two); then by distance;
    # equal params count once (16×14336's are 128×6144's)
    assert [vars(other) for other, _ in seeds] == [vars(GEMM.shape(**shape)) for shape in (
        dict(m=128, n=28672, k=4096, gate="silu"), dict(m=128, n=28672, k=4096, c_dtype="fp32", precision="e4m3"),
        dict(m=128, n=6144, k=4096), dict(m=128, n=4096, k=4096))]
    assert [params for _, params in seeds] == [tuned[other] for other, _ in seeds]
    assert len(dispatch.neighbours(GEMM, GEMM.shape(m=128, n=28672, k=4096), tuned, 2)) == 2
    # params invalid at the shape are passed over
    tuned[GEMM.shape(m=32, n=4096, k=4096, residual=True)] = GEMM.params_from_dict(
        {"bm": 64, "cluster": 2, "multicast": "a"})  # a cluster of rows needs two tile rows
    seeds = dispatch.neighbours(GEMM, GEMM.shape(m=32, n=4096, k=4096), tuned, 2)
    assert [(other.m, other.n) for other, _ in seeds] == [(16, 4096), (128, 4096)]


def _tuned(objective: str, ours: tuple[float, float], cublas: tuple[float, float]) -> dict:
    """An entry's timings as a tune stores them: (hot, cold) medians of its winner and of cuBLAS."""
    def timings(hot, cold):
        return {m: {"method": m, "samples": 32, "median_us": v, "spread_us": 0.1, "min_us": v}
                for m, v in (("hot", hot), ("cold", cold))}
    return {"objective": objective, "timings": timings(*ours), "peers": {"cublas": timings(*cublas)}}


@pytest.mark.parametrize("objective, faster", [("hot", True), ("cold", False), ("both", False)])
def test_cublas_is_faster_by_the_objective_the_tune_ranked_by(objective, faster):
    # hot 10 against 9, cold 20 against 30: by both, √200 against √270
    assert dispatch.peer_faster(_tuned(objective, (10.0, 20.0), (9.0, 30.0))) is faster


@pytest.mark.parametrize("objective, hot, cold, faster", [("hot", 1.02, 0.9, True), ("hot", 0.98, 1.2, False),
                                                            ("cold", 0.9, 1.01, True), ("both", 1.1, 0.95, True),
                                                            ("both", 1.05, 0.9, False)])
def test_where_the_entry_keeps_the_rounds_ratios_their_median_decides(objective, hot, cold, faster):
    # the pooled medians say the opposite of the rounds each time: ours 9 against cuBLAS's 10 where the rounds put
    # ours slower, and the other way round
    pooled = (9.0, 9.0) if faster else (11.0, 11.0)
    entry = _tuned(objective, pooled, (10.0, 10.0))
    entry["peers"]["cublas"]["winner_over_peer"] = {m: {"median": r} for m, r in (("hot", hot), ("cold", cold))}
    assert dispatch.peer_faster(entry) is faster


def test_an_entry_without_a_cublas_timing_never_says_cublas_is_faster():
    entry = _tuned("hot", (10.0, 20.0), (9.0, 30.0))
    assert not dispatch.peer_faster({**entry, "peers": {"triton": entry["peers"]["cublas"]}})
    assert not dispatch.peer_faster({k: v for k, v in entry.items() if k != "timings"})


@pytest.mark.parametrize("m, tuned_m, cublas_faster, serves", [
    (2048, 2048, False, False), (2048, 2048, True, True),  # its own class: the tune's verdict
    (512, 2048, False, False), (8192, 2048, False, False),  # within PEER_REACH of the class: the verdict still
    (511, 2048, False, True), (8193, 2048, False, True),  # beyond it: cuBLAS, whatever the tune saw
])
def test_cublas_serves_where_the_entry_timed_it_faster_or_was_tuned_too_far_from_the_launch(m, tuned_m, cublas_faster,
                                                                                            serves):
    op = get_op("gemm_sm90")
    entry = {**_tuned("hot", (10.0, 10.0), (9.0, 9.0) if cublas_faster else (11.0, 11.0)),
             "shape": {"m": tuned_m, "n": 4096, "k": 4096}}
    assert dispatch.PEER_REACH == 4
    assert dispatch.cublas_serves(op, op.shape(m=m, n=4096, k=4096), entry) is serves
    assert dispatch.cublas_serves(op, op.shape(m=m, n=4096, k=4096), None) is False
