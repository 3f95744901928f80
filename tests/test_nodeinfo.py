"""nodeinfo.py, the node-side half of python_env/code_sync: preflight runs it with `python -S`
(no site, so no .pth imports), and it must still find torch where `import torch` would."""

import json
import subprocess
import sys
import venv
from pathlib import Path

import torch

from orchestrator.checks import load_nodeinfo
from orchestrator.probe import local_argv


VERSION_PY = '''from typing import Optional

__all__ = ['__version__', 'debug', 'cuda', 'git_version', 'hip']
__version__ = '2.5.1+cu124'
debug = False
cuda: Optional[str] = '12.4'  # the CUDA runtime torch was built with
git_version = 'a8d6afb511a69687bbb2b7e88a3cf67917e1697e'
hip: Optional[str] = None
'''


def info(python, *args, env=None):
    out = subprocess.run(local_argv("nodeinfo", "info", "-", *args, python=str(python), flags=("-S",)),
                         stdin=subprocess.DEVNULL, capture_output=True, text=True, check=True, env=env)
    return json.loads(out.stdout)


def test_without_site_it_finds_the_torch_this_python_imports():
    doc = info(sys.executable)
    assert doc["torch"] == torch.__version__
    assert doc["python"] == "%d.%d.%d" % sys.version_info[:3]


def fake_venv(root: Path, system_site=False) -> tuple[Path, Path]:
    venv.EnvBuilder(with_pip=False, symlinks=True, system_site_packages=system_site).create(root)
    v = f"python{sys.version_info.major}.{sys.version_info.minor}"
    return root / "bin" / "python", root / "lib" / v / "site-packages"


def test_a_venvs_torch_cuda_and_pip_nccl(tmp_path):
    python, site = fake_venv(tmp_path / "venv")
    (site / "torch").mkdir()
    (site / "torch" / "version.py").write_text(VERSION_PY)
    (site / "nvidia_nccl_cu12-2.21.5.dist-info").mkdir()
    doc = info(python)
    assert (doc["torch"], doc["cuda"], doc["hip"], doc["nccl"]) == ("2.5.1+cu124", "12.4", None, "2.21.5")
    assert doc["executable"] == str(python)


def test_a_pth_directory_line_is_followed_and_its_import_lines_are_not_run(tmp_path):
    python, site = fake_venv(tmp_path / "venv")
    elsewhere = tmp_path / "elsewhere"
    (elsewhere / "torch").mkdir(parents=True)
    (elsewhere / "torch" / "version.py").write_text("__version__ = '9.9.9'\ncuda = None\n")
    marker = tmp_path / "ran"
    (site / "extra.pth").write_text(f"# a comment\n{elsewhere}\nimport os; open({str(marker)!r}, 'w')\n")
    assert info(python)["torch"] == "9.9.9"
    assert not marker.exists()


def test_no_torch_and_an_unusual_version_file(tmp_path):
    python, site = fake_venv(tmp_path / "venv")
    assert info(python)["torch"] is None
    (site / "torch").mkdir()
    (site / "torch" / "version.py").write_text("import os\n__version__ = os.environ['X']\n")
    assert info(python)["torch"] == "?"


def test_json_without_the_json_module():
    ni = load_nodeinfo()
    value = {"a": None, "b": True, "c": [3, "x"], "d": 'q"b\\s\n\t\x01é😀\udcff', "e": {}}
    assert json.loads(ni.dumps(value)) == value


def test_a_rocm_torch_with_its_bundled_rccl_and_a_cuda_torch_with_libnccl_in_torch_lib(tmp_path):
    python, site = fake_venv(tmp_path / "venv")
    (site / "torch" / "lib").mkdir(parents=True)
    (site / "torch" / "version.py").write_text("__version__ = '2.13.0+rocm6.3'\ncuda = None\nhip = '6.3.42131'\n")
    if not Path("/opt/rocm/lib").is_dir():  # a machine with ROCm installed has a system RCCL
        assert (info(python)["hip"], info(python)["rccl"]) == ("6.3.42131", None)
    (site / "torch" / "lib" / "librccl.so").write_bytes(b"")
    doc = info(python)
    assert (doc["hip"], doc["rccl"], doc["cuda"], doc["nccl"]) == ("6.3.42131", "bundled", None, None)
    (site / "torch" / "version.py").write_text("__version__ = '2.0.1'\ncuda = '11.8'\nhip = None\n")
    (site / "torch" / "lib" / "libnccl.so.2").write_bytes(b"")
    doc = info(python)
    assert (doc["cuda"], doc["nccl"], doc["rccl"]) == ("11.8", "bundled", None)
