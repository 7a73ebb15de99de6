"""The command line as a user meets it: real processes, exit codes, one-line errors."""

import json
import os
import subprocess
import sys

import pytest

from mage_gen.backends import FINAL_STEPS


def mage_gen(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "mage_gen", *args], capture_output=True, text=True, timeout=300)


def test_inspect_json_reports_the_seed_shape():
    done = mage_gen("inspect", "layernorm", "--d", "768", "--threads", "128", "--vector", "16", "--json")
    assert done.returncode == 0, done.stderr
    doc = json.loads(done.stdout)
    census = doc["census"]
    assert census["global_loads"]["x"] == {"v4": 2}
    assert census["spill_bytes"] == 0 and census["passes"]["x"] == 1
    assert doc["launch"]["grid"] == [4096, 1, 1] and doc["launch"]["block"] == [128, 1, 1]


def test_inspect_table_and_source():
    done = mage_gen("inspect", "layernorm", "--d", "1024", "--template", "multirow", "--threads", "32",
                    "--config", "rows_per_block=4,hint=stream", "--source")
    assert done.returncode == 0, done.stderr
    assert "layernorm_multirow_d1024_t32_v4_r4_approx_stream" in done.stdout
    assert "ld.global.nc.L1::no_allocate.v4.f32" in done.stdout  # the source came too
    assert "passes over x" in done.stdout


def test_inspect_matmul_config_takes_booleans_and_the_one_barrier_sync():
    done = mage_gen("inspect", "matmul", "--m", "256", "--n", "256", "--k", "256", "--json", "--config",
                    "bm=128,bn=128,bk=16,tm=16,tn=8,buffers=3,split=true,sync=one")
    assert done.returncode == 0, done.stderr
    doc = json.loads(done.stdout)
    assert doc["params"]["split"] is True and doc["params"]["sync"] == "one"
    assert doc["census"]["wait_groups"] == {"0": 1, "1": 1} and doc["census"]["bar_sync"] == 2


