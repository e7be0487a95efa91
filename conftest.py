"""pytest set-up shared by the unit tests and the notebooks (run through nbval).

- Without a CUDA GPU, TRITON_INTERPRET=1 is set here, before any test module defines a Triton kernel (and the
  interpreter gets the course's fix for Triton < 3.7 with NumPy >= 2.4, as the notebooks' setup() gives it).
- Under `python -m utils.course.gpu_suite` on a machine of several GPUs, each pytest-xdist worker (and every notebook
  kernel it starts) is given one GPU, round robin, before CUDA starts here.
- Notebook cells that start with `%%gpu`, and tests marked `@pytest.mark.gpu`, are reported as skipped on a
  machine without a CUDA GPU (in Jupyter the `%%gpu` magic skips them with a message).
- Tests marked `@pytest.mark.full` are the slow checks (every compile of a template, every learner notebook)
  that `make test` on a CPU samples instead of running all: they run on a CUDA machine (so in the GPU suite,
  which runs before every release) or anywhere with `pytest --full`.
- A notebook's kernel that dies while starting is started again (`retrying`), up to three times.
- Under pytest-xdist (`make test` runs `pytest -n auto`), each worker runs one CPU thread, and a notebook's
  cells stay together on one worker, in order, since they share one kernel; the notebooks are handed out first
  (the longest units of work), then the unit tests one by one, those marked `long` first.
"""
import os

# pytest-xdist starts a worker per core: one CPU thread each (and in the notebook kernels they start, which
# inherit it), or their threads contend for the same cores. Read by torch when it is imported, so set first.
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

from utils.course.gpu_suite import spread_to_worker

spread_to_worker()
CUDA = torch.cuda.is_available()
if not CUDA:
    os.environ["TRITON_INTERPRET"] = "1"
    from utils.triton_utils import fix_interpreter_scalars

    fix_interpreter_scalars()


def pytest_addoption(parser):
    parser.addoption("--full", action="store_true", default=False,
                     help="also run the tests marked full (always run on a CUDA machine)")


def give_back_cached_gpu_memory():
    """Hand this process's cached GPU blocks back to the device. Sixteen workers share one GPU; blocks one keeps
    cached are memory another's kernel launch cannot get (CUDA "out of memory" at launch)."""
    if CUDA:
        torch.cuda.empty_cache()


@pytest.fixture(autouse=True)
def _after_each_test():
    yield
    give_back_cached_gpu_memory()


KERNEL_START_TRIES = 3


def retrying(start, tries: int = KERNEL_START_TRIES):
    """`start` (jupyter_client's start_new_kernel, or a notebook run that starts its kernel), tried again when the
    kernel dies before it answers: with many notebooks starting at once, two kernels can be handed the same port.
    Each failed try shuts its kernel down. Any other error is raised at once."""
    def start_retrying(*args, **kwargs):
        for attempt in range(1, tries + 1):
            try:
                return start(*args, **kwargs)
            except RuntimeError as err:
                if attempt == tries or not any(s in str(err) for s in ("kernel_info", "heartbeats")):
                    raise
    start_retrying.retried = start
    return start_retrying


def pytest_configure(config):
    try:
        import nbval.kernel
    except ImportError:
        pass
    else:
        if not hasattr(nbval.kernel.start_new_kernel, "retried"):
            nbval.kernel.start_new_kernel = retrying(nbval.kernel.start_new_kernel)
    config.addinivalue_line("markers", "gpu: needs a CUDA GPU; skipped without one")
    config.addinivalue_line("markers", "capability(major, minor): needs a GPU at least this new (the emulated one "
                                       "under COURSE_EMULATE_GPU); skipped on older ones, as on a T4")
    config.addinivalue_line("markers", "full: a slow check that make test on a CPU samples; run on a GPU or with --full")
    config.addinivalue_line("markers", "long: a test of a minute or more: handed out first, so that it does not "
                                       "start last and hold up the end of the run")


def is_gpu_cell(item) -> bool:
    cell = getattr(item, "cell", None)  # nbval's notebook-cell items carry their cell
    return cell is not None and cell.get("source", "").lstrip().startswith("%%gpu")


def pytest_xdist_make_scheduler(config, log):
    """pytest-xdist's default distribution (`-n` alone), with each notebook kept whole on one worker."""
    if config.getoption("dist") != "load":
        return None   # a --dist the caller chose
    from xdist.scheduler import LoadScopeScheduling

    class NotebooksWhole(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            file = nodeid.split("::")[0]
            return file if file.endswith(".ipynb") else nodeid

    return NotebooksWhole(config, log)


def pytest_collection_modifyitems(config, items):
    # The long tests first, the rest as collected (a stable sort). pytest-xdist hands out the notebooks (units of
    # many items) before single tests, and single tests in this order.
    items.sort(key=lambda item: "long" not in item.keywords)
    if not CUDA and not config.getoption("--full"):
        skip_full = pytest.mark.skip(reason="a full-suite check: runs on a GPU or with pytest --full")
        for item in items:
            if "full" in item.keywords:
                item.add_marker(skip_full)
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


@pytest.fixture
def refusing():
    """refusing(too_big, tried, then): a stand-in for a step that takes tiles first (a launch, a config check).
    It records each tiles it is given in `tried`, raises Triton's shared-memory OutOfResources for `too_big`
    (as a launch that asks more than the GPU has), and otherwise returns then(tiles, ...)."""
    from triton.runtime.errors import OutOfResources

    def make(too_big, tried: list, then):
        def step(tiles, *args, **kwargs):
            tried.append(tiles)
            if tiles == too_big:
                raise OutOfResources(300_000, 232_448, "shared memory")
            return then(tiles, *args, **kwargs)
        return step

    return make
