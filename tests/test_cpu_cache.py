"""The compiled CPU kernel's build cache (``kernels.cpu_ops`` and ``kernels._common.cache_dir``).

A cached library is loaded only after it is checked (private folder, private regular file, sha256 equal to
the one recorded beside it); anything else is rebuilt, or built in a private temporary folder when the
folder itself cannot be trusted. Rebuilds here use a stand-in compiler (``fakecc``: a shell script that
copies one library built once per session with the real compiler and logs each call), so a test costs a
file copy instead of a compile. Each test has its own cache folder and starts from a fresh module state.
"""

from __future__ import annotations

import hashlib
import math
import os
import shutil
import signal
import stat
import subprocess
import sys
import textwrap
import threading
import time
import warnings
from pathlib import Path

import pytest
import torch
from reference import assert_argmax
from srot_fast.kernels import _common, cpu_ops

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the compiled kernel is Linux-only")

_FAKECC = """#!/bin/sh
[ -n "$FAKECC_LOG" ] && echo build >> "$FAKECC_LOG"
out=
while [ $# -gt 0 ]; do
  if [ "$1" = "-o" ]; then out="$2"; fi
  shift
done
exec cp "{prebuilt}" "$out"
"""


def _fresh_state(mp) -> None:
    """Module state as at import: nothing loaded or tried, no warning given, no private folder."""
    mp.setattr(cpu_ops, "_lib", None)
    mp.setattr(cpu_ops, "_tried", False)
    mp.setattr(cpu_ops, "_error", None)
    mp.setattr(_common, "_warned", set(), raising=False)
    mp.setattr(_common, "_private", None, raising=False)


def _libs(folder: Path) -> list:
    return sorted(p for p in folder.iterdir() if p.name.endswith(".so"))


def _temporaries(folder: Path) -> list:
    return sorted(p.name for p in folder.iterdir() if p.name.startswith((".srot_build_", "tmp")))


@pytest.fixture(scope="session")
def seed(tmp_path_factory):
    """One library built with the real compiler, the fakecc script that copies it, and a cache folder
    populated through fakecc (its file names are the ones the module looks for with CXX=fakecc)."""
    cxx = os.environ.get("CXX") or "g++"
    if shutil.which(cxx.split()[0]) is None:
        pytest.skip(f"no C++ compiler ({cxx})")
    root = tmp_path_factory.mktemp("cpu_cache_seed")
    with pytest.MonkeyPatch.context() as mp:
        _fresh_state(mp)
        mp.setenv("SROT_FAST_CACHE", str(root / "real"))
        mp.delenv("SROT_FAST_NO_COMPILE", raising=False)
        if not cpu_ops.available():
            pytest.skip(f"compiled CPU kernel unavailable: {cpu_ops.build_error()}")
    prebuilt = _libs(root / "real")[0]
    fakecc = root / "fakecc"
    fakecc.write_text(_FAKECC.format(prebuilt=prebuilt))
    fakecc.chmod(0o755)
    with pytest.MonkeyPatch.context() as mp:
        _fresh_state(mp)
        mp.setenv("SROT_FAST_CACHE", str(root / "seeded"))
        mp.setenv("CXX", str(fakecc))
        mp.delenv("SROT_FAST_NO_COMPILE", raising=False)
        assert cpu_ops.available(), cpu_ops.build_error()
    return {"prebuilt": prebuilt, "fakecc": fakecc, "seeded": root / "seeded"}


@pytest.fixture
def cache(seed, tmp_path, monkeypatch):
    """A private cache folder holding a copy of the seeded files; CXX = fakecc logging to ``tmp_path/log``."""
    folder = tmp_path / "cache"
    folder.mkdir(mode=0o700)
    for f in seed["seeded"].iterdir():
        if not f.name.startswith("."):
            shutil.copy2(f, folder / f.name)
    _fresh_state(monkeypatch)
    monkeypatch.setenv("SROT_FAST_CACHE", str(folder))
    monkeypatch.setenv("CXX", str(seed["fakecc"]))
    monkeypatch.setenv("FAKECC_LOG", str(tmp_path / "log"))
    monkeypatch.delenv("SROT_FAST_NO_COMPILE", raising=False)
    return folder


def _builds(tmp_path: Path) -> int:
    log = tmp_path / "log"
    return len(log.read_text().split()) if log.exists() else 0