def test_variants_json_lists_only_valid_configs():
    done = mage_gen("variants", "layernorm", "--d", "128", "--preset", "quick", "--json")
    assert done.returncode == 0, done.stderr
    doc = json.loads(done.stdout)
    assert doc["preset"] == "quick" and doc["rejected"] > 0 and doc["variants"]
    assert all(v["census"]["spill_bytes"] == 0 for v in doc["variants"])
    # a row of 128 floats keeps at most 128 / (floats per access) threads busy: no variant wastes a warp
    assert all(v["params"]["threads"] <= 128 // (v["params"]["vector"] // 4) for v in doc["variants"])


def test_variants_size_a_grid_given_per_sm_for_the_sms_asked():
    done = mage_gen("variants", "layernorm", "--d", "128", "--preset", "quick", "--sms", "100", "--json")
    assert done.returncode == 0, done.stderr
    caps = {v["params"]["grid_cap"] for v in json.loads(done.stdout)["variants"]}
    assert caps == {0, 400}
    plain = mage_gen("variants", "layernorm", "--d", "128", "--preset", "quick", "--json")
    caps = {v["params"]["grid_cap"] for v in json.loads(plain.stdout)["variants"]}
    # without --sms: sized for this machine's GPU, or, with none here, left out and said so
    assert (caps == {0} and "left out (no GPU here: give --sms)" in plain.stderr) or (len(caps) == 2 and 0 in caps)


def test_variants_of_a_preset_all_per_sm_ask_for_sms_where_there_is_no_gpu():
    done = mage_gen("variants", "gemm_sm90", "--m", "2048", "--n", "512", "--k", "256", "--limit", "1")
    if done.returncode == 0:  # a GPU here sized the grid
        return
    assert done.returncode == 2 and done.stderr.strip().splitlines() == [
        "mage-gen: error: sms: every config of preset quick gives its grid per SM, and there is no GPU here; give the "
        "GPU's SM count, e.g. --sms 132"]


@pytest.mark.parametrize("args, says", [
    (["inspect", "layernorm", "--d", "0"], "d-range"),
    (["inspect", "layernorm", "--d", "-5"], "d-range"),
    (["inspect", "layernorm", "--d", "abc"], "--d"),
    (["inspect", "layernorm", "--d", "768", "--threads", "100"], "threads-multiple-of-32"),
    (["inspect", "layernorm", "--d", "768", "--vector", "3"], "vector-width"),
    (["inspect", "layernorm", "--d", "768", "--arch", "sm_10"], "arch"),
    (["inspect", "layernorm"], "needs --d"),
    (["inspect", "softmax", "--d", "768"], "unknown op"),
    (["inspect", "layernorm", "--d", "768", "--config", "warp_size=7"], "unknown layernorm parameter"),
    (["inspect", "layernorm", "--d", "768", "--m", "2147483647"], "m-range"),
    (["variants", "layernorm", "--d", "768", "--preset", "huge"], "unknown preset"),
    (["variants", "layernorm", "--d", "768", "--arch", "sm_10"], "arch"),
])
def test_bad_input_is_one_line_exit_2_no_traceback(args, says):
    done = mage_gen(*args)
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and says in lines[0], done.stderr
    assert "Traceback" not in done.stderr and done.stdout == ""


def test_inspect_matmul_seed_shows_its_pipeline():
    done = mage_gen("inspect", "matmul", "--m", "1024", "--n", "1024", "--k", "1024", "--json")
    assert done.returncode == 0, done.stderr
    doc = json.loads(done.stdout)
    census = doc["census"]
    assert set(census["cp_async"]) == {"4", "16"} and census["wait_groups"]["1"] == 1
    assert doc["launch"]["dynamic_shared_bytes"] == 33792 and doc["launch"]["block"] == [256, 1, 1]
    assert doc["launch"]["grid"] == [16, 16, 1]


@pytest.mark.parametrize("args, says", [
    (["inspect", "matmul", "--m", "64", "--n", "64"], "needs --k"),
    (["inspect", "matmul", "--m", "64", "--n", "64", "--k", "64", "--d", "3"], "takes no --d"),
    (["inspect", "layernorm", "--d", "768", "--n", "3"], "takes no --n"),
    (["inspect", "matmul", "--m", "64", "--n", "62", "--k", "64", "--config", "b_width=16"],
     "divisibility: 16-byte copies of B rows need N (62)"),
    (["inspect", "matmul", "--m", "0", "--n", "64", "--k", "64"], "m-range"),
    (["variants", "matmul", "--m", "64", "--n", "64", "--k", "64", "--preset", "huge"], "unknown preset"),
    (["inspect", "matmul", "--m", "64", "--n", "64", "--k", "64", "--config", "buffers=true"],
     "params: matmul buffers is a whole number, got True"),
])
def test_bad_matmul_input_is_one_line_exit_2(args, says):
    done = mage_gen(*args)
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and says in lines[0], done.stderr


def test_plain_mage_gen_shows_the_usage_without_an_empty_error_line():
    done = mage_gen()
    assert done.returncode == 2
    assert "Usage: " in done.stderr and "COMMAND" in done.stderr
    assert "mage-gen: error:" not in done.stderr


def test_help_names_the_ops_and_every_preset_and_tags_no_flag_with_a_type():
    done = mage_gen("variants", "--help")
    text = " ".join(done.stdout.split())
    assert done.returncode == 0
    assert "op family: gemm_sm90, layernorm, matmul" in text
    assert "gemm_sm90: quick, full, skinny, skinny_chains, skinny_tail, mid; layernorm: quick, short, long, full; matmul: quick, explore, wide, full" in text
    assert "--json <bool>" not in text and "--json" in text


def test_a_compile_cache_that_cannot_be_written_is_one_line_naming_it(tmp_path):
    (tmp_path / "file").write_text("")
    for cache in (tmp_path / "file", tmp_path / "file" / "below"):
        done = subprocess.run([sys.executable, "-m", "mage_gen", "variants", "layernorm", "--d", "100"],
                              capture_output=True, text=True, timeout=300,
                              env={**os.environ, "MAGE_GEN_CACHE": str(cache)})
        assert done.returncode == 2
        lines = done.stderr.strip().splitlines()
        assert lines[-1].startswith(f"mage-gen: error: cache: cannot write the compile cache {cache}"), done.stderr
        assert "MAGE_GEN_CACHE" in lines[-1] and "Traceback" not in done.stderr


def test_variants_into_a_pipe_prints_a_plan_and_progress(tmp_path):
    done = subprocess.run([sys.executable, "-m", "mage_gen", "variants", "layernorm", "--d", "96"],
                          capture_output=True, text=True, timeout=300,
                          env={**os.environ, "MAGE_GEN_CACHE": str(tmp_path)})
    assert done.returncode == 0, done.stderr
    lines = done.stderr.strip().splitlines()
    assert lines[0].startswith("compiling ") and "variants of layernorm" in lines[0]
    total = int(lines[0].split()[1])
    assert lines[-2].strip().startswith(f"{total}/{total} in ")
    assert len(lines) >= 4  # progress between the plan and the end
    assert f"{total} compiled, 0 read from the compile cache" in lines[-1]
    again = subprocess.run([sys.executable, "-m", "mage_gen", "variants", "layernorm", "--d", "96"],
                           capture_output=True, text=True, timeout=300, env={**os.environ, "MAGE_GEN_CACHE": str(tmp_path)})
    assert f"0 compiled, {total} read from the compile cache" in again.stderr.strip().splitlines()[-1]


def test_a_tune_into_a_log_says_how_far_it_got_at_every_tenth(tmp_path):
    recording = os.path.join(os.path.dirname(__file__), "fixtures", "layernorm_trials_h200_d768_m4096.json")
    done = subprocess.run([sys.executable, "-m", "mage_gen", "tune", "layernorm", "--d", "768", "--replay", recording,
                           "--trials", "20", "--out", str(tmp_path / "k")], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "XDG_DATA_HOME": str(tmp_path), "MAGE_GEN_TUNED": str(tmp_path / "tuned"),
                               "CUDA_VISIBLE_DEVICES": ""})
    assert done.returncode == 0, done.stderr
    measuring = [line.split()[1] for line in done.stderr.splitlines() if line.strip().startswith("measuring ")]
    assert measuring == [f"{n}/20" for n in range(2, 21, 2)]  # one line a tenth, the last at the budget
    final = [line.split()[2] for line in done.stderr.splitlines() if line.strip().startswith("re-timing finalists ")]
    assert final == [f"0/{FINAL_STEPS}", f"{FINAL_STEPS}/{FINAL_STEPS}"]


