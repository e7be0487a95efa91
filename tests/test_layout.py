"""The direction of imports inside utils/ (issue 71), read from the source with `ast`: imports at module level and
inside functions alike.

Rules: kernel code never imports the course's tooling; no two modules import each other, directly or round a
loop; a forward never imports its backward; no folder is named after a library; a kernel module names its
configuration class `Config`, beside a `pick_config` (issue 71 item 6). What breaks a rule today is
listed in KNOWN_* below, each with the step that removes it. The lists may only shrink: an entry that no
longer happens fails too, so that fixing a violation also takes it off the list.
"""
import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# The course's tooling (set-up, plots, measurement, checks, benchmarks, reports, generators) is one package that
# kernel code never imports.
TOOLING = ("utils.course",)
# (forward, backward) module pairs: the autograd entry lives with the backward, or both import a lower module.
FORWARD_BACKWARD = (("utils.eager.forward", "utils.eager.backward"),
                    ("utils.tiled.forward", "utils.tiled.backward"),
                    ("utils.tiled.fast.forward", "utils.tiled.fast.backward"),
                    ("utils.sinks.forward", "utils.sinks.backward"),
                    ("utils.explicit.forward", "utils.explicit.backward"),
                    ("utils.explicit.forward_ws", "utils.explicit.backward"),
                    ("utils.native.kernels", "utils.native.backward"),
                    ("utils.native.build", "utils.native.backward"),
                    ("utils.native.hopper", "utils.native.hopper_backward"),
                    ("utils.course.worklogs.triton_forward", "utils.course.worklogs.triton_backward"))
LIBRARY_NAMES = {"triton", "torch", "cuda", "gluon", "cutlass", "numpy"}
# Names retired by issue 71 item 6 for the roles Config, pick_config, check_inputs and use_tma: no kernel module
# defines them at module level again.
RETIRED_NAMES = {"validate", "fit_config", "default_config", "default_tma", "ws_label", "configs"}
# Kernel modules within the tooling: the worklogs' copies of the fast Triton kernels follow the same names.
KERNEL_COPIES = ("utils.course.worklogs",)

# Today's violations, to be removed by the layout steps of issue 71 (then deleted here).
KNOWN_TOOLING_IMPORTS: set = set()
KNOWN_CYCLES: set = set()
KNOWN_FORWARD_IMPORTS_BACKWARD: set = set()
KNOWN_LIBRARY_FOLDERS: set = set()


def modules(root: Path = ROOT) -> dict:
    """{dotted name: path} of every module under utils/ (a package by its __init__.py)."""
    out = {}
    for path in sorted((root / "utils").rglob("*.py")):
        parts = path.relative_to(root).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def imports(mods: dict) -> set:
    """(importer, imported) for every import of a utils module by another, wherever it stands in the file."""
    found = set()
    for name, path in mods.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:   # from . import x, from ..y import z
                    up = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(up + ([base] if base else []))
                targets = [f"{base}.{alias.name}" for alias in node.names]
            else:
                continue
            for target in targets:
                while target and target not in mods:   # utils.x.attr -> utils.x
                    target = target.rpartition(".")[0]
                if target.startswith("utils") and target not in (name, "utils"):
                    found.add((name, target))
    return found


def in_package(name: str, packages) -> bool:
    return any(name == p or name.startswith(p + ".") for p in packages)


def mutual_pairs(edges: set) -> set:
    """Each pair of modules that reach each other through imports, sorted within the pair."""
    reach = {}
    for a, b in edges:
        reach.setdefault(a, set()).add(b)
    changed = True
    while changed:   # transitive closure; a few dozen modules
        changed = False
        for a, targets in reach.items():
            more = set().union(*(reach.get(b, set()) for b in targets)) - targets
            if more:
                targets |= more
                changed = True
    return {tuple(sorted((a, b))) for a, targets in reach.items() for b in targets if a != b and a in reach.get(b, ())}


EDGES = imports(modules())


def test_the_reader_finds_imports_at_module_level_inside_functions_and_relative(tmp_path):
    (tmp_path / "utils" / "pkg").mkdir(parents=True)
    for name, text in {"__init__.py": "", "a.py": "from utils import b\n",
                       "b.py": "def f():\n    from utils.pkg.c import g\n",
                       "pkg/__init__.py": "from .c import g\n", "pkg/c.py": "import utils.a\nfrom ..b import f\n"}.items():
        (tmp_path / "utils" / name).write_text(text)
    edges = imports(modules(tmp_path))
    assert edges == {("utils.a", "utils.b"), ("utils.b", "utils.pkg.c"), ("utils.pkg", "utils.pkg.c"),
                     ("utils.pkg.c", "utils.a"), ("utils.pkg.c", "utils.b")}
    assert mutual_pairs(edges) == {("utils.a", "utils.b"), ("utils.a", "utils.pkg.c"), ("utils.b", "utils.pkg.c")}


