"""mage-gen report: a study made by the replay backend drawn as a page, opened in a real browser (headless
Chromium), and the same study read back through optuna-dashboard's HTTP API."""

import json
import os
import re
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

RECORDING = Path(__file__).parent / "fixtures" / "layernorm_trials_h200_d768_m4096.json"
STUDY = "replay-report"
FIGURES = {"progress.png", "hot_cold.png", "importance.png", "parameters.png", "census.png", "limit.png"}
# one replayed study (the module fixture) for all of them, under pytest-xdist too
pytestmark = pytest.mark.xdist_group("report")


def needs(tool: str) -> str:
    """The tool's path; where it is missing, a skip on a developer's machine and a failure in CI (.ci/run
    installs it)."""
    path = shutil.which(tool)
    if path is None:
        if os.environ.get("CI"):
            pytest.fail(f"{tool} is missing in CI; .ci/run installs it")
        pytest.skip(f"{tool} is not installed")
    return path


def mage_gen(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "MAGE_GEN_TUNED": str(cwd / "tuned"), "XDG_DATA_HOME": str(cwd / "data")}
    return subprocess.run([sys.executable, "-m", "mage_gen", *args], capture_output=True, text=True, timeout=300,
                          env=env, cwd=cwd)


@pytest.fixture(scope="module")
def study(tmp_path_factory) -> tuple[Path, str]:
    """A replayed study of layer norm d = 768 in its own SQLite file: (folder, storage URL)."""
    folder = tmp_path_factory.mktemp("report")
    storage = f"sqlite:///{folder / 'studies.db'}"
    done = mage_gen("tune", "layernorm", "--d", "768", "--replay", str(RECORDING), "--trials", "16", "--storage",
                    storage, "--study", STUDY, cwd=folder)
    assert done.returncode == 0, done.stderr
    return folder, storage


@pytest.fixture(scope="module")
def page(study) -> Path:
    folder, storage = study
    done = mage_gen("report", "layernorm", "--d", "768", "--storage", storage, "-o", str(folder / "report"),
                    cwd=folder)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == str(folder / "report" / "index.html")
    return folder / "report" / "index.html"


def test_the_report_is_one_page_with_every_figure_and_the_final_round(page):
    html = page.read_text()
    shown = set(re.findall(r'<img src="([^"]+)"', html))
    assert shown == FIGURES and all((page.parent / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" for name in shown)
    assert "Ranked by the hot median" in html and "the cold figure beside it" in html
    assert "16 configs measured" in html
    for peer in ("triton", "torch"):  # the final round's peers, read from the study
        assert f"<td>peer</td><td>{peer}" in html
    assert 'class="winner"' in html



def test_a_study_ranked_by_both_says_so_on_its_page(tmp_path):
    storage = f"sqlite:///{tmp_path / 'studies.db'}"
    done = mage_gen("tune", "layernorm", "--d", "768", "--replay", str(RECORDING), "--trials", "8", "--objective",
                    "both", "--storage", storage, "--study", "replay-both", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert "winner by both" in done.stdout
    done = mage_gen("report", "layernorm", "--d", "768", "--storage", storage, "-o", str(tmp_path / "r"), cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    html = (tmp_path / "r" / "index.html").read_text()
    assert "Ranked by the geometric mean of the hot and cold medians" in html and "a tie is one on each" in html
    assert "both median" not in html and "the cold figure beside it" not in html

def test_a_report_of_a_shape_without_a_study_is_one_line_exit_2(study, tmp_path):
    _, storage = study
    done = mage_gen("report", "layernorm", "--d", "1024", "--storage", storage, "-o", str(tmp_path / "r"),
                    cwd=tmp_path)
    assert done.returncode == 2 and len(done.stderr.strip().splitlines()) == 1, done.stderr
    assert "holds no study of layernorm {'d': 1024}" in done.stderr and "tune it first" in done.stderr
    assert not (tmp_path / "r").exists()


def browse(page: Path, tmp_path: Path) -> tuple[dict[str, str], list[str], Path]:
    """Open the page in headless Chromium: (the body's data attributes after load, console errors, screenshot)."""
    chromium = needs("chromium")
    flags = [chromium, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
             "--allow-file-access-from-files", "--virtual-time-budget=5000", "--enable-logging=stderr", "--v=0",
             f"--user-data-dir={tmp_path / 'profile'}"]
    dom = subprocess.run([*flags, "--dump-dom", page.as_uri()], capture_output=True, text=True, timeout=120)
    assert dom.returncode == 0, dom.stderr[-2000:]
    body = re.search(r"<body([^>]*)>", dom.stdout)
    attributes = dict(re.findall(r'data-([a-z]+)="([^"]*)"', body.group(1))) if body else {}
    console = [line for line in dom.stderr.splitlines() if "CONSOLE" in line and "ERROR" in line.upper()
               or "Uncaught" in line or "Failed to load resource" in line]
    shot = tmp_path / "screenshot.png"
    taken = subprocess.run([*flags, "--window-size=1280,2400", f"--screenshot={shot}", page.as_uri()],
                           capture_output=True, text=True, timeout=120)
    assert taken.returncode == 0 and shot.is_file(), taken.stderr[-2000:]
    return attributes, console, shot


def test_the_page_opens_in_a_browser_with_its_images_and_no_console_errors(page, tmp_path):
    attributes, console, shot = browse(page, tmp_path)
    assert attributes.get("images") == str(len(FIGURES)) and attributes.get("loaded") == str(len(FIGURES)), attributes
    assert console == []
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and shot.stat().st_size > 50_000  # more than a blank page


def test_the_browser_check_sees_a_missing_image_and_a_script_error(page, tmp_path):
    # the same page with one figure gone and a script that throws: the check above must fail on it
    broken = tmp_path / "broken"
    shutil.copytree(page.parent, broken)
    (broken / "census.png").unlink()
    html = (broken / "index.html").read_text().replace("</body>", "<script>undefinedFunction();</script></body>")
    (broken / "index.html").write_text(html)
    attributes, console, _ = browse(broken / "index.html", tmp_path)
    assert attributes.get("loaded") == str(len(FIGURES) - 1)
    assert console, "a thrown error must show among the console messages"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def get(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=5) as answer:
        return json.loads(answer.read())


def test_optuna_dashboard_serves_the_study(study, tmp_path):
    dashboard = needs("optuna-dashboard")
    _, storage = study
    port = free_port()
    server = subprocess.Popen([dashboard, storage, "--host", "127.0.0.1", "--port", str(port), "--quiet"],
                              stdout=subprocess.DEVNULL, stderr=(tmp_path / "dashboard.log").open("w"))
    try:
        deadline, studies = time.monotonic() + 60, None
        while studies is None and time.monotonic() < deadline:
            try:
                studies = get(f"http://127.0.0.1:{port}/api/studies")["study_summaries"]
            except OSError:
                assert server.poll() is None, (tmp_path / "dashboard.log").read_text()
                time.sleep(0.3)
        assert studies is not None, "optuna-dashboard did not answer within 60 s"
        (ours,) = [s for s in studies if s["study_name"] == STUDY]
        detail = get(f"http://127.0.0.1:{port}/api/studies/{ours['study_id']}")
        measured = [t for t in detail["trials"] if any(a["key"] == "params_key" for a in t["user_attrs"])]
        assert len(measured) == 16
        assert any(a["key"] == "final_round" for a in detail["user_attrs"])
    finally:
        server.terminate()
        server.wait(timeout=10)