def test_a_tune_emits_its_shape_where_another_size_class_is_stale(tmp_path, synthetic_entry):
    # After a template change each class is retuned in turn: the first retune stores its winner and emits it,
    # and names the class still stale rather than failing the whole tune for it.
    from mage_gen.store import save_entry

    stale = synthetic_entry(source_hash="0123456789abcdef", run={"m": 65536})
    save_entry("layernorm", "NVIDIA H200", "d=768/float32/m=65536", stale, directory=tmp_path / "tuned")
    recording = os.path.join(os.path.dirname(__file__), "fixtures", "layernorm_trials_h200_d768_m4096.json")
    done = subprocess.run([sys.executable, "-m", "mage_gen", "tune", "layernorm", "--d", "768", "--replay", recording,
                           "--trials", "4", "--out", str(tmp_path / "k"), "--tuned", str(tmp_path / "tuned")],
                          capture_output=True, text=True, timeout=300,
                          env={**os.environ, "XDG_DATA_HOME": str(tmp_path), "CUDA_VISIBLE_DEVICES": ""})
    assert done.returncode == 0, done.stderr
    refused = [line for line in done.stderr.splitlines() if line.startswith("not emitted: ")]
    assert len(refused) == 1 and "d=768/float32/m=65536 is stale" in refused[0]
    assert "run `mage-gen tune layernorm --d 768 --m 65536`" in refused[0]
    emitted = sorted(p.name for p in (tmp_path / "k").iterdir())
    assert emitted and all("m4096" in name for name in emitted), emitted


def test_the_variants_table_shows_the_rows_loads_not_a_weight_vectors():
    # x, w and b are each loaded 12 times here: the column must name the rows, not the first tensor by name
    from mage_gen.cli import _loads_summary
    from mage_gen.ops import get_op
    from mage_gen.variants import build

    op = get_op("layernorm")
    variant = build(op, op.shape(d=768), op.params_from_dict({"threads": 32, "vector": 8}), "sm_90")
    assert _loads_summary(op, op.shape(d=768), variant.census) == "x 12×v2"


def test_odd_matmul_shapes_get_copies_their_rows_allow_in_the_default_and_the_quick_preset():
    from mage_gen.ops import get_op
    from mage_gen.space import expand, load_space

    op = get_op("matmul")
    shape = op.shape(m=127, n=255, k=63)
    found, _ = expand(op, shape, load_space(op, "quick", shape))
    assert found and {p.b_width for p in found} == {4}
    inspected = mage_gen("inspect", "matmul", "--m", "127", "--n", "255", "--k", "63", "--json")
    assert inspected.returncode == 0, inspected.stderr
    assert json.loads(inspected.stdout)["params"]["b_width"] == 4
    refused = mage_gen("inspect", "matmul", "--m", "127", "--n", "255", "--k", "63", "--config", "b_width=16")
    assert refused.returncode == 2 and "use b_width=4" in refused.stderr


