"""The stored reference results: each JSON says where it was measured, README's numbers are the JSON's, and
every reference has a command that regenerates it."""
import importlib.util
import json

import pytest

from utils.references import IMAGES, README, REFERENCES, main, results_markdown, update_readme

JSONS = sorted(IMAGES.glob("*.json"))
ENV_KEYS = ("gpu", "capability", "torch", "triton", "cuda", "cudnn", "driver", "date", "command")


@pytest.mark.parametrize("path", JSONS, ids=lambda p: p.name)
def test_every_stored_result_records_its_environment(path):
    env = json.loads(path.read_text()).get("environment")
    assert isinstance(env, dict), f"{path.name} has no 'environment' (utils.gpu.environment)"
    missing = [k for k in ENV_KEYS if k not in env]
    assert not missing, f"{path.name}: environment lacks {missing}"
    for key in ("gpu", "torch", "triton", "date", "command"):
        assert env[key], f"{path.name}: environment.{key} is empty"
    unknown = [k for k in ENV_KEYS if env[k] is None]
    assert not unknown or env.get("reconstructed"), f"{path.name}: {unknown} unknown and no word on why"
    assert env["command"].startswith("python -m "), env["command"]


@pytest.mark.parametrize("path", JSONS, ids=lambda p: p.name)
def test_every_stored_result_has_a_command_that_makes_it(path):
    commands = [" ".join(command) for _, command in REFERENCES.values()]
    made_by = json.loads(path.read_text())["environment"]["command"].removeprefix("python -m ")
    via_references = made_by.startswith("utils.references --only ")
    assert via_references or any(made_by.startswith(c.split(" --out")[0].split(" --name")[0]) for c in commands), made_by


@pytest.mark.parametrize("name", list(REFERENCES))
def test_each_reference_command_names_a_module(name):
    module = REFERENCES[name][1][0]
    assert importlib.util.find_spec(module) is not None, module


def test_readme_results_equal_the_json():
    assert update_readme(check=True), "README's results differ from images/*.json: python -m utils.references --readme"
    text = results_markdown()
    assert "| course Triton forward" in text and "SDPA cuDNN backward" in text and "torch 2.11" in text
    assert "Gluon backward of notebook 07" in text and "the tutorial's backward at N ≥ 2k" in text


def test_readme_counts_the_shapes_where_the_course_is_below_the_tutorial():
    """The count README gives, computed here from the peers run's records: per fp16 shape, the course's fastest
    kernel against the tutorial's fastest variant."""
    results = json.loads((IMAGES / "peers_h200.json").read_text())["results"]
    best = {}
    for r in results:
        if r["accurate"] and r["ms"] and (r["impl"] in ("triton", "gluon", "gluon_ws")
                                          or r["impl"].startswith("triton-tutorial")):
            who = "tutorial" if r["impl"].startswith("triton-tutorial") else "course"
            shape = (r["mode"], r["dtype"], r["head_dim"], r["causal"], r["seqlen"])
            best[who, shape] = min(best.get((who, shape), float("inf")), r["ms"])
    shapes = [s for who, s in best if who == "tutorial" and ("course", s) in best]
    below = sum(best["course", s] > best["tutorial", s] for s in shapes)
    text = results_markdown()
    if below:
        assert f": {below} of {len(shapes)} shapes" in text
    else:
        assert f"at least its speed on all {len(shapes)} shapes" in text


def test_readme_course_against_sdpa_is_the_fastest_course_kernel_per_shape():
    """The peers run's forward against FlashAttention-2, computed here from the records themselves."""
    results = json.loads((IMAGES / "peers_h200.json").read_text())["results"]
    fast = {}
    for r in results:
        if r["mode"] == "fwd" and r["seqlen"] >= 1024 and r["tflops"] and r["accurate"]:
            shape = (r["dtype"], r["head_dim"], r["causal"], r["seqlen"])
            if r["impl"] in ("triton", "gluon", "gluon_ws"):
                fast[shape] = max(fast.get(shape, 0.0), r["tflops"])
    fa2 = {(r["dtype"], r["head_dim"], r["causal"], r["seqlen"]): r["tflops"] for r in results
           if r["impl"] == "sdpa-flash" and r["mode"] == "fwd" and r["tflops"] and r["accurate"]}
    ratios = [fast[s] / fa2[s] for s in fast if s in fa2]
    assert len(ratios) == 2 * 2 * 2 * 5   # dtypes, head dims, masks, N 1k-16k
    assert f"{min(ratios):.2f}–{max(ratios):.2f}× FlashAttention-2 at N ≥ 1k" in results_markdown()


def test_list_and_no_gpu(capsys):
    assert main(["--list"]) == 0
    assert "ring_nccl" in capsys.readouterr().out
    import torch

    if not torch.cuda.is_available():
        assert main(["--only", "summary"]) == 2
    assert README.is_file()
