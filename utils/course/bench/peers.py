"""Outside kernels the benchmarks measure beside the course's: the official Triton tutorial's fused attention,
and FlashAttention-4 (the `flash-attn-4` package) where it is installed.

The tutorial (`python/tutorials/06-fused-attention.py` of the Triton repository) is not in the Triton wheel and
is never copied into this repository: the benchmarks import it at run time from its own file, named by
`--tutorial PATH` or the TRITON_TUTORIAL_ATTENTION environment variable, and record the file's path, its
SHA-256 and the git ref it came from (`--tutorial-ref`), so a stored result says exactly what it measured.
Take the file of the Triton version you run (`triton.__version__`; 3.6.0 -> branch release/3.6.x):

    git clone --depth 1 --branch release/3.6.x https://github.com/triton-lang/triton /tmp/triton-src
    export TRITON_TUTORIAL_ATTENTION=/tmp/triton-src/python/tutorials/06-fused-attention.py

or only that file, into the ignored folder .peer/ (which the GPU runs can carry):

    curl -L --create-dirs -o .peer/06-fused-attention.py \\
        https://raw.githubusercontent.com/triton-lang/triton/release/3.6.x/python/tutorials/06-fused-attention.py

The interface used is the tutorial's module-level `attention(q, k, v, causal, sm_scale[, warp_specialize])`, a
differentiable autograd function on contiguous (batch, heads, N, head_dim) tensors; importing the file needs a
GPU driver (it asks `triton.runtime.driver.active` for the device at import). What it supports (`unsupported`)
was read from the release/3.6.x file; a file that differs is still measured, and a shape it rejects shows up
as an error in the results rather than stopping the run.

FlashAttention-4 is imported from its own installed package (`from flash_attn.cute import flash_attn_func`), never
copied; on the GPU machine `bash ../shared/tools/fa4_pack.sh` prepares it (its header has the commands). It takes
(batch, N, heads, head_dim) tensors: the peer hands it transposed views of the course's (batch, heads, N,
head_dim) tensors, which it reads in place, and returns its output the same way. A stored result records the
package's version and that of the CUTLASS DSL it runs on.
"""
from __future__ import annotations

import hashlib
import importlib.util
import inspect
import os
import re
import sys
from contextlib import contextmanager
from pathlib import Path

import torch

from utils.checks import check_attention_inputs, check_bool, check_capability, positive_int, resolve_scale

ENV_VAR = "TRITON_TUTORIAL_ATTENTION"
TUTORIAL_PATH = "python/tutorials/06-fused-attention.py"  # inside the Triton repository
TUTORIAL_PEERS = {"triton-tutorial": False, "triton-tutorial-ws": True}  # label -> warp_specialize
FA4 = "flash-attn-4"
PEERS = (*TUTORIAL_PEERS, FA4)
MODES = ("fwd", "bwd", "fwd_bwd")

# What the release/3.6.x tutorial runs, and why (from its source):
HEAD_DIMS = (32, 64, 128, 256)  # it asserts {16, ..., 256}, but every tile has BLOCK_N >= 32 > 16 (static_assert)
DTYPES = (torch.float16,)       # P and dS are cast to fp16 before their dots: bf16/fp32 inputs fail to compile
SEQ_MULTIPLE = 128              # no bounds masks on its tiles; its backward asserts N % 128 == 0


class TutorialUnavailable(Exception):
    """The tutorial file could not be used; the message says why and how to get it."""


class TutorialNotFound(TutorialUnavailable, FileNotFoundError):
    pass


class TutorialImportFailed(TutorialUnavailable, ImportError):
    pass


class TutorialInterfaceError(TutorialUnavailable, AttributeError):
    pass


def release_branch(version: str | None = None) -> str:
    """The Triton branch whose tutorial matches `version` (default: the installed Triton): 3.6.0 -> release/3.6.x."""
    if version is None:
        import triton
        version = triton.__version__
    match = re.match(r"(\d+)\.(\d+)", str(version))
    if not match:
        raise ValueError(f"version must look like 3.6.0, got {version!r}")
    return f"release/{match[1]}.{match[2]}.x"