def test_kernel_code_never_imports_the_tooling():
    found = {(a, b) for a, b in EDGES if not in_package(a, TOOLING) and in_package(b, TOOLING)}
    by_package = {(a, next(p for p in TOOLING if in_package(b, (p,)))) for a, b in found}
    assert by_package <= KNOWN_TOOLING_IMPORTS, f"kernel code imports tooling: {sorted(by_package - KNOWN_TOOLING_IMPORTS)}"
    assert by_package == KNOWN_TOOLING_IMPORTS, f"fixed, take them off KNOWN_TOOLING_IMPORTS: " \
                                                f"{sorted(KNOWN_TOOLING_IMPORTS - by_package)}"


def test_no_two_modules_import_each_other():
    pairs = mutual_pairs(EDGES)
    assert pairs <= KNOWN_CYCLES, f"import cycles: {sorted(pairs - KNOWN_CYCLES)}"
    assert pairs == KNOWN_CYCLES, f"broken, take them off KNOWN_CYCLES: {sorted(KNOWN_CYCLES - pairs)}"


def test_a_forward_never_imports_its_backward():
    found = {pair for pair in FORWARD_BACKWARD if pair in EDGES}
    assert found <= KNOWN_FORWARD_IMPORTS_BACKWARD, f"{sorted(found - KNOWN_FORWARD_IMPORTS_BACKWARD)}"
    assert found == KNOWN_FORWARD_IMPORTS_BACKWARD, f"fixed, take them off the list: " \
                                                    f"{sorted(KNOWN_FORWARD_IMPORTS_BACKWARD - found)}"


def test_each_forward_backward_pair_names_two_modules():
    """A pair that names a module no longer there would pass the rule above without checking anything."""
    mods = modules()
    missing = sorted({m for pair in FORWARD_BACKWARD for m in pair} - set(mods))
    assert not missing, f"FORWARD_BACKWARD names modules that do not exist: {missing}"


def test_no_folder_is_named_after_a_library():
    # A folder counts when it holds a file: git keeps no empty folder, so one left by an older checkout (the GPU
    # machine keeps ignored leftovers between runs) is no folder of the course's.
    folders = {str(p.relative_to(ROOT)) for p in (ROOT / "utils").rglob("*")
               if p.is_dir() and p.name in LIBRARY_NAMES
               and any(f.is_file() and "__pycache__" not in f.parts for f in p.rglob("*"))}
    assert folders <= KNOWN_LIBRARY_FOLDERS, f"folders named after a library: {sorted(folders - KNOWN_LIBRARY_FOLDERS)}"
    assert folders == KNOWN_LIBRARY_FOLDERS, f"renamed, take them off the list: {sorted(KNOWN_LIBRARY_FOLDERS - folders)}"


def test_triton_utils_keeps_its_name_and_place():
    assert (ROOT / "utils" / "triton_utils.py").is_file()


def naming_problems(source: str) -> list[str]:
    """What breaks the naming scheme in one module's source: a module-level class named like a configuration
    (ending in Config) but not `Config`, a `Config` without a module-level `pick_config`, or a retired name."""
    tree = ast.parse(source)
    classes = {node.name for node in tree.body if isinstance(node, ast.ClassDef)}
    functions = {node.name for node in tree.body if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))}
    problems = [f"class {name}: name it Config" for name in sorted(classes) if name.endswith("Config") and name != "Config"]
    if "Config" in classes and "pick_config" not in functions:
        problems.append("Config without pick_config")
    problems += [f"def {name}: retired name" for name in sorted(functions & RETIRED_NAMES)]
    return problems


def test_the_naming_check_finds_a_misnamed_configuration():
    assert naming_problems("class Config:\n    pass\ndef pick_config(head_dim, dtype):\n    pass\n") == []
    assert naming_problems("class BwdConfig:\n    pass\ndef pick_config(head_dim):\n    pass\n") == \
        ["class BwdConfig: name it Config"]
    assert naming_problems("class Config:\n    pass\ndef default_config(head_dim):\n    pass\n") == \
        ["Config without pick_config", "def default_config: retired name"]


def test_each_kernel_module_names_its_configuration_config_beside_pick_config():
    checked = {name: path for name, path in modules().items()
               if not in_package(name, TOOLING) or in_package(name, KERNEL_COPIES)}
    problems = {name: found for name, path in checked.items() if (found := naming_problems(path.read_text()))}
    assert not problems, f"kernel modules off the naming scheme (issue 71 item 6): {problems}"
    with_config = sorted(name for name, path in checked.items() if "Config" in {
        node.name for node in ast.parse(path.read_text()).body if isinstance(node, ast.ClassDef)})
    assert {"utils.tiled.forward", "utils.tiled.backward", "utils.tiled.fast.backward", "utils.explicit.forward",
            "utils.explicit.forward_ws", "utils.explicit.backward"} <= set(with_config), with_config
