"""The GPU reports the repository keeps (python -m utils.course.gpu_suite): their shape, and the tree ids they carry."""
import json
import os
import re
import subprocess
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from utils.course import gpu_suite
from utils.course.gpu_suite import PARTS, ROOT, TRACKED_DIRS, Collector, report_path, summarize, tree_id

REPORTS = sorted((ROOT / "tests").glob("gpu_report*.json"))
# Under `python -m utils.course.gpu_suite` the reports are the files being rewritten: only the committed ones are checked.
committed_reports = pytest.mark.skipif(os.environ.get(gpu_suite.RUNNING_VAR) == "1",
                                       reason="the GPU suite is rewriting the reports")


def git(*args) -> str:
    return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True).stdout.strip()


@pytest.mark.parametrize("folder", TRACKED_DIRS)
def test_tree_id_equals_git_for_a_clean_folder(folder):
    if not git("rev-parse", "--git-dir"):
        pytest.skip("not a git checkout")
    if git("status", "--porcelain", "--", folder):
        pytest.skip(f"{folder}/ has uncommitted changes")
    assert tree_id(ROOT / folder) == git("rev-parse", f"HEAD:{folder}")


def test_tree_id_of_a_small_folder(tmp_path):
    (tmp_path / "a.txt").write_text("hi\n")
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "b.py").write_text("x = 1\n")
    (tmp_path / "__pycache__").mkdir()
    (tmp_path / "__pycache__" / "b.pyc").write_bytes(b"\0")
    (tmp_path / "empty").mkdir()
    subprocess.run(["git", "init", "-q", str(tmp_path)], check=True)
    subprocess.run(["git", "-C", str(tmp_path), "add", "a.txt", "sub"], check=True)
    expected = subprocess.run(["git", "-C", str(tmp_path), "write-tree"], capture_output=True, text=True).stdout
    assert tree_id(tmp_path) == expected.strip()


def test_collector_counts_outcomes_per_file():
    c = Collector()
    for nodeid, when, outcome in [("tests/a.py::t1", "setup", "passed"), ("tests/a.py::t1", "call", "passed"),
                                  ("tests/a.py::t2", "setup", "skipped"), ("tests/a.py::t3", "call", "failed"),
                                  ("nb.ipynb::Cell 0", "call", "passed"), ("nb.ipynb::Cell 1", "teardown", "failed")]:
        c.pytest_runtest_logreport(SimpleNamespace(nodeid=nodeid, when=when, outcome=outcome, duration=0.5,
                                                   failed=outcome == "failed", skipped=outcome == "skipped"))
    assert dict(c.files["tests/a.py"]) == dict(passed=1, failed=1, skipped=1, seconds=2.0)
    assert c.files["nb.ipynb"]["failed"] == 1 and list(c.failures) == ["tests/a.py::t3 (call)",
                                                                          "nb.ipynb::Cell 1 (teardown)"]


def test_a_rerun_replaces_a_files_old_failures_collection_errors_included():
    old = dict(files={"tests/a.py": dict(passed=0, failed=1, skipped=0, seconds=1.0),
                      "tests/b.py": dict(passed=0, failed=1, skipped=0, seconds=1.0)},
               failures={"tests/a.py (collection)": "ImportError", "tests/b.py::t (call)": "assert"})
    c = Collector()
    c.pytest_runtest_logreport(SimpleNamespace(nodeid="tests/a.py::t", when="call", outcome="passed", duration=0.5,
                                               failed=False, skipped=False))
    results = summarize(c, old)
    assert results["failures"] == {"tests/b.py::t (call)": "assert"}
    assert results["totals"] == dict(passed=1, failed=1, skipped=0)


def test_a_file_cut_before_its_first_outcome_keeps_its_old_results():
    old = dict(files={"tests/a.py": dict(passed=7, failed=1, skipped=0, seconds=9.0)},
               failures={"tests/a.py::t (call)": "assert"})
    c = Collector()   # a test's set-up passed, then the run was cut while it ran
    c.pytest_runtest_logreport(SimpleNamespace(nodeid="tests/a.py::t", when="setup", outcome="passed",
                                               duration=0.1, failed=False, skipped=False))
    results = summarize(c, old)
    assert results["files"] == old["files"] and results["failures"] == old["failures"]
    assert results["totals"] == dict(passed=7, failed=1, skipped=0)