def how_to_get() -> str:
    branch = release_branch()
    return (f"get the tutorial of this Triton ({branch}) with\n"
            f"    git clone --depth 1 --branch {branch} https://github.com/triton-lang/triton /tmp/triton-src\n"
            f"and pass --tutorial /tmp/triton-src/{TUTORIAL_PATH} (or set {ENV_VAR}) with --tutorial-ref {branch}")


def tutorial_path(path=None) -> Path:
    """`path`, else $TRITON_TUTORIAL_ATTENTION, as an existing file; TutorialNotFound (saying how to get it)."""
    if path is None:
        path = os.environ.get(ENV_VAR) or None
        if path is None:
            raise TutorialNotFound(f"no tutorial file given (--tutorial PATH or {ENV_VAR}); {how_to_get()}")
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"path must be a str or os.PathLike, got {type(path).__name__}")
    path = Path(path).expanduser()
    if not path.is_file():
        raise TutorialNotFound(f"the tutorial file {path} does not exist; {how_to_get()}")
    return path.resolve()


@contextmanager
def _pytest_version(value):
    """The tutorial shrinks its autotuning to one config when PYTEST_VERSION is set at import: set (a test, for
    speed) or hide it (a benchmark, even one started from a test, measures the tutorial as normally tuned)."""
    saved = os.environ.pop("PYTEST_VERSION", None)
    if value is not None:
        os.environ["PYTEST_VERSION"] = value
    try:
        yield
    finally:
        os.environ.pop("PYTEST_VERSION", None)
        if saved is not None:
            os.environ["PYTEST_VERSION"] = saved


def _takes_warp_specialize(module) -> bool:
    # `attention` is `_attention.apply`, whose signature is (*args, **kwargs): look at the forward behind it.
    for fn in (getattr(getattr(module, "_attention", None), "forward", None), module.attention):
        try:
            params = inspect.signature(fn).parameters
        except (TypeError, ValueError):
            continue
        if not any(p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD) for p in params.values()):
            return "warp_specialize" in params
    return False


_LOADED: dict = {}  # (path, sha256, tuned) -> module: a second load reuses the kernels and their autotuning


class Tutorial:
    """The imported tutorial file and where it came from."""

    def __init__(self, path: Path, sha256: str, ref: str | None, module, tuned: bool = True):
        self.path, self.sha256, self.ref, self.module, self.tuned = path, sha256, ref, module, tuned
        self.warp_specialize = _takes_warp_specialize(module)

    def provenance(self) -> dict:
        """What a stored result needs to name the kernel exactly: the file, its hash, its ref, the Triton run."""
        import triton

        found = re.search(r"(\d+)\.(\d+)", self.ref or "")  # release/3.6.x, v3.6.0; a commit hash says nothing
        matches = None if found is None else release_branch() == f"release/{found[1]}.{found[2]}.x"
        return dict(path=str(self.path), sha256=self.sha256, ref=self.ref, triton=triton.__version__,
                    ref_matches_triton=matches, takes_warp_specialize=self.warp_specialize, tuned=self.tuned)

    def peer(self, label: str) -> "TutorialPeer":
        if label not in TUTORIAL_PEERS:
            raise ValueError(f"unknown peer {label!r} of the tutorial; known: {', '.join(TUTORIAL_PEERS)}")
        return TutorialPeer(label, self, TUTORIAL_PEERS[label])


