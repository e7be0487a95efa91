"""Run the whole test suite on a CUDA machine and write the report the repository keeps (tests/gpu_report*.json).

    python -m utils.course.gpu_suite -- -n 16             # unit tests and every notebook: tests/gpu_report.json
    python -m utils.course.gpu_suite --part notebooks     # one part (a long suite can be run in two sittings)
    python -m utils.course.gpu_suite --emulate t4         # as on Colab's T4 (utils/gpu.py): tests/gpu_report_t4.json

With -n (pytest-xdist) the unit tests and the notebooks run in one session, shared out together over the
workers (each notebook whole on one worker); on several GPUs each worker is given one.
CPU CI skips every `%%gpu` cell and GPU test, and samples the checks marked `full` (conftest.py); this suite
runs them all, so this is what says the course works where learners run it.
The report records the machine (GPU, capability, driver, CUDA, cuDNN, torch, Triton), passed / failed /
skipped, collected and seconds per test file and per notebook (a file with fewer outcomes than collected tests
was cut: rerun it with --files), the failures' names, and the git tree ids of utils/ and
notebooks/ that ran, computed from the files themselves (a copy of the repository without its history works),
and each run's part, files and wall-clock seconds (`runs`; `finished` false: cut before its end). Running one part keeps the
other part's results only if they came from the same trees.

On a fresh machine most of the suite's time is nvcc building the CUDA extensions. So, unless --no-prebuild, a
background `python -m utils.native.build build` starts them all at once, several at a time, while the tests run; a
test that needs an extension waits on that build's lock instead of starting it late.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PARTS = {"tests": ["tests"], "notebooks": ["notebooks"]}
TRACKED_DIRS = ("utils", "notebooks")
IGNORED_NAMES = {".git", "__pycache__", ".ipynb_checkpoints"}   # what git keeps out of those folders
IGNORED_SUFFIXES = (".pyc",)
RUNNING_VAR = "COURSE_GPU_SUITE"   # set while the suite runs: tests of the committed reports skip (being rewritten)
SPREAD_VAR = "COURSE_GPU_SPREAD"   # the GPUs the suite's pytest-xdist workers share out, e.g. "0,1,2,3"


def start_prebuild(log: Path):
    """Start building every CUDA extension this GPU runs, in a background process writing to `log`."""
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "w") as out:
        return subprocess.Popen([sys.executable, "-m", "utils.native.build", "build"], cwd=ROOT, stdout=out,
                                stderr=subprocess.STDOUT, env=dict(os.environ, TQDM_DISABLE="1"))


def worker_gpu(worker: str, gpus: str) -> str:
    """The GPU pytest-xdist's worker `worker` ('gw5') runs on, round robin over `gpus` ('0,1,2,3' -> '1')."""
    ids = gpus.split(",")
    return ids[int(worker.removeprefix("gw")) % len(ids)]


def spread_to_worker() -> None:
    """In a pytest-xdist worker of a suite spread over several GPUs, make one GPU visible to this process and to
    the notebook kernels it starts. Called by conftest.py before CUDA starts (CUDA reads the variable once)."""
    gpus, worker = os.environ.get(SPREAD_VAR), os.environ.get("PYTEST_XDIST_WORKER")
    if gpus and worker:
        os.environ["CUDA_VISIBLE_DEVICES"] = worker_gpu(worker, gpus)


def visible_gpus(count: int) -> str:
    """The ids of the `count` GPUs this process sees, as CUDA_VISIBLE_DEVICES names them ('0,1' by default)."""
    named = [d.strip() for d in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if d.strip()]
    return ",".join(named[:count] if len(named) >= count else map(str, range(count)))


def report_path(emulate: str | None) -> Path:
    return ROOT / "tests" / (f"gpu_report_{emulate}.json" if emulate else "gpu_report.json")


def tree_id(path: Path) -> str:
    """The git tree id (SHA-1) of the folder `path` as it is on disk, ignored files left out: equal to
    `git rev-parse HEAD:<folder>` when the folder matches the commit."""
    entries = []
    for child in path.iterdir():
        if child.name in IGNORED_NAMES or child.name.endswith(IGNORED_SUFFIXES) or child.is_symlink():
            continue
        if child.is_dir():
            sha = tree_id(child)
            if sha is None:
                continue
            entries.append((child.name + "/", b"40000 " + child.name.encode(), sha))
        else:
            data = child.read_bytes()
            blob = hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()
            mode = b"100755" if os.access(child, os.X_OK) else b"100644"
            entries.append((child.name, mode + b" " + child.name.encode(), blob))
    if not entries:
        return None  # git keeps no empty folders
    body = b"".join(head + b"\0" + bytes.fromhex(sha) for _, head, sha in sorted(entries))
    return hashlib.sha1(b"tree %d\0" % len(body) + body).hexdigest()


