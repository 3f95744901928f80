"""A node's Python and torch facts for nodeinfo.py `info` (preflight's python_env): Python's version,
the venv, torch's, CUDA's, ROCm's and NCCL's versions, read without importing torch (its version.py
and dist-info read as text: milliseconds instead of seconds) and without running site (`python -S`).
"""
import os
import sys

def _literal_assignments(path):
    """`name = 'x'` / `name: T = 'x'` / `name = None` lines of torch/version.py, read as text
    (importing torch takes seconds on a GPU box; even `ast` costs a few ms per node)."""
    out = {}
    try:
        with open(path, encoding="utf-8") as f:
            lines = f.read().splitlines()
    except (OSError, ValueError):
        return out
    for line in lines:
        if line[:1].isspace() or "=" not in line:
            continue
        left, _, value = line.partition("=")
        name = left.split(":", 1)[0].strip()
        value = value.split("#", 1)[0].strip()
        if not name.isidentifier():
            continue
        if value == "None":
            out[name] = None
        elif len(value) >= 2 and value[0] == value[-1] and value[0] in "'\"" and value[0] not in value[1:-1]:
            out[name] = value[1:-1]
    return out


def venv_prefix():
    """(prefix, include-system-site-packages) when this interpreter is a venv's, else None.
    Under -S, site.venv() has not run, so sys.prefix is still the base Python's."""
    exe_dir = os.path.dirname(os.path.abspath(sys.executable))
    for d in (exe_dir, os.path.dirname(exe_dir)):
        cfg = os.path.join(d, "pyvenv.cfg")
        if os.path.isfile(cfg):
            system_site = False
            try:
                with open(cfg, encoding="utf-8", errors="replace") as f:
                    for line in f:
                        key, eq, value = line.partition("=")
                        if eq and key.strip().lower() == "include-system-site-packages":
                            system_site = value.strip().lower() == "true"
            except OSError:
                pass
            return os.path.dirname(exe_dir), system_site
    return None


def site_dirs():
    """Where `import torch` would look, without running site (the probe runs python -S): sys.path
    as it is (PYTHONPATH, stdlib), the prefix's site-packages (venvs included), the user site, and
    the directory lines of their .pth files. `import` lines of .pth files are not run."""
    import site

    dirs = [d for d in sys.path if d]
    extra, system_site = [], True
    venv = venv_prefix()
    if venv is not None:  # what site.venv() does, minus running the .pth files
        prefix, system_site = venv
        v = f"python{sys.version_info.major}.{sys.version_info.minor}"
        # the venv layout itself: distro patches to getsitepackages (Debian's dist-packages)
        # only apply once site.venv() has changed sys.prefix, which -S skips
        extra += [os.path.join(prefix, lib, v, "site-packages") for lib in dict.fromkeys(
            [getattr(sys, "platlibdir", "lib"), "lib"])] + [os.path.join(prefix, "Lib", "site-packages")]
    if system_site:
        extra += site.getsitepackages()
    if system_site and site.check_enableusersite():
        extra.append(site.getusersitepackages())
    for d in extra:
        if not os.path.isdir(d) or d in dirs:
            continue
        dirs.append(d)
        try:
            pths = sorted(n for n in os.listdir(d) if n.endswith(".pth"))
        except OSError:
            continue
        for name in pths:
            try:
                with open(os.path.join(d, name), encoding="utf-8", errors="replace") as f:
                    for line in f:
                        line = line.strip()
                        if not line or line.startswith(("#", "import ", "import\t")):
                            continue
                        p = os.path.join(d, line)
                        if os.path.isdir(p) and p not in dirs:
                            dirs.append(p)
            except OSError:
                continue
    return dirs


def _nccl_version(dirs):
    """The pip-shipped NCCL (nvidia-nccl-cuXX wheel), from its dist-info directory name."""
    for d in dirs:
        try:
            names = os.listdir(d or ".")
        except OSError:
            continue
        for name in names:
            if name.startswith("nvidia_nccl_cu") and name.endswith(".dist-info"):
                dist, _, version = name[:-len(".dist-info")].partition("-")
                if dist[len("nvidia_nccl_cu"):].isdigit() and version and "-" not in version:
                    return version
    return None


def _bundled(dirs, prefix):
    """"bundled" when a directory holds lib<prefix>*.so* (torch/lib of a wheel that ships it)."""
    for d in dirs:
        try:
            if any(n.startswith(prefix) and ".so" in n for n in os.listdir(d)):
                return "bundled"
        except OSError:
            continue
    return None


def versions():
    """Python and torch facts without importing torch: torch/version.py read as text, NCCL from
    the nvidia-nccl-cu* wheel (or a libnccl in torch/lib), RCCL from librccl in torch/lib or
    /opt/rocm/lib. Set only for a CUDA (nccl) or ROCm (rccl) build of torch."""
    v = sys.version_info
    info = {"python": f"{v.major}.{v.minor}.{v.micro}", "executable": sys.executable, "torch": None,
            "cuda": None, "hip": None, "nccl": None, "rccl": None}
    dirs = site_dirs() if sys.flags.no_site else [d for d in sys.path if d]
    for d in dirs:
        version_py = os.path.join(d, "torch", "version.py")
        if os.path.isfile(version_py):
            lit = _literal_assignments(version_py)
            info.update(torch=lit.get("__version__", "?"), cuda=lit.get("cuda"), hip=lit.get("hip"))
            lib = os.path.join(d, "torch", "lib")
            if info["cuda"]:
                info["nccl"] = _nccl_version(dirs) or _bundled([lib], "libnccl")
            if info["hip"]:
                info["rccl"] = _bundled([lib, "/opt/rocm/lib"], "librccl")
            break
    return info