def load_tutorial(path=None, *, ref: str | None = None, tuned: bool = True) -> Tutorial:
    """Import the tutorial file (`path`, else $TRITON_TUTORIAL_ATTENTION) under a private module name.
    `tuned=False` imports it as its own tests do, autotuning over a single config (quick; not for timings).

    Raises TutorialNotFound, TutorialImportFailed (e.g. no GPU driver: the file needs one at import) or
    TutorialInterfaceError (no callable `attention`), each naming the file.
    """
    if ref is not None and (not isinstance(ref, str) or not ref.strip()):
        raise TypeError(f"ref must be a non-empty str or None, got {ref!r}")
    check_bool("tuned", tuned)
    path = tutorial_path(path)
    sha256 = hashlib.sha256(path.read_bytes()).hexdigest()
    module = _LOADED.get((path, sha256, tuned))
    if module is None:
        name = f"_course_peer_tutorial_{sha256[:12]}{'' if tuned else '_untuned'}"  # never a real module's
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module  # what importing would do; some decorators look the module up
        try:
            with _pytest_version(None if tuned else "tests"):
                spec.loader.exec_module(module)
        except Exception as err:  # noqa: BLE001 - any failure of the foreign file is reported as one
            del sys.modules[name]
            raise TutorialImportFailed(f"importing the tutorial {path} failed: {type(err).__name__}: "
                                       f"{str(err).splitlines()[0] if str(err) else ''} (the file needs a GPU "
                                       f"driver at import)") from err
        if not callable(getattr(module, "attention", None)):
            del sys.modules[name]
            raise TutorialInterfaceError(f"the tutorial {path} has no callable `attention`; is it "
                                         f"{TUTORIAL_PATH} of the Triton repository?")
        _LOADED[(path, sha256, tuned)] = module
    return Tutorial(path, sha256, ref, module, tuned)


def _check_shape_arguments(head_dim, dtype, causal, seqlen, mode, capability):
    """The arguments of a peer's `unsupported`, checked; returns the capability as a tuple (or None)."""
    positive_int("head_dim", head_dim)
    if not isinstance(dtype, torch.dtype):
        raise TypeError(f"dtype must be a torch.dtype, got {type(dtype).__name__}")
    check_bool("causal", causal)
    if seqlen is not None:
        positive_int("seqlen", seqlen)
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    return check_capability(capability, optional=True)


