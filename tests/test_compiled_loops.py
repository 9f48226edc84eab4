"""The simulator's loops: numba loads only when a loop first runs (vLLM's CPU engine breaks on
llvmlite's module in the same process), and the compiled loops give the plain-Python results."""

import os
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


@pytest.mark.skipif(not compiled.numba_installed(), reason="numba not installed")
def test_a_cached_loop_sees_a_change_to_a_loop_of_another_file(tmp_path):
    """A loop compiled together with a loop of another file of its package runs that loop's new
    code once only the other file changed (numba's own cache key is the caller's file alone)."""
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "outer.py").write_text(
        "from coldset.analysis.compiled import jit\nfrom pkg.inner import step\n\n\n"
        "@jit\ndef total(n):\n    t = 0\n    for i in range(n):\n        t += step(i)\n    return t\n")
    inner = pkg / "inner.py"
    inner.write_text("from coldset.analysis.compiled import jit\n\n\n@jit\ndef step(i):\n    return i + 1\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), *sys.path]),
           "NUMBA_CACHE_DIR": str(tmp_path / "numba")}
    run = [sys.executable, "-c", "from pkg.outer import total; print(total(10))"]

    def total() -> str:
        out = subprocess.run(run, capture_output=True, text=True, timeout=300, env=env)
        assert out.returncode == 0, out.stderr
        return out.stdout.strip()

    assert total() == "55"
    assert any((tmp_path / "numba").rglob("*.nbi"))  # cached on disk
    assert total() == "55"
    inner.write_text(inner.read_text().replace("i + 1", "2 * i"))  # outer.py unchanged
    assert total() == "90"
    # a NUMBA_CACHE_DIR may be shared by checkouts at other states: both states' folders stay
    assert len([d for d in (tmp_path / "numba" / "coldset").iterdir() if d.is_dir()]) == 2


def test_a_new_source_state_deletes_the_older_states_folders_only(tmp_path):
    """prune_other_states removes the other 20-hex-digit digest folders, nothing else."""
    base = tmp_path / "numba"
    old = [base / "0123456789abcdef0123", base / "fedcba9876543210fedc"]
    current = base / "aaaaaaaaaaaaaaaaaaaa"
    keep = [base / "notes", base / "0123456789ABCDEF0123", base / "0123456789abcdef012"]
    for d in old + keep:
        (d / "sub").mkdir(parents=True)
        (d / "sub" / "x.nbi").write_bytes(b"x")
    (base / "abcdefabcdefabcdefab").write_text("a file, not a folder")
    gone = compiled.prune_other_states(base, current)
    assert sorted(gone) == sorted(old)
    assert not any(d.exists() for d in old)
    assert all((d / "sub" / "x.nbi").exists() for d in keep) and (base / "abcdefabcdefabcdefab").is_file()
    assert compiled.prune_other_states(tmp_path / "absent", current) == []
