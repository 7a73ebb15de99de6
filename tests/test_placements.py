"""Rounds taken at several placements of the inputs and outputs (measure.interleave_placed): each round at the
next placement, every subject at each, the samples pooled and kept per placement."""

import pytest

from mage_gen.measure import (HOT_LAUNCHES_PER_GRAPH, HOT_REPLAY_US, common_to_every_placement, hot_launches,
                               interleave, interleave_placed, interleave_rounds, pool_rounds)
from mage_gen.timing import median_interval, round_ratio


class Fixed:
    """A subject whose every sample is its placement's time; records the calls it answered."""

    def __init__(self, name: str, placement: int, us: float, calls: list):
        self.name, self.placement, self.us, self.calls = name, placement, us, calls
        self.closed = False

    def hot(self, replays: int, launches: int = HOT_LAUNCHES_PER_GRAPH) -> list[float]:
        self.calls.append((self.name, self.placement, f"hot/{launches}"))
        return [self.us] * replays

    def cold(self, count: int) -> list[float]:
        self.calls.append((self.name, self.placement, "cold"))
        return [self.us + 1.0] * count

    def close(self) -> None:
        self.closed = True


def placed(times: dict[str, list[float]], calls: list) -> list[list[Fixed]]:
    count = len(next(iter(times.values())))
    return [[Fixed(name, p, us[p], calls) for name, us in times.items()] for p in range(count)]


def test_round_r_is_taken_at_placement_r_mod_their_count_every_subject_at_each():
    calls = []
    groups = placed({"kernel": [10.0, 20.0, 30.0], "peer": [12.0, 12.0, 12.0]}, calls)
    pooled, by_placement = interleave_placed(groups, "hot", rounds=6, per_round=2)
    # one launch of each, at the first placement, for the launches per graph; then the rounds
    assert calls[:2] == [("kernel", 0, "hot/1"), ("peer", 0, "hot/1")]
    assert [(p) for _, p, _ in calls[2:]] == [0, 0, 1, 1, 2, 2, 0, 0, 1, 1, 2, 2]
    assert [[t["kernel"].median_us for t in by_placement]] == [[10.0, 20.0, 30.0]]
    assert pooled["kernel"].samples == 12 and pooled["kernel"].median_us == 20.0
    # the placements' spread is the pooled timing's: 10 and 30 apart is not a tie with a steady 12 hidden
    assert pooled["kernel"].spread_us == 20.0 and pooled["kernel"].ties_with(pooled["peer"])


def test_each_placement_times_its_subjects_in_both_orders():
    calls = []
    interleave_rounds(placed({"kernel": [10.0, 20.0], "peer": [12.0, 12.0], "other": [1.0, 1.0]}, calls), "cold",
                      rounds=4, per_round=1)
    orders = [tuple(name for name, p, _ in calls[3 * r:3 * r + 3]) for r in range(4)]
    assert orders == [("kernel", "peer", "other")] * 2 + [("other", "peer", "kernel")] * 2
    assert [p for _, p, _ in calls] == [0] * 3 + [1] * 3 + [0] * 3 + [1] * 3


def test_a_fixed_order_is_kept_where_asked():
    calls = []
    interleave_rounds(placed({"kernel": [10.0], "peer": [12.0]}, calls), "cold", rounds=3, per_round=1,
                      alternate=False)
    assert [name for name, _, _ in calls] == ["kernel", "peer"] * 3


def test_fewer_rounds_than_placements_time_only_the_first_and_report_only_those():
    calls = []
    pooled, by_placement = interleave_placed(placed({"kernel": [10.0, 20.0, 30.0]}, calls), "cold", 2, 3)
    assert {p for _, p, _ in calls} == {0, 1} and len(by_placement) == 2
    assert pooled["kernel"].samples == 6 and pooled["kernel"].median_us == 16.0


def test_one_placement_is_plain_interleave():
    calls_a, calls_b = [], []
    a = interleave(placed({"k": [5.0], "p": [6.0]}, calls_a)[0], "hot", 3, 2)
    b, _ = interleave_placed(placed({"k": [5.0], "p": [6.0]}, calls_b), "hot", 3, 2)
    assert a == b and calls_a == calls_b


def test_placements_that_hold_other_subjects_are_refused():
    calls = []
    groups = placed({"kernel": [1.0, 2.0], "peer": [1.0, 2.0]}, calls)
    groups[1] = groups[1][:1]
    with pytest.raises(ValueError, match="same subjects"):
        interleave_placed(groups, "hot", 2, 1)


def test_a_subject_missing_at_one_placement_is_timed_at_none_and_named():
    calls = []
    groups = placed({"kernel": [1.0, 2.0], "peer": [1.0, 2.0], "other": [3.0, 3.0]}, calls)
    groups[1] = [s for s in groups[1] if s.name != "peer"]
    kept, left_out = common_to_every_placement(groups)
    assert left_out == ["peer"]
    assert [[s.name for s in g] for g in kept] == [["kernel", "other"], ["kernel", "other"]]
    assert not any(s.closed for g in groups for s in g)  # closing is the caller's, with the rest
    interleave_placed(kept, "hot", 2, 1)
    assert {name for name, _, _ in calls} == {"kernel", "other"}