class TutorialPeer:
    """`peer(q, k, v, causal=..., sm_scale=...)`: the tutorial's attention, differentiable, as the benchmarks
    call every implementation; `unsupported(...)` says which shapes it cannot run (None: it can)."""

    def __init__(self, label: str, tutorial: Tutorial, warp_specialize: bool):
        self.label = self.__name__ = label
        self.tutorial, self.warp_specialize = tutorial, check_bool("warp_specialize", warp_specialize)

    def __repr__(self):
        return f"TutorialPeer({self.label!r}, {str(self.tutorial.path)!r})"

    def provenance(self) -> dict:
        return dict(self.tutorial.provenance(), warp_specialize=self.warp_specialize)

    def unsupported(self, head_dim, dtype, causal, *, seqlen=None, mode="fwd", capability=None) -> str | None:
        """Why the tutorial cannot run this shape (None if it can). `capability`: the GPU's (major, minor),
        which only decides where warp specialization runs; None: any GPU."""
        capability = _check_shape_arguments(head_dim, dtype, causal, seqlen, mode, capability)
        if head_dim not in HEAD_DIMS:
            return f"head_dim {head_dim} (it runs {', '.join(map(str, HEAD_DIMS))})"
        if dtype not in DTYPES:
            return f"{str(dtype).removeprefix('torch.')} (it computes P and dS in fp16: fp16 inputs only)"
        if seqlen is not None and seqlen % SEQ_MULTIPLE:
            return f"N={seqlen} (it needs a multiple of {SEQ_MULTIPLE}: its tiles are not masked)"
        if self.warp_specialize:
            # Where the tutorial's own benchmark turns it on: forward, Blackwell, or Hopper without the mask.
            if not self.tutorial.warp_specialize:
                return "warp specialization (this tutorial's attention takes no warp_specialize)"
            if mode != "fwd":
                return "warp specialization in a backward (the flag only changes the forward)"
            if capability is not None and not (capability[0] == 10 or (capability[0] == 9 and not causal)):
                return f"warp specialization on sm_{capability[0]}{capability[1]}{' causal' if causal else ''}"
        return None

    def supports(self, head_dim, dtype, causal, **kwargs) -> bool:
        return self.unsupported(head_dim, dtype, causal, **kwargs) is None

    def __call__(self, q, k, v, *, causal=False, sm_scale=None):
        shape = check_attention_inputs(q, k, v, causal=causal, head_dims=HEAD_DIMS, dtypes=DTYPES)
        for name, t in (("k", k), ("v", v)):
            if t.shape != q.shape:
                raise ValueError(f"{name} has shape {tuple(t.shape)} but q has {tuple(q.shape)}; the tutorial "
                                 f"needs equal shapes (no grouped heads, N_q = N_k)")
        for name, t in (("q", q), ("k", k), ("v", v)):
            if not t.is_contiguous():  # its descriptors assume the contiguous layout and ignore strides
                raise ValueError(f"{name} must be contiguous for the tutorial ({name}.contiguous())")
        why = self.unsupported(shape.head_dim, q.dtype, causal, seqlen=shape.seqlen_q)
        if why is not None:
            raise ValueError(f"{self.label} does not support {why}")
        scale = resolve_scale(sm_scale, shape.head_dim)  # the tutorial takes no default
        args = (q, k, v, causal, scale) + ((self.warp_specialize,) if self.tutorial.warp_specialize else ())
        try:  # positional: autograd.Function.apply takes no keywords
            return self.tutorial.module.attention(*args)
        except (RuntimeError, ValueError, TypeError):
            raise
        except Exception as err:  # its asserts, Triton's CompilationError: a failed measurement, not a crash
            raise RuntimeError(f"{self.label} failed: {type(err).__name__}: {err}") from err


# ---- FlashAttention-4 ---------------------------------------------------------------------------------------

FA4_PACKAGES = ("flash-attn-4", "nvidia-cutlass-dsl")   # recorded with its results
FA4_DTYPES = (torch.float16, torch.bfloat16)
FA4_ARCHS = (9, 10)   # its kernels are written for Hopper (sm_90) and Blackwell (sm_100)


class FlashAttention4Unavailable(ImportError):
    """flash-attn-4 cannot be imported here; the message says why and how to get it."""


def load_flash_attention_4() -> "FlashAttention4Peer":
    """The peer, from the installed package; FlashAttention4Unavailable (naming the cause) if it does not import."""
    from importlib import metadata

    try:
        from flash_attn.cute import flash_attn_func
    except Exception as err:  # noqa: BLE001 - not installed, or its CUDA libraries do not load here
        first = str(err).splitlines()[0] if str(err) else ""
        raise FlashAttention4Unavailable(
            f"flash_attn.cute does not import: {type(err).__name__}: {first} (on the GPU machine "
            f"`bash ../shared/tools/fa4_pack.sh` prepares the flash-attn-4 package)") from err
    versions = {}
    for package in FA4_PACKAGES:
        try:
            versions[package] = metadata.version(package)
        except metadata.PackageNotFoundError:
            versions[package] = None
    return FlashAttention4Peer(flash_attn_func, versions)


