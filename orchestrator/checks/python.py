"""python_env and code_sync: orchestrator/remote/nodeinfo.py run by the node's python (-S, no
torch import) reports versions and a workdir digest. `node_info` reads one node; `compare_*`
decide across the cluster (pure too). python_env also reads GPU_PROBE's sections: a node that
trains on NVIDIA GPUs needs a CUDA build of torch with NCCL, one on AMD GPUs a ROCm build with
RCCL."""

from __future__ import annotations

import json
from collections import Counter

from orchestrator.checks import Check, CheckResult, Ctx, Probe, fail, first_line, ok, section, skip, warn
from orchestrator.checks.gpu import GPU, facts
from orchestrator.node import nodeinfo

# ------------------------------------------------------------------ one node


def node_info(text: str) -> tuple[dict | None, str | None]:
    """The nodeinfo.py JSON of the @@python section, or (None, why not)."""
    s = section(text, "python")
    if s is None:
        return None, "not probed"
    for line in reversed(s.body.splitlines()):
        if line.startswith("{"):
            try:
                return json.loads(line), None
            except ValueError:
                break
    return None, first_line(s.body) or f"exit code {s.rc}"


ENV_KEYS = ("python", "torch", "cuda", "hip", "nccl")

CUDA_INDEX = "https://download.pytorch.org/whl/cu12x"
ROCM_INDEX = "https://download.pytorch.org/whl/rocm6.x"


def env_of(info: dict) -> dict[str, str]:
    return {k: str(info.get(k) or "-") for k in ENV_KEYS}


def env_text(env: dict[str, str]) -> str:
    return " ".join(f"{k} {env[k]}" for k in ENV_KEYS if env.get(k, "-") != "-") or "-"


def accelerator(text: str, ctx: Ctx) -> tuple[str | None, str]:
    """("nvidia" | "amd" | None, what was found): the GPUs this node trains on. None for a CPU
    node: no GPU tool, no GPUs, or `gpus: 0` in the inventory (one CPU process by choice)."""
    if ctx.node.gpus == 0:
        return None, "CPU node (gpus: 0)"
    f = facts(text, ctx)
    if f.vendor is None or (f.gpus is not None and not f.gpus):
        return None, "no GPUs found"
    n = f"{len(f.gpus)} " if f.gpus is not None else ""
    return f.vendor, f"{n}{'NVIDIA' if f.vendor == 'nvidia' else 'AMD'} GPU{'s' if n != '1 ' else ''}"


def _inventory_flag(ctx: Ctx) -> str:
    source = ctx.inventory.source
    return f"-i {source}" if source and not source.startswith("<") else "-i <inventory>"


def setup_fix(ctx: Ctx, change: str) -> str | None:
    """With a `setup:` section the nodes' python is the venv setup builds from the requirements
    file (uv, no pip in it): the fix is `change` in that file and setup again. None without one."""
    s = ctx.inventory.setup
    if s is None:
        return None
    what = f"{change} in {s.requirements}, then run " if change else "run "
    return f"{what}`clusterctl setup {_inventory_flag(ctx)}`, which rebuilds {s.venv} on every node"


def torch_build_remedy(ctx: Ctx, pin: str, vendor: str) -> str:
    """How to get the torch build the node's GPUs need, the way its environment is made: the
    setup venv's requirements file, else pip in the node's python."""
    index, label, example = (CUDA_INDEX, "cu12x: the CUDA version `nvidia-smi` shows or lower", "cu126") \
        if vendor == "nvidia" else (ROCM_INDEX, "rocm6.x: the installed ROCm release", "rocm6.3")
    build = "CUDA" if vendor == "nvidia" else "ROCm"
    wanted = f"{pin}+{example}" if "==" in pin else pin
    via_setup = setup_fix(ctx, f"ask for the {build} build (`--extra-index-url {index}` and `{wanted}`; "
                               f"{label})")
    if via_setup:
        return f"{via_setup}; or set `gpus: 0` to run it as a CPU node"
    return (f"`{ctx.node.python} -m pip install {pin} --index-url {index}` on {ctx.node.name} ({label}, "
            f"e.g. {example}), or set `gpus: 0` to run it as a CPU node")


