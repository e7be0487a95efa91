"""Time `make test` as CI runs it, from fresh clones of this repository's HEAD, and store the times in
tests/make_test_report.json (README and INSTRUCTORS quote them; tests/test_repo.py holds them equal).

    python3 .ci/time_make_test.py            # about 15 minutes on two cores: nothing else should run meanwhile

Two clones: the first runs `make install` then `make test` (what CI runs, install included); the second, with
the first's virtual environment, runs the unit tests alone (`pytest -n auto tests`, as `make test` calls
pytest). Both start with empty build folders, as CI does.
"""
import datetime
import json
import os
import platform
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "tests" / "make_test_report.json"


def timed(command, cwd, log):
    """Run `command` (a list) in `cwd`, its output into `log`; return (seconds, the output's last line)."""
    start = time.monotonic()
    with open(log, "w") as f:
        done = subprocess.run(command, cwd=cwd, stdout=f, stderr=subprocess.STDOUT)
    seconds = time.monotonic() - start
    last = Path(log).read_text().strip().splitlines()[-1]
    if done.returncode:
        sys.exit(f"{' '.join(command)} failed ({done.returncode}); see {log}: {last}")
    return round(seconds, 1), last


def summary(line):
    """'2756 passed, 532 skipped' from pytest's last line."""
    return ", ".join(re.findall(r"\d+ (?:passed|skipped|failed|xfailed|errors?)", line))


def main():
    commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                            check=True).stdout.strip()
    work = Path(tempfile.mkdtemp(prefix="time_make_test_"))
    first, second = work / "first", work / "second"
    for clone in (first, second):
        subprocess.run(["git", "clone", "-q", str(ROOT), str(clone)], check=True)
    install, _ = timed(["make", "install"], first, work / "install.log")
    test, last = timed(["make", "test"], first, work / "test.log")
    (second / ".venv").symlink_to(first / ".venv")
    env_pytest = ["env", "-u", "PYTHONDONTWRITEBYTECODE", ".venv/bin/pytest", "-n", "auto", "tests"]
    unit, unit_last = timed(env_pytest, second, work / "unit.log")
    report = dict(commit=commit, date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                  cpus=os.cpu_count(), machine=platform.machine(), python=platform.python_version(),
                  command="python3 .ci/time_make_test.py", install_s=install, test_s=test,
                  total_s=round(install + test, 1), result=summary(last), unit_tests_s=unit,
                  unit_tests_result=summary(unit_last))
    OUT.write_text(json.dumps(report, indent=1) + "\n")
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