def _recorded_hash_matches(so: Path) -> bool:
    side = so.with_name(so.name + ".sha256")
    return side.is_file() and side.read_text().split()[0] == hashlib.sha256(so.read_bytes()).hexdigest()


def _softmin_ok() -> None:
    x, y = torch.randn(70, 3, dtype=torch.float64), torch.randn(65, 3, dtype=torch.float64)
    h = torch.randn(65, dtype=torch.float64)
    from srot_fast.kernels import tensorized

    torch.testing.assert_close(cpu_ops.softmin(x, y, h, 0.3, 2), tensorized.softmin(x, y, h, 0.3, 2),
                               atol=1e-10, rtol=1e-10)


def _c_library(tmp_path: Path, body: str) -> Path:
    """A shared library compiled from C ``body`` with the system C compiler (skip without one)."""
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler")
    src, lib = tmp_path / "planted.c", tmp_path / "planted.so"
    src.write_text(body)
    subprocess.run([cc, "-shared", "-fPIC", str(src), "-o", str(lib)], check=True, capture_output=True)
    return lib


def _planted_source(marker: Path, abi: int) -> str:
    return textwrap.dedent(f"""
        #include <stdio.h>
        __attribute__((constructor)) static void planted(void) {{
          FILE* f = fopen("{marker}", "w");
          if (f) {{ fputs("ran", f); fclose(f); }}
        }}
        int srot_abi_version(void) {{ return {abi}; }}
    """)


# ------------------------------------------------------------------------------------ valid cache
def test_valid_cache_is_loaded_without_rebuild(cache, tmp_path):
    assert cpu_ops.available(), cpu_ops.build_error()
    assert _builds(tmp_path) == 0
    _softmin_ok()


# --------------------------------------------------------------------------------- damaged files
_TRUNCATED = textwrap.dedent("""
    import torch
    from srot_fast.kernels import cpu_ops, tensorized
    assert cpu_ops.available(), cpu_ops.build_error()
    x, y, h = torch.randn(100, 2, dtype=torch.float64), torch.randn(90, 2, dtype=torch.float64), torch.zeros(90)
    torch.testing.assert_close(cpu_ops.softmin(x, y, h.double(), 0.1, 2), tensorized.softmin(x, y, h.double(), 0.1, 2))
""")


