import ast
import functools
import hashlib
import multiprocessing.process
import os
import pathlib
import subprocess
import sys
import tempfile


def _inductor_cache_for_this_code() -> str:
    """An Inductor cache folder keyed by coat_ds's sources: Inductor's on-disk caches do not key
    compiled graphs by a custom op's schema, so code compiled before one of ours changed would
    call it with the old arguments. Warm across runs of the same code, fresh after a change."""
    digest = hashlib.sha256()
    for path in sorted(pathlib.Path(__file__).parent.parent.joinpath("coat_ds").rglob("*.py")):
        digest.update(path.read_bytes())
    return os.path.join(tempfile.gettempdir(), "coat_ds_inductor", digest.hexdigest()[:16])


# Set before torch is imported; subprocesses (launchers, ranks) inherit it.
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", _inductor_cache_for_this_code())

import torch  # noqa: E402

_TESTS = os.path.dirname(os.path.abspath(__file__))

# Triton reads this when a kernel is defined, so it must be set before coat_ds.kernels'
# Triton modules are imported: on a CPU-only machine every Triton kernel runs interpreted.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

# setup.cfg runs the suite in pytest-xdist workers (`-n auto`): as many as the hook below says.
_XDIST_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0"))
if _XDIST_WORKERS and not torch.cuda.is_available():
    # The workers share the cores: each one's intra-op threads get its share of them (on 2
    # cores one thread each), as two processes of 2 threads on 2 cores only contend.
    torch.set_num_threads(max(1, len(os.sched_getaffinity(0)) // _XDIST_WORKERS))


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_auto_num_workers(config):
    """`-n auto` (setup.cfg): 2 workers on a CPU machine (its multi-process tests and the Triton
    interpreter leave much of a second core idle otherwise); on a GPU machine none, one process
    as before, since the tests share the GPU and some measure its memory."""
    if torch.cuda.is_available():
        return 0
    return min(2, len(os.sched_getaffinity(0)))


@functools.lru_cache(maxsize=None)
def _has_module_fixture(path: str) -> bool:
    """The test file at `path` defines a fixture wider than a test (`scope="module"`, say)."""
    try:
        tree = ast.parse(pathlib.Path(path).read_text())
    except (OSError, SyntaxError, ValueError):
        return False
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", None)) == "fixture":
            for kw in node.keywords:
                if kw.arg == "scope" and not (isinstance(kw.value, ast.Constant) and kw.value.value == "function"):
                    return True
    return False


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """`--dist load` (what `-n` runs) with one change: a file that defines a module-scoped
    fixture (a multi-rank run that several of its tests check, say) is one unit of work, run by
    one worker, which builds the fixture once; every other test is a unit of its own. (xdist's
    `--dist loadgroup` would do this from xdist_group marks, but under pytest 9.2 it silently
    stops grouping: pytest-xdist issue 1386.) Units are handed out in collection order, the slow
    tests first: see pytest_collection_modifyitems."""
    if config.getvalue("dist") != "load":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class OneWorkerPerModuleFixture(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            path = nodeid.split("::", 1)[0]
            return path if _has_module_fixture(str(config.rootpath / path)) else nodeid

    return OneWorkerPerModuleFixture(config, log)


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    if _XDIST_WORKERS:
        # The slow tests (other processes, the longest in-process ones) first, each file's in its
        # order: the run ends on short tests, so neither worker waits long for the other.
        items.sort(key=lambda item: "slow" not in item.keywords)
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _fp8_paths_at_any_size(request, monkeypatch):
    """On a GPU machine, eager FP8 linears and compression at the tests' small sizes: the CUDA
    defaults of Fp8LinearConfig.eager_min_macs and ActivationConfig.eager_min_region_numel
    would run them as nn.Linear and exact (tests marked cuda_eager_limits check those)."""
    if torch.cuda.is_available() and "cuda_eager_limits" not in request.keywords:
        from coat_ds.activation import api
        from coat_ds.linear import layer

        monkeypatch.setattr(layer, "CUDA_EAGER_MIN_MACS", 0)
        monkeypatch.setattr(api, "CUDA_EAGER_MIN_REGION_NUMEL", 0)


@pytest.fixture
def device():
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


@pytest.fixture(scope="module")
def one_thread():
    """One intra-op thread for the rest of the module: its tiny ops on a shared 2-core
    machine only contend otherwise (50x slower steps)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


_LAUNCH_MACHINERY = ("subprocess.py", os.sep + "multiprocessing" + os.sep)


def _started_by_a_test() -> bool:
    """The first caller outside the process-starting machinery (subprocess, multiprocessing,
    torch.multiprocessing) is test code, not a library's own helper process (Inductor's
    compile workers and probes start Python too, in single-process tests)."""
    frame = sys._getframe(2)
    while frame is not None and any(m in frame.f_code.co_filename for m in _LAUNCH_MACHINERY):
        frame = frame.f_back
    return frame is not None and os.path.dirname(os.path.abspath(frame.f_code.co_filename)) == _TESTS


def _command(args) -> str:
    return " ".join(map(str, [args] if isinstance(args, (str, bytes)) else args))[:120]


@pytest.fixture(autouse=True)
def _multi_process_tests_are_slow(request, monkeypatch):
    """`-m "not slow"` promises no multi-process runs: a test that starts another process
    (a launcher, ranks, a script) without the `slow` mark fails here."""
    if "slow" in request.node.keywords:
        yield
        return
    started = []
    popen_init = subprocess.Popen.__init__
    process_start = multiprocessing.process.BaseProcess.start

    def init(self, args, *a, **kw):
        if _started_by_a_test():
            started.append(_command(args))
        popen_init(self, args, *a, **kw)

    def start(self):
        if _started_by_a_test():
            started.append(f"multiprocessing {self.name}")
        process_start(self)

    monkeypatch.setattr(subprocess.Popen, "__init__", init)
    monkeypatch.setattr(multiprocessing.process.BaseProcess, "start", start)
    yield
    if started:
        pytest.fail(f"{request.node.nodeid} starts other processes (`{started[0]}`): mark it @pytest.mark.slow",
                    pytrace=False)