class FlashAttention4Peer:
    """`peer(q, k, v, causal=..., sm_scale=...)`: FlashAttention-4's differentiable attention on the course's
    (batch, heads, N, head_dim) tensors; `unsupported(...)` says which shapes it cannot run (None: it can)."""

    def __init__(self, fn, versions: dict):
        if not callable(fn):
            raise TypeError(f"fn must be callable, got {type(fn).__name__}")
        self.label = self.__name__ = FA4
        self.fn, self.versions = fn, dict(versions)

    def __repr__(self):
        return f"FlashAttention4Peer({self.versions})"

    def provenance(self) -> dict:
        return dict(package=FA4_PACKAGES[0], versions=self.versions, function=f"{self.fn.__module__}."
                    f"{getattr(self.fn, '__qualname__', 'flash_attn_func')}")

    def unsupported(self, head_dim, dtype, causal, *, seqlen=None, mode="fwd", capability=None) -> str | None:
        """Why FlashAttention-4 cannot run this shape (None if it can); `capability`: the GPU's, None: any."""
        capability = _check_shape_arguments(head_dim, dtype, causal, seqlen, mode, capability)
        if dtype not in FA4_DTYPES:
            return f"{str(dtype).removeprefix('torch.')} (it runs fp16 and bf16)"
        if not 8 <= head_dim <= 256 or head_dim % 8:
            return f"head_dim {head_dim} (it runs multiples of 8 from 8 to 256)"
        if capability is not None and capability[0] not in FA4_ARCHS:
            return f"sm_{capability[0]}{capability[1]} (its kernels are for sm_90 and sm_100)"
        return None

    def supports(self, head_dim, dtype, causal, **kwargs) -> bool:
        return self.unsupported(head_dim, dtype, causal, **kwargs) is None

    def __call__(self, q, k, v, *, causal=False, sm_scale=None):
        shape = check_attention_inputs(q, k, v, causal=causal, dtypes=FA4_DTYPES)
        capability = tuple(torch.cuda.get_device_capability(q.device)) if q.is_cuda else None
        why = self.unsupported(shape.head_dim, q.dtype, causal, seqlen=shape.seqlen_q, capability=capability)
        if why is not None:
            raise ValueError(f"{self.label} does not support {why}")
        scale = resolve_scale(sm_scale, shape.head_dim)
        out = self.fn(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), softmax_scale=scale, causal=causal)
        if isinstance(out, tuple):   # (out, lse)
            out = out[0]
        return out.transpose(1, 2)


def add_arguments(parser, choices=tuple(PEERS), default=()) -> None:
    """--peers, --tutorial and --tutorial-ref for a benchmark's command line."""
    parser.add_argument("--peers", nargs="*", choices=list(choices), default=list(default),
                        help="outside kernels measured beside the others (the Triton tutorial's attention, "
                             "FlashAttention-4 where flash-attn-4 is installed)")
    parser.add_argument("--tutorial", type=Path, default=None,
                        help=f"the tutorial's {Path(TUTORIAL_PATH).name} (default: ${ENV_VAR})")
    parser.add_argument("--tutorial-ref", default=None,
                        help="the Triton git ref the file comes from, recorded with the results (release/3.6.x)")


def from_args(args, stream=None) -> dict:
    """{label: peer} for args.peers, in their order; a peer that cannot be loaded (no tutorial file, flash-attn-4
    not installed) is left out with a message (no traceback) on `stream` (default stderr), so the rest of the
    benchmark still runs."""
    names = list(getattr(args, "peers", None) or [])
    if not names:
        return {}
    stream = sys.stderr if stream is None else stream
    loaded = {}
    tutorial_names = [name for name in names if name in TUTORIAL_PEERS]
    if tutorial_names:
        try:
            tutorial = load_tutorial(getattr(args, "tutorial", None), ref=getattr(args, "tutorial_ref", None))
        except TutorialUnavailable as err:
            print(f"skipping {', '.join(tutorial_names)}: {err}", file=stream)
        else:
            if tutorial.provenance()["ref_matches_triton"] is False:
                print(f"warning: the tutorial comes from {tutorial.ref} but this is Triton {release_branch()}",
                      file=stream)
            loaded.update((name, tutorial.peer(name)) for name in tutorial_names)
    if FA4 in names:
        try:
            loaded[FA4] = load_flash_attention_4()
        except FlashAttention4Unavailable as err:
            print(f"skipping {FA4}: {err}", file=stream)
    return {name: loaded[name] for name in names if name in loaded}