def test_truncated_library_is_rebuilt_not_loaded(cache, tmp_path, seed):
    """A half-written library (a build killed by a full disk, a copy cut short) is never mapped: mapping
    it kills the process with SIGBUS. Run in a child process so that a crash fails this test only."""
    for so in _libs(cache):
        so.write_bytes(so.read_bytes()[: so.stat().st_size // 2])
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    res = subprocess.run([sys.executable, "-c", _TRUNCATED], env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, f"exit status {res.returncode} (-7 = SIGBUS): {res.stderr[-2000:]}"
    assert _builds(tmp_path) == 1
    (so,) = _libs(cache)
    assert so.read_bytes() == seed["prebuilt"].read_bytes() and _recorded_hash_matches(so)


@pytest.mark.parametrize("content", [b"", b"not an ELF file\n" * 64], ids=["empty", "garbage"])
def test_empty_or_garbage_library_is_rebuilt(cache, tmp_path, seed, content):
    for so in _libs(cache):
        so.write_bytes(content)
    assert cpu_ops.available(), cpu_ops.build_error()
    assert _builds(tmp_path) == 1
    (so,) = _libs(cache)
    assert so.read_bytes() == seed["prebuilt"].read_bytes() and _recorded_hash_matches(so)
    _softmin_ok()


def test_group_writable_library_is_replaced(cache, tmp_path):
    (so,) = _libs(cache)
    so.chmod(0o775)
    assert cpu_ops.available(), cpu_ops.build_error()
    assert _builds(tmp_path) == 1
    assert stat.S_IMODE(so.lstat().st_mode) & 0o022 == 0


@pytest.mark.skipif(os.geteuid() != 0, reason="giving a file to another user needs root")
def test_library_owned_by_another_user_is_replaced(cache, tmp_path):
    (so,) = _libs(cache)
    os.chown(so, 54321, 54321)
    assert cpu_ops.available(), cpu_ops.build_error()
    assert _builds(tmp_path) == 1
    assert so.lstat().st_uid == os.getuid()


def test_symlinked_library_is_replaced(cache, tmp_path):
    (so,) = _libs(cache)
    target = tmp_path / "elsewhere.so"
    so.rename(target)
    so.symlink_to(target)
    assert cpu_ops.available(), cpu_ops.build_error()
    assert _builds(tmp_path) == 1
    assert not so.is_symlink() and _recorded_hash_matches(so)


def test_wrong_abi_version_is_rebuilt(cache, tmp_path, seed):
    """A library with a matching sha256 but another ABI version (left by another release) is replaced."""
    (so,) = _libs(cache)
    marker = tmp_path / "constructor_ran"
    planted = _c_library(tmp_path, _planted_source(marker, 999))
    shutil.copyfile(planted, so)
    so.with_name(so.name + ".sha256").write_text(f"{hashlib.sha256(so.read_bytes()).hexdigest()}  {so.name}\n")
    assert cpu_ops.available(), cpu_ops.build_error()
    assert _builds(tmp_path) == 1
    assert so.read_bytes() == seed["prebuilt"].read_bytes() and _recorded_hash_matches(so)
    _softmin_ok()


# ----------------------------------------------------------------------------------- unsafe folders
def test_planted_library_in_shared_folder_is_not_loaded(cache, tmp_path, monkeypatch):
    """A world-writable cache folder: another user can plant a library under the (predictable) cache name,
    with a matching sha256 beside it. It must not be loaded (its constructor would run in this process):
    a warning names the reason and the kernel is built in a private folder instead."""
    shared = tmp_path / "shared"
    shared.mkdir()
    marker = tmp_path / "constructor_ran"
    planted = _c_library(tmp_path, _planted_source(marker, getattr(cpu_ops, "_ABI_VERSION", 1)))
    for f in cache.iterdir():  # the names the module looks for
        if f.name.endswith(".so"):
            shutil.copyfile(planted, shared / f.name)
            (shared / (f.name + ".sha256")).write_text(f"{hashlib.sha256(planted.read_bytes()).hexdigest()}  "
                                                        f"{f.name}\n")
    shared.chmod(0o777)
    monkeypatch.setenv("SROT_FAST_CACHE", str(shared))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ok = cpu_ops.available()
    assert not marker.exists(), "the planted library was loaded"
    assert any("writable by group or others" in str(w.message) for w in caught), [str(w.message) for w in caught]
    assert ok, cpu_ops.build_error()
    assert _builds(tmp_path) == 1  # in the private folder
    _softmin_ok()


def test_folder_owned_by_another_user_is_refused(cache, tmp_path, monkeypatch):
    uid = os.getuid()
    monkeypatch.setattr(os, "getuid", lambda: uid + 1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ok = cpu_ops.available()
    assert any(f"owned by uid {uid}" in str(w.message) for w in caught), [str(w.message) for w in caught]
    assert ok, cpu_ops.build_error()
    assert _builds(tmp_path) == 1  # not loaded from the refused folder: built in a private one


def test_cache_folder_is_created_private(cache, tmp_path, monkeypatch):
    monkeypatch.setenv("SROT_FAST_CACHE", str(tmp_path / "new" / "deeper"))
    old = os.umask(0)  # the most permissive umask: the mode must come from the code
    try:
        folder = _common.cache_dir()
    finally:
        os.umask(old)
    assert folder == (tmp_path / "new" / "deeper").resolve()
    for f in (folder, folder.parent):
        assert stat.S_IMODE(f.stat().st_mode) == 0o700


def test_tilde_and_variables_are_expanded(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv("SROT_TEST_SUB", "sub")
    monkeypatch.setenv("SROT_FAST_CACHE", "~/cache/$SROT_TEST_SUB")
    (tmp_path / "cwd").mkdir()
    monkeypatch.chdir(tmp_path / "cwd")
    _fresh_state(monkeypatch)
    assert Path(_common.cache_dir()) == (tmp_path / "home" / "cache" / "sub").resolve()
    assert list((tmp_path / "cwd").iterdir()) == []


# ------------------------------------------------------------------------------ build temporaries
def test_stale_temporaries_are_removed(cache, tmp_path):
    dead = subprocess.Popen(["true"])
    dead.wait()
    host = cpu_ops._host_tag()
    stale_dead = cache / f".srot_build_{dead.pid}_{host}_x1.so"  # pid gone: a killed build
    stale_old = cache / f".srot_build_{os.getpid()}_{host}_x2.so"  # live pid but two hours old
    live = cache / f".srot_build_{os.getpid()}_{host}_x3.so"  # a build in progress: kept
    for f in (stale_dead, stale_old, live):
        f.write_bytes(b"partial")
    two_hours_ago = time.time() - 7200
    os.utime(stale_old, (two_hours_ago, two_hours_ago))
    assert cpu_ops.available(), cpu_ops.build_error()
    assert not stale_dead.exists() and not stale_old.exists() and live.exists()


_SLOWCC = """#!/bin/sh
sleep 60 &
echo $! > "{pidfile}"
wait
"""


def _slow_compiler(tmp_path: Path, monkeypatch) -> Path:
    pidfile = tmp_path / "child.pid"
    cc = tmp_path / "slowcc"
    cc.write_text(_SLOWCC.format(pidfile=pidfile))
    cc.chmod(0o755)
    monkeypatch.setenv("CXX", str(cc))
    for so in _libs(cache_folder := Path(os.environ["SROT_FAST_CACHE"])):
        so.unlink()  # force a build
    assert cache_folder.is_dir()
    return pidfile


def _gone(pid: int, wait_s: float = 5.0) -> bool:
    """True once ``pid`` has exited (a zombie left to a non-reaping init counts as exited)."""
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X"):
                    return True
        except FileNotFoundError:
            return True
        time.sleep(0.05)
    return False


def test_build_timeout_kills_the_compiler_and_leaves_no_temporary(cache, tmp_path, monkeypatch):
    pidfile = _slow_compiler(tmp_path, monkeypatch)
    monkeypatch.setattr(cpu_ops, "_BUILD_TIMEOUT_S", 3)  # the fake compiler writes its child's pid at once
    with pytest.warns(cpu_ops.CompiledKernelWarning, match="timed out"):
        assert not cpu_ops.available()
    assert _temporaries(cache) == []
    assert _gone(int(pidfile.read_text()))


def test_interrupted_build_kills_the_compiler_and_leaves_no_temporary(cache, tmp_path, monkeypatch):
    pidfile = _slow_compiler(tmp_path, monkeypatch)
    main = threading.get_ident()

    def interrupt():
        deadline = time.monotonic() + 30
        while not pidfile.exists() and time.monotonic() < deadline:  # the compiler is running
            time.sleep(0.05)
        signal.pthread_kill(main, signal.SIGINT)

    # Python's own SIGINT handler even where the process inherited SIGINT ignored (a job started with '&' by a
    # non-interactive shell, or nohup): otherwise the signal would not raise KeyboardInterrupt
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        threading.Thread(target=interrupt, daemon=True).start()
        with pytest.raises(KeyboardInterrupt):
            cpu_ops.available()
            time.sleep(60)  # not reached unless the build ignored the interrupt
    finally:
        signal.signal(signal.SIGINT, previous)
    assert _temporaries(cache) == []
    assert _gone(int(pidfile.read_text()))
    assert not cpu_ops._tried  # the next call tries again


# ---------------------------------------------------------------------------- compiler and warnings
def test_compiler_command_with_arguments(cache, tmp_path, seed, monkeypatch):
    """CXX is split like a shell command line (``CXX="ccache g++"``)."""
    monkeypatch.setenv("CXX", f"env SROT_TEST_UNUSED=1 {seed['fakecc']}")
    with warnings.catch_warnings():
        warnings.simplefilter("error", cpu_ops.CompiledKernelWarning)
        assert cpu_ops.available(), cpu_ops.build_error()
    assert _builds(tmp_path) == 1


def test_missing_compiler_warns_once_with_reason(cache, monkeypatch):
    monkeypatch.setenv("CXX", "/nonexistent/c++")
    for so in _libs(cache):
        so.unlink()
    x, y, h = torch.randn(50, 2), torch.randn(40, 2), torch.zeros(40)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cpu_ops.softmin(x, y, h, 0.1, 1)
        cpu_ops.weighted_mean(x, y, h, 0.1, 1)
        assert not cpu_ops.available()
    ours = [w for w in caught if issubclass(w.category, cpu_ops.CompiledKernelWarning)]
    assert len(ours) == 1 and "/nonexistent/c++" in str(ours[0].message), [str(w.message) for w in caught]
    assert ours[0].filename == __file__  # attributed to the caller, not to srot_fast internals
    assert "/nonexistent/c++" in cpu_ops.build_error()


def test_deliberate_opt_out_does_not_warn(cache, monkeypatch):
    monkeypatch.setenv("SROT_FAST_NO_COMPILE", "1")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert not cpu_ops.available()
    assert "SROT_FAST_NO_COMPILE" in cpu_ops.build_error()


# ------------------------------------------------------------------------------ batched primitives
# A leading batch dimension: x (B, N, D), y (B, M, D), h (B, M), one eps for the batch. Each problem must
# equal the reference on that problem alone (float64 to 1e-12, float32 to 1e-5, relative to the problem's
# cost scale; the argmax up to near-ties, see _assert_argmax) and, on the compiled path, equal the unbatched
# call bit for bit: both run the same native code, and a row's result depends only on its own problem's data
# and on the fixed column-tile order, not on the thread that computes it (checked on its own by
# test_batched_result_does_not_depend_on_threads).
_BATCH_TOL = {torch.float64: 1e-12, torch.float32: 1e-5}


def _batch_problem(nb, n, m, d, dtype, p, seed=0):
    """``nb`` problems with coincident points and -inf columns; with nb = 3 problem 1 has one finite
    column and problem 2 none (+inf soft-min, NaN weighted mean, argmax 0)."""
    g = torch.Generator().manual_seed(seed + 10 * d + p)
    x = torch.randn(nb, n, d, generator=g, dtype=torch.float64)
    y = torch.randn(nb, m, d, generator=g, dtype=torch.float64) + 0.3
    y[:, 5] = x[:, 3]
    h = torch.randn(nb, m, generator=g, dtype=torch.float64) - math.log(m)
    h[:, [0, m // 2, m - 1]] = -math.inf
    if nb == 3:
        h[1, :] = -math.inf
        h[1, 7] = 0.0
        h[2, :] = -math.inf
    return x.to(dtype), y.to(dtype), h.to(dtype)


def _impl(name):
    if name == "torch":
        return {"softmin": cpu_ops.torch_softmin, "weighted_mean": cpu_ops.torch_weighted_mean,
                "plan_argmax": cpu_ops.torch_plan_argmax, "max_cost": cpu_ops.torch_max_cost}
    if not cpu_ops.available():
        pytest.skip(f"compiled CPU kernel unavailable: {cpu_ops.build_error()}")
    return {k: getattr(cpu_ops, k) for k in ("softmin", "weighted_mean", "plan_argmax", "max_cost")}


_BATCH_CASES = [(nb, 37, 53, d, dt, p) for nb in (0, 1, 3) for d in (1, 2, 3, 64)
                for dt in (torch.float32, torch.float64) for p in (1, 2)]
_BATCH_CASES += [(3, 131, 300, 3, dt, p) for dt in (torch.float32, torch.float64) for p in (1, 2)]  # 3 row
# super-blocks (the last one padded) and 2 column tiles per problem


@pytest.mark.parametrize("impl", ["compiled", "torch"])
@pytest.mark.parametrize("nb,n,m,d,dtype,p", _BATCH_CASES)
def test_batched_matches_reference_per_problem(impl, nb, n, m, d, dtype, p):
    from srot_fast.kernels import tensorized as ref

    ops = _impl(impl)
    x, y, h = _batch_problem(nb, n, m, d, dtype, p)
    x64, y64, h64 = x.double(), y.double(), h.double()
    scales = [ref.max_cost(x64[b], y64[b], p).item() for b in range(nb)]
    eps = 0.05 * max(scales, default=1.0)
    got = {
        "softmin": ops["softmin"](x, y, h, eps, p),
        "wmean_y": ops["weighted_mean"](x, y, h, eps, p, "y"),
        "wmean_grad": ops["weighted_mean"](x, y, h, eps, p, "grad"),
        "argmax": ops["plan_argmax"](x, y, h, eps, p),
        "max_cost": ops["max_cost"](x, y, p),
    }
    shapes = {"softmin": (nb, n), "wmean_y": (nb, n, d), "wmean_grad": (nb, n, d), "argmax": (nb, n),
              "max_cost": (nb,)}
    for k, out in got.items():
        assert out.shape == shapes[k], k
        assert out.dtype == (torch.int64 if k == "argmax" else dtype), k
    rtol = _BATCH_TOL[dtype]
    for b in range(nb):
        want = {
            "softmin": ref.softmin(x64[b], y64[b], h64[b], eps, p),
            "wmean_y": ref.weighted_mean(x64[b], y64[b], h64[b], eps, p, "y"),
            "wmean_grad": ref.weighted_mean(x64[b], y64[b], h64[b], eps, p, "grad"),
            "max_cost": ref.max_cost(x64[b], y64[b], p),
        }
        for k, w in want.items():
            torch.testing.assert_close(got[k][b].double(), w, atol=rtol * max(scales[b], 1.0), rtol=rtol,
                                       equal_nan=True, msg=lambda s, k=k, b=b: f"{k}, problem {b}: {s}")
        assert_argmax(got["argmax"][b], h64[b][None, :] - ref.cost_matrix(x64[b], y64[b], p) / eps, rtol)
        if impl == "compiled":
            single = {
                "softmin": cpu_ops.softmin(x[b], y[b], h[b], eps, p),
                "wmean_y": cpu_ops.weighted_mean(x[b], y[b], h[b], eps, p, "y"),
                "wmean_grad": cpu_ops.weighted_mean(x[b], y[b], h[b], eps, p, "grad"),
                "argmax": cpu_ops.plan_argmax(x[b], y[b], h[b], eps, p),
                "max_cost": cpu_ops.max_cost(x[b], y[b], p),
            }
            for k, s in single.items():
                torch.testing.assert_close(got[k][b], s, atol=0, rtol=0, equal_nan=True, msg=f"{k}, problem {b}")


def test_batched_call_is_one_native_call(monkeypatch):
    """The whole batch goes to the library in one call per primitive, not in a Python loop."""
    lib = _impl("compiled") and cpu_ops._load()
    calls = []

    class Counting:
        def __getattr__(self, name):
            calls.append(name)
            return getattr(lib, name)

    monkeypatch.setattr(cpu_ops, "_load", lambda: Counting())
    x, y, h = _batch_problem(5, 37, 53, 2, torch.float64, 2)
    cpu_ops.softmin(x, y, h, 0.5, 2)
    cpu_ops.weighted_mean(x, y, h, 0.5, 2)
    cpu_ops.plan_argmax(x, y, h, 0.5, 2)
    cpu_ops.max_cost(x, y, 2)
    assert calls == ["srot_softmin_f64", "srot_wmean_f64", "srot_argmax_f64", "srot_max_sq_f64"]


@pytest.mark.parametrize("impl", ["compiled", "torch"])
def test_batched_operands_must_agree(impl):
    ops = _impl(impl)
    x, y, h = _batch_problem(2, 10, 12, 2, torch.float64, 1)
    with pytest.raises(ValueError, match="all unbatched or all batched"):
        ops["softmin"](x, y[0], h[0], 0.1, 1)
    with pytest.raises(ValueError, match="all unbatched or all batched"):
        ops["weighted_mean"](x, y, h[0], 0.1, 1)
    with pytest.raises(ValueError, match=r"x \(B, N, D\) and y \(B, M, D\)"):
        ops["plan_argmax"](x, y[:1], h[:1], 0.1, 1)
    with pytest.raises(ValueError, match=r"h \(B, M\)"):
        ops["softmin"](x, y, h[:, :5], 0.1, 1)
    with pytest.raises(ValueError, match=r"x \(N, D\) \| \(B, N, D\)"):
        ops["max_cost"](x[0], y, 1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_batched_result_does_not_depend_on_threads(dtype):
    """Problems and row blocks spread over 2 threads give the 1-thread results (each row's reduction
    order is fixed by the column tiles; the per-problem maxima are merged exactly)."""
    _impl("compiled")
    x, y, h = _batch_problem(6, 303, 200, 3, dtype, 2, seed=1)  # above the one-thread work threshold
    old = torch.get_num_threads()
    outs = []
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            outs.append([cpu_ops.softmin(x, y, h, 0.5, 2), cpu_ops.weighted_mean(x, y, h, 0.5, 2, "grad"),
                         cpu_ops.plan_argmax(x, y, h, 0.5, 2), cpu_ops.max_cost(x, y, 1)])
    finally:
        torch.set_num_threads(old)
    for a, b in zip(*outs):
        torch.testing.assert_close(a, b, atol=0, rtol=0, equal_nan=True)
