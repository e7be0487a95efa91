"""The notebooks' bootstrap cell on a fresh Colab runtime, as far as a machine without Colab can test it:
google.colab importable, no course checkout in the working directory, `git clone` simulated by a copy."""
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

SCRIPT = """
import shutil, subprocess, sys, types
sys.modules["google"] = types.ModuleType("google")
sys.modules["google.colab"] = types.ModuleType("google.colab")
calls = []
def fake_run(cmd, check=False, **kwargs):
    calls.append(list(cmd))
    if cmd[:2] == ["git", "clone"]:
        shutil.copytree(REPO, cmd[-1], ignore=shutil.ignore_patterns(".git", ".venv", ".whl", "learner", "__pycache__"))
    return subprocess.CompletedProcess(cmd, 0)
subprocess.run = fake_run
exec(compile(CELL, "bootstrap cell", "exec"))
import json
print(json.dumps({"root": str(ROOT), "colab": env.colab, "device": str(env.device), "calls": calls,
                  "utils_from": sys.modules["utils"].__file__}))
"""


def bootstrap_cell():
    nb = json.loads((ROOT / "notebooks" / "00_setup.ipynb").read_text())
    return "".join(next(c for c in nb["cells"] if c["cell_type"] == "code")["source"])


def run_fresh_colab(cwd):
    code = f"REPO = {str(ROOT)!r}\nCELL = {bootstrap_cell()!r}\n" + SCRIPT
    done = subprocess.run([sys.executable, "-c", code], cwd=cwd, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_bootstrap_clones_once_and_installs_nothing_colab_has(tmp_path):
    first = run_fresh_colab(tmp_path)
    clone = tmp_path / "flash-attention-course"
    assert first["colab"] and first["root"] == str(clone)
    assert first["utils_from"].startswith(str(clone))          # the course is imported from the clone
    assert [c[:2] for c in first["calls"]] == [["git", "clone"]]  # extras present: no pip, never torch
    second = run_fresh_colab(tmp_path)
    assert second["calls"] == [] and second["root"] == str(clone)