def test_collected_counts_show_the_files_a_run_cut():
    c = Collector()
    c.pytest_collection_finish(SimpleNamespace(items=[SimpleNamespace(nodeid=n) for n in (
        "tests/a.py::t1", "tests/a.py::t2", "nb.ipynb::Cell 0")]))
    c.pytest_xdist_node_collection_finished(node=None, ids=["tests/a.py::t1", "tests/a.py::t2", "tests/b.py::t"])
    c.pytest_runtest_logreport(SimpleNamespace(nodeid="tests/a.py::t1", when="call", outcome="passed",
                                               duration=0.5, failed=False, skipped=False))
    old = dict(files={"nb.ipynb": dict(passed=1, failed=0, skipped=0, seconds=1.0)}, failures={})
    results = summarize(c, old)
    assert results["files"]["tests/a.py"]["collected"] == 2
    assert results["files"]["tests/b.py"] == dict(passed=0, failed=0, skipped=0, seconds=0.0, collected=1)
    assert results["files"]["nb.ipynb"] == old["files"]["nb.ipynb"]   # never started here: old results stay
    assert gpu_suite.unfinished(results) == {"tests/a.py": (1, 2), "tests/b.py": (0, 1)}
    c.pytest_runtest_logreport(SimpleNamespace(nodeid="tests/a.py::t2", when="setup", outcome="skipped",
                                               duration=0.1, failed=False, skipped=True))
    assert "tests/a.py" not in gpu_suite.unfinished(summarize(c, old))


def test_report_paths():
    assert report_path(None) == ROOT / "tests" / "gpu_report.json"
    assert report_path("t4") == ROOT / "tests" / "gpu_report_t4.json"


@committed_reports
def test_the_h200_report_exists():
    assert report_path(None) in REPORTS, "run `python -m utils.course.gpu_suite` on a GPU and commit tests/gpu_report.json"


@committed_reports
@pytest.mark.parametrize("path", REPORTS, ids=lambda p: p.name)
def test_report_shape(path: Path):
    report = json.loads(path.read_text())
    env = report["environment"]
    for key in ("gpu", "capability", "driver", "cuda", "cudnn", "torch", "triton", "python", "date", "command"):
        assert env.get(key) not in (None, ""), f"{path.name}: environment.{key} is missing"
    assert ("emulate t4" in env["command"]) == (env["emulated"] == "t4") == path.name.endswith("_t4.json")
    assert set(report["trees"]) == set(TRACKED_DIRS)
    assert all(re.fullmatch(r"[0-9a-f]{40}", t) for t in report["trees"].values())
    assert set(report["parts"]) == set(PARTS), "both parts: the unit tests and the notebooks"
    for name, part in report["parts"].items():
        files = part["files"]
        assert files and all(set(f) in ({"passed", "failed", "skipped", "seconds"},
                                         {"passed", "failed", "skipped", "seconds", "collected"})
                             for f in files.values())
        assert not gpu_suite.unfinished(part), f"{path.name}: files cut before their end (rerun with --files)"
        for key in ("passed", "failed", "skipped"):
            assert part["totals"][key] == sum(f[key] for f in files.values())
        assert part["totals"]["failed"] == len(part["failures"])
    notebooks = {Path(f).name for f in report["parts"]["notebooks"]["files"]}
    if report["trees"]["notebooks"] == tree_id(ROOT / "notebooks"):   # an older report ran the notebooks of its day
        assert notebooks == {p.name for p in (ROOT / "notebooks").glob("*.ipynb")}, "every notebook ran"
    assert report["totals"] == {k: sum(p["totals"][k] for p in report["parts"].values())
                                for k in ("passed", "failed", "skipped")}
    if path == report_path(None) or "runs" in report:   # reports since the suite timed itself
        assert report["runs"] and all(run["seconds"] > 0 for run in report["runs"]), "each run's wall-clock time"


