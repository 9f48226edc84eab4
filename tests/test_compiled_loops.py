"""The simulator's loops: numba loads only when a loop first runs (vLLM's CPU engine breaks on
llvmlite's module in the same process), and the compiled loops give the plain-Python results."""

import subprocess
import sys

import pytest

from coldset.analysis import compiled


def _run(code: str) -> str:
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


def test_importing_the_workflow_loads_no_numba():
    loaded = _run("import sys, coldset.cli, coldset.workflow.pipeline, coldset.workflow.vllm_parity, "
                  "coldset.serve.vllm_backend, coldset.analysis.simulate\nprint('numba' in sys.modules)")
    assert loaded == "False"


@pytest.mark.skipif(not compiled.numba_installed(), reason="numba not installed")
def test_a_replay_compiles_every_loop_and_equals_plain_python():
    code = (
        "import sys\n{block}"
        "import numpy as np\n"
        "from coldset.analysis import simulate, streams, policies\n"
        "rng = np.random.default_rng(5)\n"
        "ids = rng.integers(0, 24, 600); ptr = np.arange(0, 601, 3)\n"
        "s = streams.AccessStream(ids, ptr, 200, 3, 8); prof = rng.random((3, 8))\n"
        "print([int(simulate.simulate(s, p, 7, prof).hit.sum()) for p in ('lru', 'lru_guard', 'lfu', 'belady', 'static')],"
        " sys.modules.get('numba') is not None)\n"
    )
    compiled_out = _run(code.format(block=""))
    plain_out = _run(code.format(block="sys.modules['numba'] = None\n"))
    assert compiled_out.endswith("True") and plain_out.endswith("False")
    assert compiled_out.rsplit(" ", 1)[0] == plain_out.rsplit(" ", 1)[0]


def _inner(x):
    return x + 1


_inner = compiled.jit(_inner)  # as a module decorates a loop


def _outer(n):
    total = 0
    for i in range(n):
        total += _inner(i)
    return total


_outer = compiled.jit(_outer)


def test_a_loop_calling_another_loop_runs_through_the_rebound_dispatcher():
    assert _outer(10) == 55
    assert [_outer(k) for k in range(5)] == [0, 1, 3, 6, 10]
    if compiled.numba_installed():
        assert type(globals()["_inner"]).__name__ == "CPUDispatcher"  # the module's name rebound
