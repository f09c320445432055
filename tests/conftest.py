"""Test setup: Triton runs under its CPU interpreter when no GPU is present; shared backend helpers.

TRITON_INTERPRET must be set before triton is first imported, hence at conftest import time.

Without a GPU the suite runs on one intra-op thread, here and (``OMP_NUM_THREADS``, unless set) in
the processes it starts: its models are tiny, and on a busy 2-core box a second thread only adds
synchronisation -- five tests' modules took 98 s on two threads and 31 s on one, the 12 000-request
distribution check 281 s against 38 s; on an idle box one thread costs the demo pair some 4 %.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))

import pytest  # noqa: E402

import dspark.kernels as K  # noqa: E402


def _triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


TRITON = _triton_available()
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
BACKENDS = ("reference", "triton")

requires_triton = pytest.mark.skipif(not TRITON, reason="triton is not installed")
# The registered marker, so that ``pytest -m gpu`` selects every CUDA test; skipped without CUDA below.
gpu = pytest.mark.gpu


def _real_kv_blocks():
    from dspark.engine import llm_engine

    return llm_engine.kv_blocks_from_memory


_REAL_KV_BLOCKS = _real_kv_blocks()


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    no_cuda = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if item.get_closest_marker("gpu") is not None:
            item.add_marker(no_cuda)


@pytest.fixture(scope="session", autouse=True)
def _kv_blocks_per_engine():
    """Many engines live at once in a test process, so on a GPU each holds KV blocks for its
    ``max_batch`` requests of ``max_model_len`` (the CPU's rule), not ``gpu_memory_utilization`` of the
    device; ``memory_budget_kv`` (a test's fixture) restores the real rule."""
    from dspark.engine import llm_engine

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(llm_engine, "kv_blocks_from_memory", lambda *args, **kwargs: None)
        yield


@pytest.fixture
def memory_budget_kv(monkeypatch):
    from dspark.engine import llm_engine

    monkeypatch.setattr(llm_engine, "kv_blocks_from_memory", _REAL_KV_BLOCKS)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.fixture(autouse=True)
def _transformers_logging():
    """``--quiet`` turns transformers' progress bars and reports off process-wide: on again after each test."""
    yield
    from transformers.utils import logging

    logging.enable_progress_bar()
    logging.set_verbosity_warning()


@pytest.fixture(scope="module")
def one_thread():
    """One intra-op thread for a module of tiny steps: on a busy 2-core box a second thread only adds
    synchronisation (10-30x slower seen); ``pytestmark = pytest.mark.usefixtures("one_thread")``."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def reference_backend():
    """Every kernel call of the test on the PyTorch reference (``pytestmark = usefixtures(...)``)."""
    with K.use_backend("reference"):
        yield


@pytest.fixture
def unchecked_values(monkeypatch):
    """Value checks off (``DSPARK_CHECK_VALUES=0``): the kernels' raw behaviour on NaN inputs, on the CPU too."""
    monkeypatch.setenv("DSPARK_CHECK_VALUES", "0")


def on_backends(run):
    """``run()`` under the reference and then the Triton backend: ``(reference, triton)`` results."""
    results = []
    for name in BACKENDS:
        with K.use_backend(name):
            results.append(run())
    return results


def assert_same(expected, actual):
    """Bit-identical tensors (NaN equal to NaN), or tuples of them."""
    if isinstance(expected, tuple):
        for e, a in zip(expected, actual, strict=True):
            assert_same(e, a)
        return
    assert expected.dtype == actual.dtype and expected.shape == actual.shape
    torch.testing.assert_close(actual, expected, rtol=0, atol=0, equal_nan=True)


# The interpreter evaluates masked lanes too (-inf - -inf, 0 / 0): numpy warns, the lanes are discarded.
INTERPRETER_WARNINGS = pytest.mark.filterwarnings("ignore:(invalid value|divide by zero):RuntimeWarning")

# ``@pytest.mark.parametrize("backend", BACKEND_PARAMS)``: the same test and vectors on both backends.
BACKEND_PARAMS = [pytest.param("reference"), pytest.param("triton", marks=requires_triton)]