def test_notebooks_run_whole_on_one_worker():
    """conftest.py's scheduler for pytest-xdist: a notebook's cells are one unit of work, a test is one by itself."""
    import conftest
    from xdist.scheduler import LoadScopeScheduling

    config = SimpleNamespace(getoption=lambda name: "load", getvalue={"tx": ["2*popen"]}.get,
                             option=SimpleNamespace(loadscopereorder=True))
    sched = conftest.pytest_xdist_make_scheduler(config, log=None)
    assert isinstance(sched, LoadScopeScheduling)
    assert sched._split_scope("notebooks/05a_triton_debugging.ipynb::Cell 12") == "notebooks/05a_triton_debugging.ipynb"
    assert sched._split_scope("tests/test_x.py::test_y[a::b]") == "tests/test_x.py::test_y[a::b]"
    config.getoption = lambda name: "loadfile"
    assert conftest.pytest_xdist_make_scheduler(config, log=None) is None   # a --dist of the caller's choice


def test_one_run_is_split_into_its_parts():
    c = Collector()
    for nodeid, outcome in (("tests/a.py::t", "passed"), ("notebooks/00_setup.ipynb::Cell 0", "passed"),
                            ("notebooks/00_setup.ipynb::Cell 1", "failed")):
        c.pytest_runtest_logreport(SimpleNamespace(nodeid=nodeid, when="call", outcome=outcome, duration=1.0,
                                                   failed=outcome == "failed", skipped=False, longreprtext="x"))
    c.pytest_collectreport(SimpleNamespace(nodeid="", failed=True, longreprtext="import error"))
    tests, notebooks = summarize(c, part="tests"), summarize(c, part="notebooks")
    assert set(tests["files"]) == {"tests/a.py", "collection"} and tests["totals"]["failed"] == 1
    assert set(notebooks["files"]) == {"notebooks/00_setup.ipynb"}
    assert notebooks["totals"] == dict(passed=1, failed=1, skipped=0) and len(notebooks["failures"]) == 1
    assert gpu_suite.part_of("tests/a.py") == "tests" and gpu_suite.part_of("collection") is None


def test_a_run_of_some_files_keeps_the_others_results():
    c = Collector()
    c.pytest_runtest_logreport(SimpleNamespace(nodeid="tests/b.py::t", when="call", outcome="failed", duration=1.0,
                                               failed=True, skipped=False, longreprtext="boom"))
    old = dict(files={"tests/a.py": dict(passed=3, failed=0, skipped=1, seconds=2.0),
                      "tests/b.py": dict(passed=5, failed=0, skipped=0, seconds=1.0)}, failures={})
    merged = summarize(c, old)
    assert merged["totals"] == dict(passed=3, failed=1, skipped=1) and merged["failures"] == {"tests/b.py::t (call)": "boom"}


class FakeBuild:
    """Stands in for the background build of the CUDA extensions: still running until the suite stops it."""

    def __init__(self, log, started):
        started.append(self)
        self.log, self.stopped = log, False

    def poll(self):
        return 0 if self.stopped else None

    def terminate(self):
        self.stopped = True

    def wait(self):
        return 0


def fake_prebuild(monkeypatch) -> list:
    """Replace gpu_suite's background build; returns the list of the builds main() starts."""
    started = []
    monkeypatch.setattr(gpu_suite, "start_prebuild", lambda log: FakeBuild(log, started))
    return started