class Collector:
    """A pytest plugin that tallies outcomes per file (a test module or a notebook) and how many tests each
    file collected; `on_file_done(self)` is called as each file finishes, so a run cut short still leaves its
    results, and the counts show which files it cut."""

    def __init__(self, on_file_done=None):
        self.files = defaultdict(lambda: dict(passed=0, failed=0, skipped=0, seconds=0.0))
        self.collected = {}
        self.failures = {}
        self.on_file_done = on_file_done
        self._last = None

    def _count(self, nodeids):
        counts = defaultdict(int)
        for nodeid in nodeids:
            counts[nodeid.split("::")[0]] += 1
        self.collected.update(counts)

    def pytest_collection_finish(self, session):   # after -k/-m deselection
        self._count(item.nodeid for item in session.items)

    @pytest.hookimpl(optionalhook=True)   # pytest-xdist's: its workers collect, the controller counts
    def pytest_xdist_node_collection_finished(self, node, ids):
        self._count(ids)

    def pytest_runtest_logreport(self, report):
        file = report.nodeid.split("::")[0]
        if self._last not in (None, file) and self.on_file_done:
            self.on_file_done(self)
        self._last = file
        stats = self.files[file]
        stats["seconds"] += report.duration
        if report.when == "call":
            outcome = report.outcome
        elif report.failed:                       # an error in set-up or teardown
            outcome = "failed"
        elif report.when == "setup" and report.skipped:   # skip markers act at set-up
            outcome = "skipped"
        else:
            return
        stats[outcome] += 1
        if outcome == "failed":
            self.failures[f"{report.nodeid} ({report.when})"] = getattr(report, "longreprtext", "")[-4000:]

    def pytest_collectreport(self, report):
        if report.failed:
            self.files[report.nodeid or "collection"]["failed"] += 1
            self.failures[f"{report.nodeid} (collection)"] = getattr(report, "longreprtext", "")[-4000:]


def _file_of(failure: str) -> str:
    """The file a failure's key names: 'tests/a.py::t (call)' and 'tests/a.py (collection)' -> 'tests/a.py'."""
    return failure.split("::")[0].removesuffix(" (collection)")


def part_of(file: str) -> str | None:
    """The part a file of the run belongs to ('tests/a.py' -> 'tests'), or None (a collection error's 'collection')."""
    return next((name for name, (folder,) in PARTS.items() if file.startswith(folder + "/")), None)


def summarize(collector: Collector, old: dict | None = None, part: str | None = None) -> dict:
    """A part's results (`part`: only its files; None: every file): this run's files on top of `old`'s (a run of
    some files keeps the others')."""
    def mine(file: str) -> bool:   # a collection error outside both folders counts with the tests
        return part is None or (part_of(file) or "tests") == part

    # A file cut before its first outcome (its first test was still running) has no results: keep old's.
    ran = {name: stats for name, stats in collector.files.items()
           if stats["passed"] + stats["failed"] + stats["skipped"] and mine(name)}
    files = dict((old or {}).get("files", {}))
    files.update({name: dict(stats, seconds=round(stats["seconds"], 1)) for name, stats in ran.items()})
    for name, count in collector.collected.items():   # collected: how many of a file's tests were to run
        if not mine(name):
            continue
        if name in ran:
            files[name]["collected"] = count
        elif name not in files:                        # cut before its first outcome, with no old results
            files[name] = dict(passed=0, failed=0, skipped=0, seconds=0.0, collected=count)
    failures = {k: v for k, v in (old or {}).get("failures", {}).items() if _file_of(k) not in ran}
    failures.update({k: v for k, v in collector.failures.items() if mine(_file_of(k))})
    totals = {k: sum(f[k] for f in files.values()) for k in ("passed", "failed", "skipped")}
    return dict(totals=totals, files=dict(sorted(files.items())), failures=failures)


def unfinished(results: dict) -> dict:
    """{file: (outcomes, collected)} for the files of a part's results that a run cut before their end."""
    counts = {name: (f["passed"] + f["failed"] + f["skipped"], f.get("collected")) for name, f in results["files"].items()}
    return {name: (done, total) for name, (done, total) in counts.items() if total is not None and done < total}


def kept_runs(old: dict, trees: dict, files, part: str) -> list:
    """The earlier runs a new run's report lists beside its own: those of the same trees, unless the new run is
    complete (every part, every file), whose results replace theirs."""
    if old.get("trees") != trees or (not files and part == "all"):
        return []
    return list(old.get("runs", []))