def test_fitting_a_preset_to_a_round_shape_changes_nothing():
    from mage_gen.ops import get_op
    from mage_gen.space import load_space

    op = get_op("matmul")
    for preset in ("quick", "explore", "wide"):
        assert load_space(op, preset, op.shape(m=1024, n=1024, k=1024)) == load_space(op, preset)
    fitted = dict(load_space(op, "quick", op.shape(m=127, n=255, k=63)).axes)
    assert fitted["b_width"] == (4,) and fitted["a_width"] == (4,)


def live_in_group(pgid: int, within_s: float) -> list[str]:
    """The processes of a group still running after up to within_s seconds. An exited worker whose parent (the
    compile pool's fork server) is gone waits as a zombie until init reaps it: it runs nothing, so it is not
    counted."""
    import time

    deadline = time.monotonic() + within_s
    while True:
        listed = subprocess.run(["ps", "-o", "pid=,stat=,cmd=", "-g", str(pgid)], capture_output=True, text=True)
        live = [line for line in listed.stdout.splitlines() if line.split()[1][0] != "Z"]
        if not live or time.monotonic() > deadline:
            return live
        time.sleep(0.1)


def interrupt_a_parallel_compile(cache, after_s: float, interrupts: int = 1, how: str = "SIGINT",
                                 group: bool = True) -> tuple[int, str, int]:
    """(exit code, the rest of stderr, process group) of `variants` interrupted `after_s` after it says it
    compiles, in its own process group, as a terminal's foreground job: Ctrl-C reaches the workers too. `how`: the
    signal; group False sends it to the command alone (as timeout and kill do)."""
    import signal
    import time

    env = {**os.environ, "MAGE_GEN_CACHE": str(cache)}
    # SIGINT at its default, as a terminal gives it: a test run started in the background (`cmd &`) inherits it
    # ignored, and so would the command, which then rightly ignores Ctrl-C
    # the long preset: a thousand variants, minutes of compiling, and a space expanded in a moment (the full one
    # takes a minute before the first compile)
    proc = subprocess.Popen([sys.executable, "-m", "mage_gen", "variants", "layernorm", "--d", "1000", "--preset",
                             "long"], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env,
                            start_new_session=True, preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        line = proc.stderr.readline()
        if line.endswith("--limit N compiles N of them\n"):  # how long the full preset takes, said first
            line = proc.stderr.readline()
        assert line.startswith("compiling "), line
        time.sleep(after_s)
        for _ in range(interrupts):
            (os.killpg if group else os.kill)(proc.pid, getattr(signal, how))
            time.sleep(0.05)
        rest = proc.communicate(timeout=30)[1]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    return proc.returncode, rest, proc.pid


@pytest.mark.parametrize("interrupts", [1, 2])
def test_ctrl_c_during_a_parallel_compile_stops_at_once_and_leaves_nothing_behind(tmp_path, interrupts):
    code, rest, group = interrupt_a_parallel_compile(tmp_path, 1.0, interrupts)  # the workers are busy
    assert code == 130 and rest.strip().endswith("mage-gen: interrupted"), rest
    assert "Traceback" not in rest
    assert live_in_group(group, within_s=5) == [], "a compile worker outlived it"
    # the cache holds whole entries only (a killed compile leaves at most a scratch folder)
    entries = [p for p in (tmp_path / "nvrtc").glob("*/*") if not p.name.startswith(".tmp-")]
    assert all({f.name for f in entry.iterdir()} == {"kernel.ptx", "ptxas.log", "kernel.cubin"} for entry in entries)


@pytest.mark.parametrize("after_s", [0.3, 1.5])
def test_sigterm_stops_a_parallel_compile_as_ctrl_c_does(tmp_path, after_s):
    # timeout(1) and kill send TERM to the command alone: it used to die there, its pool's semaphores leaked and its
    # workers writing tracebacks into a closed pipe
    code, rest, group = interrupt_a_parallel_compile(tmp_path, after_s, how="SIGTERM", group=False)
    assert code == 130 and rest.strip().endswith("mage-gen: interrupted"), rest
    assert "Traceback" not in rest and "leaked" not in rest, rest
    assert live_in_group(group, within_s=5) == [], "a compile worker outlived it"


@pytest.mark.parametrize("after_s", [0.0, 0.1, 0.3])
def test_ctrl_c_while_the_compile_workers_start_is_one_line_and_stops_them(tmp_path, after_s):
    # The pool waits on the fork server's imports; a Ctrl-C then once killed the server (or a worker the caller
    # no longer waited for) half-way, each printing a traceback into the user's terminal.
    code, rest, group = interrupt_a_parallel_compile(tmp_path, after_s)
    assert code == 130 and rest.strip() == "mage-gen: interrupted", rest
    assert live_in_group(group, within_s=5) == [], "a compile worker outlived it"



@pytest.mark.parametrize("server", ["resource_tracker", "forkserver"])
def test_a_ctrl_c_while_a_server_is_spawned_is_kept_not_lost(monkeypatch, server):
    # Spawned with Ctrl-C ignored in the caller, a Ctrl-C landing then was lost and the compile ran on to its end
    # (a loaded machine made the window wide enough for the test above to hit it)
    import signal
    from multiprocessing import forkserver, resource_tracker

    from mage_gen import variants

    module = {"resource_tracker": resource_tracker, "forkserver": forkserver}[server]
    spawn, landed = module.ensure_running, []

    def spawn_as_ctrl_c_lands() -> None:
        if not landed:  # the pool asks again later, when a Ctrl-C would reach the caller's handler anyway
            landed.append(True)
            os.kill(os.getpid(), signal.SIGINT)
        spawn()

    monkeypatch.setattr(module, "ensure_running", spawn_as_ctrl_c_lands)
    handler = signal.getsignal(signal.SIGINT)
    try:
        with pytest.raises(KeyboardInterrupt):
            with variants._workers(2):
                pass
    finally:
        signal.signal(signal.SIGINT, handler)


def test_a_ctrl_c_while_the_workers_compile_is_raised_between_their_results_and_leaves_it_ignored():
    import signal

    # raised where it lands, it could leave a lock of the pool's or of the progress display held, and the cleanup
    # waits on that lock's thread for ever
    from mage_gen import variants

    handler, taken = signal.getsignal(signal.SIGINT), []
    try:
        with pytest.raises(KeyboardInterrupt):
            with variants._workers(2) as results:
                for value in results(abs, list(range(-40, 0))):
                    taken.append(value)
                    if len(taken) == 1:
                        os.kill(os.getpid(), signal.SIGINT)
        assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN  # a second one must not cut the cleanup short
    finally:
        signal.signal(signal.SIGINT, handler)
    assert taken == [40, 39, 38, 37]  # the rest of the chunk it came in, and not one result more


def test_an_interrupt_that_lands_inside_a_progress_line_leaves_it_written_once(monkeypatch):
    import io
    import signal

    from rich.console import Console

    from mage_gen import cli

    class Stderr(io.StringIO):
        interrupts = 1

        def flush(self) -> None:  # Ctrl-C lands after rich wrote its line, before it cleared its buffer
            super().flush()
            if self.interrupts:
                self.interrupts -= 1
                raise KeyboardInterrupt

    stderr = Stderr()
    monkeypatch.setattr(sys, "stderr", stderr)
    monkeypatch.setattr(cli, "err", Console(stderr=True))  # its buffer keeps the line, as the process it stands for
    monkeypatch.setattr(cli, "app", lambda **_: cli._log("compiling 4 variants"))
    handlers = signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)
    try:
        with pytest.raises(SystemExit) as done:
            cli.main()
    finally:
        signal.signal(signal.SIGINT, handlers[0])
        signal.signal(signal.SIGTERM, handlers[1])
    assert done.value.code == 130
    assert stderr.getvalue() == "compiling 4 variants\nmage-gen: interrupted\n"