def test_rounds_keep_each_rounds_samples_and_pool_as_interleave_placed_does():
    calls = []
    groups = placed({"kernel": [10.0, 20.0, 30.0], "peer": [12.0, 12.0, 12.0]}, calls)
    taken = interleave_rounds(groups, "cold", rounds=4, per_round=2)
    assert [by["kernel"] for by in taken] == [[11.0, 11.0], [21.0, 21.0], [31.0, 31.0], [11.0, 11.0]]
    pooled, by_placement = pool_rounds(taken, "cold", 3)
    again, again_by = interleave_placed(placed({"kernel": [10.0, 20.0, 30.0], "peer": [12.0, 12.0, 12.0]}, []),
                                        "cold", 4, 2)
    assert pooled == again and by_placement == again_by and by_placement[0]["kernel"].samples == 4


def test_a_round_ratio_pairs_the_rounds_so_a_placement_both_feel_cancels():
    # the kernel 1% under the peer at every placement, the placements 50% apart: pooled spreads call it a tie,
    # the rounds' ratios do not
    calls = []
    groups = placed({"kernel": [9.9, 14.85, 19.8], "peer": [10.0, 15.0, 20.0]}, calls)
    taken = interleave_rounds(groups, "hot", rounds=16, per_round=3)
    pooled, _ = pool_rounds(taken, "hot", 3)
    assert pooled["kernel"].ties_with(pooled["peer"])
    ratio = round_ratio([by["kernel"] for by in taken], [by["peer"] for by in taken])
    assert ratio.rounds == 16 and ratio.median == pytest.approx(0.99) and ratio.verdict == "faster"


def test_a_round_ratio_is_slower_only_where_its_interval_lies_above_one():
    peer = [[10.0, 10.0]] * 16
    # 3 of 16 rounds under the peer: the interval starts at the 4th smallest ratio, over 1
    slower = round_ratio([[10.2, 10.1]] * 13 + [[9.9, 9.9]] * 3, peer)
    assert slower.verdict == "slower" and slower.low > 1.0
    # 4 of 16: the median is as far over 1, the interval now holds it
    mixed = round_ratio([[10.2, 10.1]] * 12 + [[9.9, 9.9]] * 4, peer)
    assert mixed.median > 1.0 and mixed.low < 1.0 and mixed.verdict == "tie"
    with pytest.raises(ValueError, match="same rounds"):
        round_ratio([[1.0]] * 3, [[1.0]] * 2)


def test_the_median_interval_is_the_widest_order_statistics_short_of_the_coverage():
    low, high, coverage = median_interval(list(range(16)))
    assert (low, high) == (3, 12) and coverage == pytest.approx(1 - 2 * 697 / 2**16)
    # five values cannot reach 95%: the whole range, and its coverage said
    assert median_interval([5.0, 1.0, 4.0, 2.0, 3.0]) == (1.0, 5.0, pytest.approx(1 - 2 / 32))
    with pytest.raises(ValueError):
        median_interval([])


class _Variant:
    def __init__(self, name: str):
        self.source = type("Source", (), {"kernel_name": name})()


class _Kernel:
    def __init__(self):
        self.unloaded = False

    def unload(self):
        self.unloaded = True


class _Place:
    def input_pointers(self):
        return {}

    def output_pointers(self):
        return {}


class _Bench:
    """What GpuBackend.final asks of a Bench: kernels checked at each placement, here by a rule."""

    def __init__(self, fails_at: dict[str, int]):
        self.fails_at, self.calls, self.opened, self.freed = fails_at, [], [], False

    def load(self, variant):
        return _Kernel()

    def _subject(self, variant, placement):
        subject = Fixed(variant.source.kernel_name, placement, 10.0 + placement, self.calls)
        self.opened.append(subject)
        return subject

    def checked_subject(self, variant, kernel, placement=None):
        return self._subject(variant, placement), None

    def checked_at(self, variant, kernel, placement=None):
        if self.fails_at.get(variant.source.kernel_name) == placement:
            return None, float("inf"), "y has 3 NaN"
        return self._subject(variant, placement), 0.0, ""

    def timing_inputs(self):
        return {}

    def placement(self, index):
        return _Place()

    def inputs_changed(self):
        return []

    def free_placements(self):
        self.freed = True

    def check_tensor(self, name, tensor):
        return 0.0, ""


