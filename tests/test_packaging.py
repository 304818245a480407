"""The wheel is what `pip install` users get: it must carry every module, the shipped profiles (the top-level
profiles/ folder, as dostune/profiles/) and the C source, and `dostune tune` must run from it outside the
repository. An editable install finds the shipped profiles in the checkout's profiles/."""
import os
import shutil
import subprocess
import sys
import zipfile
from importlib import metadata
from pathlib import Path

import pytest

from dostune.profile.paths import SHIPPED_NODE

ROOT = Path(__file__).resolve().parents[1]


def _setuptools_version() -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in metadata.version("setuptools").split(".")[:2])
    except (metadata.PackageNotFoundError, ValueError):
        return (0,)


needs_setuptools = pytest.mark.skipif(_setuptools_version() < (77,), reason="building offline needs setuptools>=77 "
                                      "installed (the 'test' extra brings it: bash scripts/install.sh test)")


def _sources(tmp_path: Path) -> Path:
    """A copy of what a build reads, so that building leaves nothing in the checkout (no build/, no egg-info), with
    a profile measured into profiles/ as `dostune profile` leaves one in a checkout."""
    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    for folder in ("dostune", "profiles"):
        shutil.copytree(ROOT / folder, src / folder, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    (src / "profiles" / "mynode.json").write_text("{}")
    return src


def _build_wheel(tmp_path: Path) -> Path:
    r = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index",
                        "-q", "-w", str(tmp_path / "dist"), str(_sources(tmp_path))], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr
    (wheel,) = (tmp_path / "dist").glob("dostune-*.whl")
    return wheel


def _venv_with(tmp_path: Path, *install: str) -> Path:
    """A fresh venv holding only dostune (``install``: pip's arguments); its dependencies (torch, DeepSpeed, ...) are
    borrowed from this interpreter's site-packages through a .pth file, so nothing is downloaded. The .pth adds those
    folders without running their own .pth files, so an editable install of the checkout stays out of sight."""
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    (site,) = (venv / "lib").glob("python*/site-packages")
    borrowed = [p for p in sys.path if p.endswith(("site-packages", "dist-packages")) and Path(p).is_dir()]
    (site / "borrowed.pth").write_text("\n".join(borrowed) + "\n")
    py = venv / "bin" / "python"
    r = subprocess.run([str(py), "-m", "pip", "install", "--no-deps", "--no-index", "--ignore-installed", "-q",
                        *install], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr
    return venv


def _runner(tmp_path: Path):
    """Runs a command in a folder outside the repository, without this session's PYTHONPATH or DOSTUNE_PROFILES."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "DOSTUNE_PROFILES")}
    work = tmp_path / "elsewhere"
    work.mkdir()

    def run(*args):
        return subprocess.run(args, cwd=work, env=env, capture_output=True, text=True, timeout=300)
    return work, run


WHERE = ("import dostune; from dostune.profile.paths import shipped_profile; print(dostune.__file__); "
         "print(shipped_profile())")


@pytest.mark.slow
@needs_setuptools
def test_wheel_carries_profiles_and_tunes_outside_the_repository(tmp_path):
    wheel = _build_wheel(tmp_path)
    names = set(zipfile.ZipFile(wheel).namelist())
    # the default node profile and its model profile, and the H100 ones that users on an H100 name with --profile
    shipped = (f"dostune/profiles/{SHIPPED_NODE}", "dostune/profiles/h200-pcie5-gpt2-1.3b-b8-s1024.json",
               "dostune/profiles/h100-pcie5.json", "dostune/profiles/h100-pcie5-gpt2-1.3b-b8-s1024.json",
               "dostune/profiles/h100-pcie5-gpt2-2.7b-b8-s1024.json")
    for f in (*shipped, "dostune/profiles/README.md", "dostune/optim/cpu_adam_oop.c"):
        assert f in names, f"{f} is not in the wheel"
    modules = {p.relative_to(ROOT).as_posix() for p in (ROOT / "dostune").rglob("*.py")}
    assert modules <= names, f"modules missing from the wheel (pyproject.toml's packages): {sorted(modules - names)}"
    # the shipped profiles alone: not one a checkout measured, nor a top-level folder of their own
    assert "dostune/profiles/mynode.json" not in names and not any(n.startswith("profiles/") for n in names)

    venv = _venv_with(tmp_path, str(wheel))
    work, run = _runner(tmp_path)

    r = run(str(venv / "bin" / "dostune"), "--version")
    assert r.returncode == 0 and r.stdout.startswith("dostune "), r.stdout + r.stderr
    r = run(str(venv / "bin" / "python"), "-c", WHERE)
    assert r.returncode == 0, r.stderr
    module, profile = r.stdout.split()
    assert Path(module).is_relative_to(venv) and Path(profile).is_relative_to(venv), r.stdout
    # --profile named explicitly so that the test means the same on a machine with a GPU
    r = run(str(venv / "bin" / "dostune"), "tune", "--profile", profile, "--model", "gpt2-1.3b", "--trials", "3",
            "--output-dir", "tuned", "--verbose")
    assert r.returncode == 0, r.stderr
    assert (work / "tuned" / "ds_config.json").exists() and "Traceback" not in r.stderr
    # the packaged model profile beside it was found (--verbose names the profiles read)
    assert f"model profile: {venv}" in " ".join(r.stderr.split())


@pytest.mark.slow
@needs_setuptools
def test_editable_install_finds_the_checkouts_profiles(tmp_path):
    """`pip install -e .` (scripts/install.sh) imports the checkout's own package, and finds the shipped profiles in
    the checkout's top-level profiles/ beside it."""
    src = _sources(tmp_path)
    venv = _venv_with(tmp_path, "--no-build-isolation", "-e", str(src))
    _, run = _runner(tmp_path)
    r = run(str(venv / "bin" / "python"), "-c", WHERE)
    assert r.returncode == 0, r.stderr
    module, profile = r.stdout.split()
    assert Path(module) == src / "dostune" / "__init__.py" and Path(profile) == src / "profiles" / SHIPPED_NODE
