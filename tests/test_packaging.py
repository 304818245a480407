"""The wheel is what `pip install` users get: it must carry the shipped profiles and the C source, and
`dostune tune` must run from it outside the repository."""
import os
import shutil
import subprocess
import sys
import zipfile
from importlib import metadata
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _setuptools_version() -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in metadata.version("setuptools").split(".")[:2])
    except (metadata.PackageNotFoundError, ValueError):
        return (0,)


def _build_wheel(tmp_path: Path) -> Path:
    """Build from a copy of the sources, so the build leaves nothing in the checkout (no build/, no egg-info)."""
    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    shutil.copytree(ROOT / "dostune", src / "dostune", ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    r = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index",
                        "-q", "-w", str(tmp_path / "dist"), str(src)], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr
    (wheel,) = (tmp_path / "dist").glob("dostune-*.whl")
    return wheel


def _venv_with_wheel(tmp_path: Path, wheel: Path) -> Path:
    """A fresh venv holding only the wheel; its dependencies (torch, DeepSpeed, ...) are borrowed from this
    interpreter's site-packages through a .pth file, so nothing is downloaded. The .pth adds those folders
    without running their own .pth files, so an editable install of the checkout stays out of sight."""
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    (site,) = (venv / "lib").glob("python*/site-packages")
    borrowed = [p for p in sys.path if p.endswith(("site-packages", "dist-packages")) and Path(p).is_dir()]
    (site / "borrowed.pth").write_text("\n".join(borrowed) + "\n")
    py = venv / "bin" / "python"
    r = subprocess.run([str(py), "-m", "pip", "install", "--no-deps", "--no-index", "--ignore-installed", "-q",
                        str(wheel)], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr
    return venv


@pytest.mark.slow
@pytest.mark.skipif(_setuptools_version() < (77,), reason="building offline needs setuptools>=77 installed "
                    "(the 'test' extra brings it: bash scripts/install.sh test)")
def test_wheel_carries_profiles_and_tunes_outside_the_repository(tmp_path):
    wheel = _build_wheel(tmp_path)
    names = set(zipfile.ZipFile(wheel).namelist())
    for f in ("dostune/profiles/h100-pcie5.json", "dostune/profiles/h100-pcie5-gpt2-1.3b-b8-s1024.json",
              "dostune/profiles/README.md", "dostune/optim/cpu_adam_oop.c"):
        assert f in names, f"{f} is not in the wheel"

    venv = _venv_with_wheel(tmp_path, wheel)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "DOSTUNE_PROFILES")}
    work = tmp_path / "elsewhere"
    work.mkdir()

    def run(*args):
        return subprocess.run(args, cwd=work, env=env, capture_output=True, text=True, timeout=300)

    r = run(str(venv / "bin" / "dostune"), "--version")
    assert r.returncode == 0 and r.stdout.startswith("dostune "), r.stdout + r.stderr
    r = run(str(venv / "bin" / "python"), "-c", "import dostune; from dostune.profile.paths import shipped_profile; "
            "print(dostune.__file__); print(shipped_profile())")
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