def test_main_writes_a_report_per_part(tmp_path, monkeypatch):
    """The command's bookkeeping, with pytest itself replaced (the real thing needs a GPU)."""
    import torch

    monkeypatch.setenv("COURSE_EMULATE_GPU", "")  # restored after the test: main() sets it for --emulate
    monkeypatch.setenv(gpu_suite.RUNNING_VAR, "")  # and this one always
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(gpu_suite, "tree_id", lambda path: path.name * 5)
    monkeypatch.setattr("utils.gpu.environment", lambda command: {"command": command})
    runs = []

    def fake_run_parts(parts, files, pytest_args, old, save):
        runs.append((tuple(parts), tuple(files), tuple(pytest_args)))
        results = {part: summarize(Collector(), old.get(part), part) for part in parts}
        save(results)   # as a file finishes: the report already holds this run, not finished
        assert json.loads(report.read_text())["runs"][-1]["finished"] is False
        return results, 0

    monkeypatch.setattr(gpu_suite, "run_parts", fake_run_parts)
    prebuilds = fake_prebuild(monkeypatch)
    report = tmp_path / "r.json"
    assert gpu_suite.main(["--report", str(report), "--", "-n", "4"]) == 0
    assert runs == [(("tests", "notebooks"), (), ("-n", "4"))]   # one session: the workers share both parts
    assert len(prebuilds) == 1 and prebuilds[0].stopped and prebuilds[0].log.name == "gpu_suite_prebuild.log"
    data = json.loads(report.read_text())
    assert data["environment"]["command"] == "python -m utils.course.gpu_suite -- -n 4"   # how it ran: pytest-xdist
    assert set(data["parts"]) == {"tests", "notebooks"} and data["trees"] == {"utils": "utils" * 5,
                                                                             "notebooks": "notebooks" * 5}
    assert [run["files"] for run in data["runs"]] == [[]] and data["runs"][0]["seconds"] >= 0
    assert data["runs"][0]["finished"] is True
    assert gpu_suite.main(["--report", str(report), "--files", "notebooks/00_setup.ipynb"]) == 0
    assert runs[-1] == (("notebooks",), ("notebooks/00_setup.ipynb",), ())
    assert [run["files"] for run in json.loads(report.read_text())["runs"]] == [[], ["notebooks/00_setup.ipynb"]]
    assert gpu_suite.main(["--report", str(report), "--part", "tests", "--files", "notebooks/00_setup.ipynb"]) == 2
    assert gpu_suite.main(["--report", str(report), "--files", "notebooks/00_setup.ipynb", "--emulate", "t4"]) == 0
    assert json.loads(report.read_text())["environment"]["command"] == "python -m utils.course.gpu_suite --emulate t4"
    assert gpu_suite.main(["--report", str(report), "--no-prebuild", "--files", "notebooks/00_setup.ipynb"]) == 0
    assert len(prebuilds) == 3   # one per run above that built, none for --no-prebuild
    assert gpu_suite.main(["--report", str(report), "--part", "notebooks", "--no-prebuild"]) == 0
    data = json.loads(report.read_text())   # a part's run says which part it was, in the command and the runs
    assert data["environment"]["command"] == "python -m utils.course.gpu_suite --part notebooks"
    assert data["runs"][-1]["part"] == "notebooks" and data["runs"][-2]["part"] == "all"


def test_workers_are_spread_round_robin_over_the_gpus(monkeypatch):
    assert [gpu_suite.worker_gpu(f"gw{i}", "0,1,2") for i in range(5)] == ["0", "1", "2", "0", "1"]
    assert gpu_suite.worker_gpu("gw3", "5,7") == "7"
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,6")
    assert gpu_suite.visible_gpus(2) == "4,6"
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert gpu_suite.visible_gpus(3) == "0,1,2"
    monkeypatch.setenv(gpu_suite.SPREAD_VAR, "0,1,2,3")
    monkeypatch.setenv("PYTEST_XDIST_WORKER", "gw6")
    gpu_suite.spread_to_worker()
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "2"
    monkeypatch.delenv("PYTEST_XDIST_WORKER")   # the controller (and a run without -n) keeps every GPU
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1,2,3")
    gpu_suite.spread_to_worker()
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "0,1,2,3"


@pytest.mark.parametrize("count,spread", [(1, None), (4, "0,1,2,3")])
def test_main_spreads_the_workers_only_over_several_gpus(tmp_path, monkeypatch, count, spread):
    import torch

    monkeypatch.setenv(gpu_suite.RUNNING_VAR, "")
    monkeypatch.delenv(gpu_suite.SPREAD_VAR, raising=False)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)
    monkeypatch.setattr("utils.gpu.environment", lambda command: {"command": command})
    seen = []

    def fake_run_parts(parts, files, pytest_args, old, save):
        seen.append(os.environ.get(gpu_suite.SPREAD_VAR))
        results = {part: summarize(Collector(), old.get(part), part) for part in parts}
        save(results)
        return results, 0

    monkeypatch.setattr(gpu_suite, "run_parts", fake_run_parts)
    prebuilds = fake_prebuild(monkeypatch)
    report = tmp_path / "r.json"
    assert gpu_suite.main(["--report", str(report), "--part", "tests"]) == 0
    assert seen == [spread] and json.loads(report.read_text())["environment"]["gpus"] == count


