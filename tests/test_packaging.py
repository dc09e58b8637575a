"""Packaging: the import is light (no triton / pykeops), the kernels live at ``srot_fast.kernels``
and nowhere else, and the public names resolve."""
import importlib
import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import srot_fast

REPO = Path(__file__).resolve().parents[1]


def _run(code: str, cwd) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    return subprocess.run([sys.executable, "-c", code], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=120)


def test_import_pulls_neither_triton_nor_pykeops(tmp_path):
    code = ("import sys, srot_fast, srot_fast.kernels\n"
            "bad = sorted(m for m in ('triton', 'pykeops') if m in sys.modules)\n"
            "assert not bad, bad\n"
            "print('ok')")
    out = _run(code, tmp_path)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"


def test_kernels_subpackage_name():
    import srot_fast.kernels as k
    from srot_fast.kernels import tensorized

    assert k.__name__ == "srot_fast.kernels"
    assert tensorized.__name__ == "srot_fast.kernels.tensorized"
    for fn in ("softmin", "weighted_mean", "plan_argmax", "max_cost", "cost_matrix"):
        assert callable(getattr(tensorized, fn))


def test_every_public_name_resolves():
    assert srot_fast.__all__, "srot_fast.__all__ is empty"
    for name in srot_fast.__all__:
        assert getattr(srot_fast, name) is not None, name
    assert isinstance(srot_fast.__version__, str)
    # the lazily imported classes are the real ones
    from srot_fast.loss import SROTLoss

    assert srot_fast.SROTLoss is SROTLoss
    assert "OutlierDetector" in srot_fast.__all__ and isinstance(srot_fast.OutlierDetector, type)


def test_top_level_kernels_is_not_ours(tmp_path):
    """From outside the repository, ``kernels`` must not resolve to our folder (it installs only as
    srot_fast.kernels; a different PyPI project is called 'kernels')."""
    code = ("import importlib.util, json\n"
            "spec = importlib.util.find_spec('kernels')\n"
            "print(json.dumps(None if spec is None else str(spec.origin)))")
    out = _run(code, tmp_path)
    assert out.returncode == 0, out.stderr
    origin = out.stdout.strip()
    assert origin == "null" or str(REPO) not in origin, origin


def test_kernels_folder_refuses_top_level_import(tmp_path):
    """Even with the repository root on sys.path, ``import kernels`` fails loudly instead of
    shadowing srot_fast.kernels under a second name."""
    code = (f"import sys; sys.path.insert(0, {str(REPO)!r})\n"
            "try:\n"
            "    import kernels\n"
            "except ImportError as e:\n"
            "    print('refused:', e)\n"
            "else:\n"
            "    print('imported', kernels.__file__)")
    out = _run(code, tmp_path)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("refused:") and "srot_fast.kernels" in out.stdout


def test_backends_are_lazy():
    from srot_fast.backends import available_backends

    names = available_backends()
    assert "tensorized" in names
    assert importlib.util.find_spec("srot_fast.kernels.tensorized") is not None
    importlib.import_module("srot_fast.kernels.tensorized")


def test_setup_lists_every_subpackage():
    """Every folder of srot_fast/ with an __init__.py (and kernels/) is in setup.py's package list, so a
    non-editable install (a wheel) ships it: the CLI imports srot_fast.experiments at start-up."""
    import ast
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    tree = ast.parse((root / "setup.py").read_text())
    call = next(n for n in ast.walk(tree) if isinstance(n, ast.Call) and getattr(n.func, "id", "") == "setup")
    listed = set(ast.literal_eval(next(k.value for k in call.keywords if k.arg == "packages")))
    found = {"srot_fast"} | {"srot_fast." + p.parent.name for p in (root / "srot_fast").glob("*/__init__.py")}
    kernels = (root / "kernels").rglob("__init__.py")  # kernels/ installs as srot_fast.kernels (and its subpackages)
    found |= {".".join(("srot_fast",) + p.parent.relative_to(root).parts) for p in kernels}
    assert found <= listed, sorted(found - listed)