def test_a_whole_number_with_a_zero_fraction_is_taken_alike_in_sizes_and_config():
    sizes = mage_gen("inspect", "layernorm", "--d", "768.0", "--json")
    config = mage_gen("inspect", "layernorm", "--d", "768", "--config", "threads=128.0", "--json")
    assert sizes.returncode == config.returncode == 0, sizes.stderr + config.stderr
    assert json.loads(sizes.stdout)["shape"] == {"d": 768}
    assert json.loads(config.stdout)["params"]["threads"] == 128


def test_variants_says_how_long_a_big_preset_takes_before_it_starts_and_compiles_only_its_limit(monkeypatch, capsys):
    from mage_gen import cli

    monkeypatch.setattr(cli, "MANY_VARIANTS", 100)  # the quick preset at d = 768 (154 valid) counts as big here
    with pytest.raises(SystemExit) as done:
        monkeypatch.setattr(sys, "argv", ["mage-gen", "variants", "layernorm", "--d", "768", "--limit", "3", "--json"])
        cli.main()
    assert done.value.code == 0
    captured = capsys.readouterr()
    lines = captured.err.splitlines()
    assert lines[0].startswith("154 valid variants: at about a second of one core each") and "--limit: compiling 3" in lines[0]
    assert len(json.loads(captured.out)["variants"]) == 3