def check_accelerator(info: dict, text: str, ctx: Ctx) -> CheckResult | None:
    """A fail or warn when torch cannot drive the node's GPUs, None when it can (or no GPUs)."""
    vendor, found = accelerator(text, ctx)
    if vendor is None:
        return None
    torch = info.get("torch")
    pin = f"torch=={torch.split('+')[0]}" if torch and torch != "?" else "torch"
    if vendor == "nvidia":
        if not info.get("cuda"):
            build = f"a ROCm build (hip {info['hip']})" if info.get("hip") else "a CPU-only build"
            return fail("python_env", f"torch {torch} is {build} but the node has {found} (torch.version.cuda "
                        "is None)", torch_build_remedy(ctx, pin, "nvidia"))
        if not info.get("nccl"):
            return warn("python_env", f"torch {torch} (CUDA {info['cuda']}) on {found}, but no NCCL found next "
                        "to it (no nvidia-nccl-cu* package, no libnccl in torch/lib)",
                        (setup_fix(ctx, f"take torch from {CUDA_INDEX} (`--extra-index-url`; it brings "
                                        "nvidia-nccl-cu12)") or
                         f"install torch from {CUDA_INDEX} (it brings nvidia-nccl-cu12)") + "; a build without "
                        "NCCL cannot use the nccl backend")
        return None
    if not info.get("hip"):
        build = f"a CUDA build (cuda {info['cuda']})" if info.get("cuda") else "a CPU-only build"
        return fail("python_env", f"torch {torch} is {build} but the node has {found} (torch.version.hip is None)",
                    torch_build_remedy(ctx, pin, "amd"))
    if not info.get("rccl"):
        return warn("python_env", f"torch {torch} (HIP {info['hip']}) on {found}, but no RCCL found "
                    "(no librccl in torch/lib or /opt/rocm/lib)",
                    (setup_fix(ctx, f"take torch from {ROCM_INDEX} (`--extra-index-url`)") or
                     f"install torch from {ROCM_INDEX}, or ROCm's rccl package") + ": the nccl backend needs RCCL")
    return None


# ------------------------------------------------------------------ across the cluster


def _reference(values: dict[str, object], master: str, control: object = None) -> object:
    """The value the others must equal: the control machine's when given, else the most common
    (ties go to the master's)."""
    if control is not None:
        return control
    counts = Counter(values.values())
    top = max(counts.values())
    tied = [v for v, c in counts.items() if c == top]
    return values[master] if values.get(master) in tied else tied[0]


def compare_python_env(texts: dict[str, str], ctx_of: dict[str, Ctx], master: str | None = None
                       ) -> dict[str, CheckResult]:
    out, envs, notes = {}, {}, {}
    for name, text in texts.items():
        info, why = node_info(text)
        node = ctx_of[name].node
        if info is None:
            out[name] = fail("python_env", f"{node.python} does not run: {why}",
                             setup_fix(ctx_of[name], "") or
                             f"install Python (and torch) on {name}, or set `python:` for it in the inventory")
            continue
        envs[name] = env_of(info)
        if envs[name]["torch"] == "-":
            out[name] = fail("python_env", f"{env_text(envs[name])}; torch is not installed for {node.python}",
                             setup_fix(ctx_of[name], "add torch") or f"`{node.python} -m pip install torch` on {name}")
            continue
        r = check_accelerator(info, text, ctx_of[name])
        if r is not None and r.status == "fail":
            out[name] = r
        elif r is not None:
            notes[name] = r
    if not envs:
        return out
    if master is None or master not in envs:
        master = next((k for k, c in ctx_of.items() if c.is_master and k in envs), next(iter(envs)))
    ref_env = dict(_reference({k: tuple(sorted(v.items())) for k, v in envs.items()}, master))
    for name, env in envs.items():
        if name in out:
            continue
        diff = [k for k in ENV_KEYS if env[k] != ref_env[k]]
        if diff:
            side = ", ".join(f"{k} {env[k]} (others {ref_env[k]})" for k in diff)
            same = setup_fix(ctx_of[name], "") or f"install the same versions on {name} ({env_text(ref_env)})"
            out[name] = fail("python_env", f"mismatch: {side}",
                             f"{same}; mixed torch/NCCL versions hang or crash in the first collective")
        else:
            out[name] = notes.get(name) or ok("python_env", env_text(env))
    return out


def name_some(paths: list[str], limit: int = 3) -> str:
    """"a, b, c and 12 more"."""
    shown = ", ".join(paths[:limit])
    return shown + (f" and {len(paths) - limit} more" if len(paths) > limit else "")