def test_a_finalist_that_fails_its_check_at_one_placement_is_dropped_and_the_others_timed_at_every_one():
    from mage_gen import backends

    backend = object.__new__(backends.GpuBackend)
    backend.op, backend.shape, backend.run = None, None, {"m": 1}
    backend.bench = _Bench({"b": 1})
    told = []
    timings, _, dropped = backend.final([_Variant("a"), _Variant("b"), _Variant("c")],
                                        progress=lambda done, total: told.append((done, total)))
    assert set(timings) == {"a", "c"} and dropped["b"] == "placement 1: y has 3 NaN"
    assert told == [(done, backends.FINAL_STEPS) for done in range(backends.FINAL_STEPS + 1)]
    per = backends.FINAL_ROUNDS * backends.FINAL_PER_ROUND
    assert timings["a"]["hot"].samples == timings["a"]["cold"].samples == per
    # the same rounds for every finalist, kept for comparisons by paired rounds
    for method in ("hot", "cold"):
        assert [len(r) for r in timings["a"]["rounds"][method]] == [backends.FINAL_PER_ROUND] * backends.FINAL_ROUNDS
        assert len(timings["c"]["rounds"][method]) == backends.FINAL_ROUNDS
    assert {p for name, p, _ in backend.bench.calls if name == "a"} == set(range(backends.FINAL_PLACEMENTS))
    assert not any(name == "b" for name, _, _ in backend.bench.calls)  # never timed
    assert all(s.closed for s in backend.bench.opened) and backend.bench.freed


class Steps:
    """The driver calls a KernelSubject makes, as names in the order made (no GPU)."""

    def __init__(self):
        self.log: list[str] = []
        self.handle = "stream"

    def capture(self, enqueue):
        self.log.append("capture")
        steps = self

        class Graph:
            def launch(self, stream):
                steps.log.append("replay")

            def destroy(self):
                steps.log.append("destroy")
        return Graph()

    def enqueue(self, handle):
        self.log.append("launch")

    def free(self):
        pass


def test_each_hot_round_and_each_cold_sample_begins_with_the_persisting_lines_reset(monkeypatch):
    # Lines another subject loaded at evict-last outlive the flush; timed without the reset, a subject reading
    # the same bytes is partly timed on the other's work (bench/NOTES.md, norms §19)
    import mage_gen.measure as measure

    steps = Steps()
    log = steps.log

    class Series:
        def __init__(self, count):
            self.count = count

        def record(self, i, handle):
            pass

        def gaps_us(self):
            return [20.0] * (self.count - 1)

        def destroy(self):
            pass

    class Pair:
        def start(self, stream):
            log.append("start")

        def stop(self, stream):
            log.append("stop")

        def elapsed_us(self):
            return 1.0

        def destroy(self):
            pass

    class Flush:
        def fill32(self, value, handle):
            log.append("flush")

    monkeypatch.setattr(measure.gpu, "reset_persisting_l2", lambda: log.append("reset"))
    monkeypatch.setattr(measure.gpu, "EventSeries", Series)
    monkeypatch.setattr(measure.gpu, "EventPair", Pair)
    monkeypatch.setattr(measure, "hold", lambda handle: log.append("hold"))
    monkeypatch.setattr(measure, "flush_buffer", Flush)
    subject = measure.KernelSubject("k", steps, steps)
    assert subject.hot(2) == [1.0, 1.0]
    subject.hot(1)
    assert log == ["capture", "reset", "replay", "hold", "replay", "replay", "reset", "replay", "hold", "replay"]
    log.clear()
    assert subject.cold(2) == [1.0, 1.0]
    assert log == ["reset", "hold", "flush", "start", "launch", "stop"] * 2
    log.clear()
    # another count of launches per graph: the graph captured again, each gap shared by that many launches
    assert subject.hot(1, 5) == [4.0]
    assert log == ["destroy", "capture", "reset", "replay", "hold", "replay"]


def test_a_hot_graph_holds_fewer_launches_only_where_all_would_last_longer_than_a_replay_should():
    assert hot_launches(1.0) == hot_launches(HOT_REPLAY_US / HOT_LAUNCHES_PER_GRAPH) == HOT_LAUNCHES_PER_GRAPH
    # the fewest whose replay lasts the replay's time, at least one
    assert hot_launches(HOT_REPLAY_US / 4) == 4 and hot_launches(HOT_REPLAY_US / 4.5) == 5
    assert hot_launches(HOT_REPLAY_US) == hot_launches(10 * HOT_REPLAY_US) == 1
    assert hot_launches(0.0) == hot_launches(float("nan")) == HOT_LAUNCHES_PER_GRAPH  # no estimate: the most


def test_subjects_timed_together_share_the_count_of_the_fastest_from_one_launch_of_each():
    calls = []
    slow = HOT_REPLAY_US / 2  # two launches per graph alone; the peer, twice as slow, one
    interleave_placed(placed({"kernel": [slow, slow], "peer": [2 * slow, 2 * slow]}, calls), "hot", 2, 1)
    assert calls == [("kernel", 0, "hot/1"), ("peer", 0, "hot/1"),
                     ("kernel", 0, "hot/2"), ("peer", 0, "hot/2"), ("kernel", 1, "hot/2"), ("peer", 1, "hot/2")]
    given = []
    interleave_placed(placed({"kernel": [slow], "peer": [2 * slow]}, given), "hot", 1, 1, launches=3)
    assert given == [("kernel", 0, "hot/3"), ("peer", 0, "hot/3")]  # a count given: no launch to find it