def run_parts(parts, files=(), pytest_args=(), old: dict | None = None, save=lambda results: None):
    """Run `parts` (all of their files, or `files` of them) in one pytest session, so that pytest-xdist's workers
    share the unit tests and the notebooks out together; returns ({part: results}, pytest's exit code).
    `old` is {part: results} kept from the same trees; `save({part: results})` is called as files finish."""
    old = old or {}

    def results(collector):
        return {part: summarize(collector, old.get(part) if files else None, part) for part in parts}

    collector = Collector(on_file_done=lambda c: save(results(c)))
    paths = list(files) or [PARTS[part][0] for part in parts]
    # Under -n, conftest.py keeps each notebook whole on one worker (its cells share one kernel).
    code = pytest.main([*paths, "-p", "no:cacheprovider", "-q", *pytest_args], plugins=[collector])
    return results(collector), int(code)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--part", choices=[*PARTS, "all"], default="all")
    parser.add_argument("--emulate", default=None, help="a GPU profile of utils/gpu.py, e.g. t4")
    parser.add_argument("--report", type=Path, default=None, help="default: tests/gpu_report[_<profile>].json")
    parser.add_argument("--files", nargs="+", default=[], help="run only these test files / notebooks; the "
                        "report keeps the other files' results from the same trees")
    parser.add_argument("--no-prebuild", action="store_true", help="do not build the CUDA extensions in the "
                        "background while the tests run (each is then built by the first test that needs it)")
    parser.add_argument("pytest_args", nargs="*", help="passed on to pytest (after --), e.g. -- -n 16")
    args = parser.parse_args(argv)

    from utils import gpu

    if args.emulate:
        os.environ[gpu.EMULATE_VAR] = args.emulate
        gpu.emulated()  # an unknown profile fails here, before anything runs
    else:
        os.environ.pop(gpu.EMULATE_VAR, None)
    import torch

    if not torch.cuda.is_available():
        print("no CUDA GPU here: this command runs the suite on one (CPU runs: make test)", file=sys.stderr)
        return 2
    path = args.report or report_path(args.emulate)
    os.environ[RUNNING_VAR] = "1"   # inherited by pytest-xdist's workers
    gpus = torch.cuda.device_count()
    if gpus > 1:   # the workers share the GPUs out (a run without -n uses the first)
        os.environ[SPREAD_VAR] = visible_gpus(gpus)
    trees = {d: tree_id(ROOT / d) for d in TRACKED_DIRS}
    old = json.loads(path.read_text()) if path.is_file() else {}
    parts = {name: p for name, p in old.get("parts", {}).items() if old.get("trees") == trees}
    command = " ".join(["python -m utils.course.gpu_suite", *(["--emulate", args.emulate] if args.emulate else []),
                        *(["--part", args.part] if args.part != "all" else []),
                        *(["--", *args.pytest_args] if args.pytest_args else [])])   # -n: run by pytest-xdist

    runs = kept_runs(old, trees, args.files, args.part)

    start = time.monotonic()

    def save(results, finished=False):
        # Saved as files finish too, so a run cut short still says how long it ran and that it was cut.
        parts.update(results)
        totals = {k: sum(p["totals"][k] for p in parts.values()) for k in ("passed", "failed", "skipped")}
        done = runs + [dict(part=args.part, files=args.files, seconds=round(time.monotonic() - start, 1),
                            finished=finished)]
        path.write_text(json.dumps(dict(environment=dict(gpu.environment(command), gpus=gpus), trees=trees,
                                        parts=parts, totals=totals, runs=done), indent=1) + "\n")
        return totals

    chosen = [part for part in (list(PARTS) if args.part == "all" else [args.part])
              if not args.files or any(part_of(f) == part for f in args.files)]
    if not chosen:
        print(f"--files names nothing of {args.part}: {args.files}", file=sys.stderr)
        return 2
    files = [f for f in args.files if part_of(f) in chosen]
    prebuild = None if args.no_prebuild else start_prebuild(ROOT / "build" / "gpu_suite_prebuild.log")
    try:
        results, code = run_parts(chosen, files, args.pytest_args, {p: parts.get(p) for p in chosen}, save=save)
    finally:
        if prebuild is not None and prebuild.poll() is None:   # the tests are done: its builds are not needed
            prebuild.terminate()
            prebuild.wait()
    seconds = time.monotonic() - start
    totals = save(results, finished=True)
    print(f"{path.name}: {totals} in {seconds / 60:.1f} minutes")
    for part in chosen:
        for name, (done, total) in unfinished(results[part]).items():
            print(f"  cut before its end: {name} ({done} of {total}); rerun it with --files")
    # pytest's 0: all passed; 5: nothing collected
    return 0 if code in (0, 5) else 1


if __name__ == "__main__":
    sys.exit(main())
