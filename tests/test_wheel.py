"""The package as a user installs it: a wheel and an sdist built from the checkout (in an
isolated build environment, as pip builds them), accepted by ``twine check``, the wheel
installed into a fresh virtual environment outside the checkout and imported from there,
with its ``py.typed`` marker and its command line.

The fresh environment sees the test environment's dependencies (torch, lightning, ...)
through a path entry, not its ``.pth`` files, so the checkout's editable install cannot
answer the import: ``calib_lightning.__file__`` must lie in the fresh environment.
"""

import shutil
import subprocess
import sys
import sysconfig
import venv
from pathlib import Path

import pytest

import calib_lightning

ROOT = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.slow


def _run(*args: str | Path, cwd: Path) -> str:
    done = subprocess.run([str(a) for a in args], cwd=cwd, capture_output=True, text=True,
                          timeout=900, check=False)  # fmt: skip
    assert done.returncode == 0, f"{args}:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return done.stdout


@pytest.fixture(scope="module")
def dist(tmp_path_factory) -> Path:
    """The sdist and the wheel, built from a copy of what they are made of (the checkout
    stays clean, and two test workers never build in one folder)."""
    pytest.importorskip("build", reason="the test extra installs build")
    source, out = tmp_path_factory.mktemp("source"), tmp_path_factory.mktemp("dist")
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(ROOT / name, source / name)
    shutil.copytree(ROOT / "calib_lightning", source / "calib_lightning",
                    ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))  # fmt: skip
    _run(sys.executable, "-m", "build", "--sdist", "--wheel", "--outdir", out, source, cwd=out)
    return out


def test_wheel_and_sdist_pass_twine_check_and_carry_the_version(dist):
    wheels, sdists = list(dist.glob("*.whl")), list(dist.glob("*.tar.gz"))
    names = sorted(p.name for p in dist.iterdir())
    assert len(wheels) == 1, names
    assert len(sdists) == 1, names
    version = calib_lightning.__version__
    assert f"-{version}-" in wheels[0].name
    assert sdists[0].name.endswith(f"-{version}.tar.gz")
    out = _run(sys.executable, "-m", "twine", "check", "--strict", *wheels, *sdists, cwd=dist)
    assert out.count("PASSED") == 2, out


def test_the_wheel_installs_and_imports_outside_the_checkout(dist, tmp_path):
    env = tmp_path / "env"
    venv.create(env, with_pip=True)
    python = env / "bin" / "python"
    purelib = _run(python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])",
                   cwd=tmp_path).strip()  # fmt: skip
    # the dependencies of this environment, as a plain path (its .pth files stay unread)
    (Path(purelib) / "test_dependencies.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    wheel = next(dist.glob("*.whl"))
    _run(python, "-m", "pip", "install", "--quiet", "--no-deps", "--no-index", wheel,
         cwd=tmp_path)  # fmt: skip
    code = ("import calib_lightning as cl, calib_lightning.functional as F, pathlib; "
            "root = pathlib.Path(cl.__file__).parent; "
            "print(cl.__version__, root, (root / 'py.typed').exists(), "
            "len(cl.__all__), len(F.__all__))")  # fmt: skip
    version, where, typed, names, functional = _run(python, "-c", code, cwd=tmp_path).split()
    assert version == calib_lightning.__version__
    assert Path(where).is_relative_to(env), f"imported from {where}, not the fresh environment"
    assert typed == "True"
    assert int(names) == len(calib_lightning.__all__)
    assert int(functional) == len(calib_lightning.functional.__all__)
    assert "diagnose" in _run(python, "-m", "calib_lightning", "--help", cwd=tmp_path)
