"""Every test that needs CUDA carries the ``gpu`` marker, so that ``pytest -m gpu`` (the run on the
H200) selects all of them and a machine without CUDA skips them (conftest's collection hook).

A static scan of the test modules: a test uses CUDA when its body -- or a module-level helper or
fixture it reaches -- moves tensors there (``.cuda()``, ``.to("cuda")``, ``device="cuda"``,
``torch.autocast("cuda")``) or calls ``torch.cuda`` beyond asking whether it is there.
"""

from __future__ import annotations

import ast
from pathlib import Path

TESTS = Path(__file__).parent
QUERIES = {"is_available", "device_count"}  # torch.cuda calls that a CPU test may make


def _is_cuda_string(node) -> bool:
    return isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value.split(":")[0] == "cuda"


def _uses_cuda_directly(fn: ast.AST) -> bool:
    for node in ast.walk(fn):
        if isinstance(node, ast.Call):
            name = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")
            if name == "cuda" or (name in ("to", "autocast") and node.args and _is_cuda_string(node.args[0])):
                return True
            if any(k.arg == "device" and _is_cuda_string(k.value) for k in node.keywords):
                return True
        if (isinstance(node, ast.Attribute) and node.attr not in QUERIES and isinstance(node.value, ast.Attribute)
                and node.value.attr == "cuda" and getattr(node.value.value, "id", "") == "torch"):
            return True
    return False


def _marks_gpu(node, marked_names=frozenset({"gpu"})) -> bool:
    """``gpu``, ``pytest.mark.gpu``, or a decorator / list / ``pytest.param`` holding one, directly
    or through a module-level name in ``marked_names``."""
    return any((isinstance(n, ast.Name) and n.id in marked_names) or (isinstance(n, ast.Attribute) and n.attr == "gpu")
               for n in ast.walk(node))


def _marked_names(tree: ast.Module) -> set[str]:
    """``gpu`` and the module-level names bound to something holding the marker (``pytestmark``,
    a parameter list)."""
    assigns = [s for s in tree.body if isinstance(s, ast.Assign) and _marks_gpu(s.value)]
    return {"gpu"} | {t.id for s in assigns for t in s.targets if isinstance(t, ast.Name)}


def _reached(fn: ast.FunctionDef) -> set[str]:
    """Names a function calls, and its arguments (fixtures)."""
    called = {n.func.id for n in ast.walk(fn) if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)}
    return called | {a.arg for a in fn.args.args}


def unmarked_cuda_tests(source: str) -> list[str]:
    """The test functions of a module's ``source`` that use CUDA without the ``gpu`` marker."""
    tree = ast.parse(source)
    marked = _marked_names(tree)
    if "pytestmark" in marked:
        return []
    functions = {s.name: s for s in tree.body if isinstance(s, ast.FunctionDef)}
    uses = {name for name, fn in functions.items() if _uses_cuda_directly(fn)}
    grown = True
    while grown:  # through helpers and fixtures, to a fixed point
        more = {name for name, fn in functions.items() if name not in uses and _reached(fn) & uses}
        uses |= more
        grown = bool(more)
    return [name for name in sorted(uses)
            if name.startswith("test") and not any(_marks_gpu(d, marked) for d in functions[name].decorator_list)]


def cuda_skipifs(source: str) -> list[int]:
    """Lines of ``skipif(not torch.cuda.is_available())``: the marker is the one way to need CUDA."""
    return [n.lineno for n in ast.walk(ast.parse(source)) if isinstance(n, ast.Call)
            and getattr(n.func, "attr", "") == "skipif" and n.args and isinstance(n.args[0], ast.UnaryOp)
            and isinstance(n.args[0].op, ast.Not) and "cuda.is_available" in ast.unparse(n.args[0])]


def test_every_cuda_test_carries_the_gpu_marker():
    problems = {}
    for path in sorted(TESTS.glob("test_*.py")):
        source = path.read_text()
        found = unmarked_cuda_tests(source) + [f"skipif on CUDA at line {n}" for n in cuda_skipifs(source)]
        if found:
            problems[path.name] = found
    assert not problems, f"needs @pytest.mark.gpu (conftest skips it without CUDA): {problems}"


def test_the_scan_finds_cuda_use_without_the_marker():
    """The scan has teeth: each way of using CUDA, reached directly or through a helper or fixture."""
    unmarked = '''
import pytest, torch

def _model():
    return torch.zeros(2).cuda()

@pytest.fixture
def on_device():
    return torch.ones(1, device="cuda:0")

def test_direct():
    torch.zeros(1).to("cuda")

def test_helper():
    _model()

def test_fixture(on_device):
    pass

def test_graph():
    torch.cuda.synchronize()

@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_skipped_the_old_way():
    torch.zeros(1).cuda()

@pytest.mark.gpu
def test_marked():
    torch.zeros(1).cuda()

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]

@pytest.mark.parametrize("device", DEVICES)
def test_parametrized(device):
    torch.zeros(1).to(device) if device == "cpu" else torch.zeros(1).cuda()

def test_cpu_only():
    assert torch.device("cuda").type == "cuda" and torch.cuda.is_available() in (True, False)
'''
    assert unmarked_cuda_tests(unmarked) == ["test_direct", "test_fixture", "test_graph", "test_helper",
                                             "test_skipped_the_old_way"]
    assert cuda_skipifs(unmarked) == [23]
    assert unmarked_cuda_tests("import pytest\npytestmark = pytest.mark.gpu\ndef test_a():\n    x.cuda()\n") == []


def test_conftest_gpu_is_the_registered_marker():
    """``from conftest import gpu`` must mark (a skipif would hide the test from ``-m gpu``)."""
    from conftest import gpu

    assert gpu.mark.name == "gpu"