def differences(mine: dict[str, str], ref: dict[str, str], ref_name: str) -> str:
    """What differs between a node's per-file hashes and the reference's (`ref_name`), a few
    names of each kind."""
    changed = sorted(p for p in mine if p in ref and mine[p] != ref[p])
    missing = sorted(p for p in ref if p not in mine)
    extra = sorted(p for p in mine if p not in ref)
    parts = [f"{what} {name_some(paths)}" for what, paths in (
        ("changed:", changed), ("missing:", missing), (f"not in {ref_name}:", extra)) if paths]
    return "; ".join(parts) or "the node did not list its files"


def _source(control: dict) -> str:
    return f"this machine's {control['source']}" if control.get("source") else "this machine's copy"


def sync_remedy(ctx: Ctx) -> str:
    return f"`clusterctl sync {_inventory_flag(ctx)}` pushes it"


def compare_code_sync(texts: dict[str, str], ctx_of: dict[str, Ctx], master: str | None = None,
                      control: dict | None = None, required: bool = False) -> dict[str, CheckResult]:
    """Every node's workdir holds what a sync from this machine ships (`control`: nodeinfo's
    digest with per-file hashes of that selection), else the same as the other nodes. A missing
    workdir fails; an empty one fails when there is a control copy or `required`."""
    out, codes = {}, {}
    for name, text in texts.items():
        info, why = node_info(text)
        wd, remedy = ctx_of[name].node.workdir, sync_remedy(ctx_of[name])
        code = (info or {}).get("code")
        if info is None or not code:
            out[name] = skip("code_sync", f"no digest: the node's python does not run ({why})")
        elif code.get("kind") == "missing":
            out[name] = fail("code_sync", f"{wd} does not exist", remedy)
        elif not code["files"] and (control is not None or required):
            n = len((control or {}).get("hashes") or {})
            has = f": {n} file{'' if n == 1 else 's'} to ship from {_source(control)}" if control else ""
            out[name] = fail("code_sync", f"{wd} holds no code{has}", remedy)
        else:
            codes[name] = code
    if not codes:
        return out
    if control is not None:
        ref_digest, ref, against = control["digest"], control.get("hashes") or {}, _source(control)
        ref_name = "this machine's copy"
    else:
        if master is None or master not in codes:
            master = next((k for k, c in ctx_of.items() if c.is_master and k in codes), next(iter(codes)))
        ref_digest = _reference({k: v["digest"] for k, v in codes.items()}, master)
        ref_node = master if codes[master]["digest"] == ref_digest else \
            next(k for k, v in codes.items() if v["digest"] == ref_digest)
        ref, against, ref_name = codes[ref_node].get("hashes") or {}, f"the other nodes ({ref_node})", ref_node
    for name, code in codes.items():
        head = f" (git {code['head']}{', dirty' if code.get('dirty') else ''})" if code.get("head") else ""
        n = code["files"]
        what = f"{n} file{'' if n == 1 else 's'}, digest {code['digest']}{head}"
        if code["digest"] == ref_digest:
            out[name] = ok("code_sync", what)
        else:
            diff = differences(code.get("hashes") or {}, ref, ref_name)
            out[name] = fail("code_sync", f"workdir ({what}) differs from {against}: {diff}",
                             sync_remedy(ctx_of[name]))
    return out


# ------------------------------------------------------------------ probe and registration

# nodeinfo runs with -S: no site (its .pth imports cost ~14 ms a node); it finds site-packages itself.
# The workdir digest only when code_sync is asked for ("-" skips it), of what a sync ships (the
# probe's --include/--exclude/--never arguments); the run's outputs are not code (the probe's
# --output arguments: the same directories sync leaves out, so a tracked runs/ package is code
# on both sides).
PYTHON = Probe("python", """pwd_arg=-
if want code_sync; then pwd_arg=$wd; fi
echo "@@python"
""" + nodeinfo.probe_text() + """echo "@@rc $?"
""")

PYTHON_ENV = Check(
    "python_env", "the same Python/torch/CUDA/NCCL everywhere, and a torch that drives the node's GPUs",
    "install the same torch on every node, a CUDA build (download.pytorch.org/whl/cu12x) on NVIDIA "
    "GPUs, a ROCm build (whl/rocm6.x) on AMD GPUs",
    probes=(GPU, PYTHON), compare=compare_python_env)
CODE_SYNC = Check(
    "code_sync", "every workdir holds what `sync` ships from the checkout here (else the same as the others)",
    "`clusterctl sync -i <inventory>` pushes it",
    probes=(PYTHON,), compare=lambda texts, ctx_of: compare_code_sync(
        texts, ctx_of, control=next((c.extra.get("control_code") for c in ctx_of.values()), None),
        required=any(c.extra.get("code_required") for c in ctx_of.values())), fast=True)
