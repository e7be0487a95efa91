"""pytest set-up shared by the unit tests and the notebooks (run through nbval).

- Without a CUDA GPU, TRITON_INTERPRET=1 is set here, before any test module defines a Triton kernel (and the
  interpreter gets the course's fix for Triton < 3.7 with NumPy >= 2.4, as the notebooks' setup() gives it).
- Under `python -m utils.gpu_suite` on a machine of several GPUs, each pytest-xdist worker (and every notebook
  kernel it starts) is given one GPU, round robin, before CUDA starts here.
- Notebook cells that start with `%%gpu`, and tests marked `@pytest.mark.gpu`, are reported as skipped on a
  machine without a CUDA GPU (in Jupyter the `%%gpu` magic skips them with a message).
"""
import os

import pytest
import torch

from utils.gpu_suite import spread_to_worker

spread_to_worker()
CUDA = torch.cuda.is_available()
if not CUDA:
    os.environ["TRITON_INTERPRET"] = "1"
    from utils.triton_utils import fix_interpreter_scalars

    fix_interpreter_scalars()


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a CUDA GPU; skipped without one")
    config.addinivalue_line("markers", "capability(major, minor): needs a GPU at least this new (the emulated one "
                                       "under COURSE_EMULATE_GPU); skipped on older ones, as on a T4")


def is_gpu_cell(item) -> bool:
    cell = getattr(item, "cell", None)  # nbval's notebook-cell items carry their cell
    return cell is not None and cell.get("source", "").lstrip().startswith("%%gpu")


def pytest_collection_modifyitems(config, items):
    if CUDA:
        from utils import gpu

        have = gpu.capability()
        for item in items:
            marker = item.get_closest_marker("capability")
            if marker is not None and have < tuple(marker.args):
                need = "sm_{}{}".format(*marker.args)
                item.add_marker(pytest.mark.skip(reason=f"needs {need}+; this GPU is sm_{have[0]}{have[1]}"))
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords or is_gpu_cell(item):
            item.add_marker(skip)