@committed_reports
def test_readme_and_instructors_give_the_gpu_suites_time_from_its_report():
    """The minutes README and INSTRUCTORS give for the GPU suite are the committed report's runs, added up."""
    report = json.loads(report_path(None).read_text())
    minutes = f"{sum(run['seconds'] for run in report['runs']) / 60:.1f}"
    for doc in ("README.md", "INSTRUCTORS.md"):
        text = " ".join((ROOT / doc).read_text().split())
        found = re.findall(r"GPU suite.{0,80}? took (\d+\.\d) minutes", text)
        assert found == [minutes], f"{doc} gives {found} for the GPU suite; its report says {minutes} minutes"


def test_a_notebook_kernel_that_dies_while_starting_is_started_again():
    import conftest

    calls = []

    def flaky(*args, **kwargs):
        calls.append(args)
        if len(calls) < conftest.KERNEL_START_TRIES:
            raise RuntimeError("Kernel died before replying to kernel_info")
        return "kernel"

    assert conftest.retrying(flaky)("python3") == "kernel" and len(calls) == conftest.KERNEL_START_TRIES
    calls.clear()

    def dead(*args, **kwargs):
        calls.append(args)
        raise RuntimeError("Kernel died before replying to kernel_info")

    with pytest.raises(RuntimeError, match="kernel_info"):
        conftest.retrying(dead)()
    assert len(calls) == conftest.KERNEL_START_TRIES
    calls.clear()

    def broken(*args, **kwargs):   # not a kernel dying at start: raised at once
        calls.append(args)
        raise RuntimeError("a cell failed")

    with pytest.raises(RuntimeError, match="a cell failed"):
        conftest.retrying(broken)()
    assert len(calls) == 1
    import nbval.kernel

    assert nbval.kernel.start_new_kernel.retried   # conftest wrapped nbval's kernel start


def test_long_tests_are_collected_first():
    """conftest.py puts the tests marked long first (pytest-xdist hands single tests out in that order), keeping
    the order of the rest."""
    import conftest

    items = [SimpleNamespace(keywords=set(k), get_closest_marker=lambda name: None)   # conftest asks it on a GPU
             for k in (["a"], ["long"], ["b"], ["long", "full"], ["c"])]
    names = [id(i) for i in items]
    config = SimpleNamespace(getoption=lambda name: True)
    conftest.pytest_collection_modifyitems(config, items)
    assert [names.index(id(i)) for i in items] == [1, 3, 0, 2, 4]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_each_test_gives_back_its_cached_gpu_memory():
    """What conftest's autouse fixture calls after every test hands back every segment the allocator caches in
    its default pool. (A CUDA graph's private pool, which an earlier test in this worker may have left, keeps its
    segments while the graph lives: empty_cache leaves them by design.)"""
    import conftest

    def cached_segments():   # default-pool segments of which no block is in use: what empty_cache gives back
        return [s for s in torch.cuda.memory_snapshot() if tuple(s["segment_pool_id"]) == (0, 0)
                and all(b["state"] == "inactive" for b in s["blocks"])]

    block = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")   # 1 GiB: a segment of its own
    del block
    assert cached_segments(), "the freed block should stay cached until the cache is emptied"
    conftest.give_back_cached_gpu_memory()
    assert not cached_segments()


def test_a_complete_run_lists_only_itself():
    """Runs of some files or one part add to the earlier runs of the same trees; a complete run starts afresh."""
    trees = {"utils": "a", "notebooks": "b"}
    old = dict(trees=trees, runs=[dict(files=[], seconds=500.0, finished=False)])
    assert gpu_suite.kept_runs(old, trees, [], "all") == []
    assert gpu_suite.kept_runs(old, trees, ["tests/test_x.py"], "all") == old["runs"]
    assert gpu_suite.kept_runs(old, trees, [], "tests") == old["runs"]
    assert gpu_suite.kept_runs(old, dict(trees, utils="c"), ["tests/test_x.py"], "all") == []
