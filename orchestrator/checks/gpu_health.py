"""gpu_health: a node whose GPUs are sick fails, naming the GPU, why, and what fixes it.

It reads, on GPU nodes only: `nvidia-smi -q` (ECC, retired pages, remapped rows, clock-event
reasons, PCIe link, persistence mode, the driver's recovery action), `nvidia-smi nvlink --status`,
`amd-smi metric --ecc --ecc-blocks`, the NVIDIA Xid lines the kernel logged since the check before
(dmesg, else journalctl -k) and, where the inventory's `checks.gpu_diag` asks and dcgmi exists,
`dcgmi diag -r 1`. Parsers: orchestrator/gpus/health.py and gpus/kernel.py.

The rules (`nvidia_findings`, `nvlink_findings`, `xid_findings`, `amd_findings`, `dcgm_findings`):
  fail: volatile uncorrectable ECC errors; retired pages pending; row remapping pending or failed;
        HW slowdown, HW thermal slowdown or HW power-brake slowdown active; a recovery action the
        driver asks for; a hardware Xid since the last check; AMD uncorrectable or deferred ECC
        errors; a failed dcgmi test; `nvidia-smi -q` itself failing.
  warn: PCIe link narrower than the slot allows; PCIe generation below its max while the GPU is
        busy (an idle GPU trains its link down to save power); persistence mode off; NVLink links
        inactive on a GPU (or none active where the node's other GPUs have some): NCCL falls back
        to PCIe; an application Xid (a bad address, a killed job); dcgmi diag warnings or not
        running; `nvidia-smi -q` listing fewer GPUs than it says are attached.
  Unreported fields ("N/A", "[Not Supported]") are never findings. A kernel log this account may
  not read is said in the detail, not a failure.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from orchestrator.checks import Check, Ctx, CheckResult, Probe, fail, ok, sections, skip, warn
from orchestrator.gpus.health import (AMD_HEALTH_ARGV, DCGM_DIAG_ARGV, NVIDIA_HEALTH_ARGV, NVLINK_ARGV, AmdEcc,
                                      DcgmTest, NvidiaHealth, NvLinks, parse_amd_ecc, parse_dcgm_diag,
                                      parse_nvidia_query, parse_nvlink_status)
from orchestrator.gpus.kernel import APPLICATION_XIDS, XID_MEANING, Xid, parse_xids, pci_key

# The kernel log's window: since the check before this one on the node, kept in
# ~/.clusterctl/gpu-health.mark as "SINCE OPENED LAST" (epoch seconds) and replaced atomically.
# The first check looks back LOOKBACK_S. Checks within SAME_WINDOW_S of the one that opened a
# window share it: preflight's later rounds on a node, nodes that share one home directory.
LOOKBACK_S = 24 * 3600
SAME_WINDOW_S = 120
# dcgmi diag -r 1 is cut after this long: the node's whole probe has 60 s (checks/preflight.py).
DIAG_TIMEOUT_S = 40
HEALTH = Probe("gpu_health", r"""
if has nvidia-smi; then
  echo "@@nvidia-health"
  @@NVIDIA@@ 2>&1
  echo "@@rc $?"
  echo "@@nvlink"
  @@NVLINK@@ 2>&1
  echo "@@rc $?"
  if want gpu_diag && has dcgmi; then
    echo "@@dcgm-diag"
    if has timeout; then timeout @@DIAG_S@@ @@DCGM@@ 2>&1; else @@DCGM@@ 2>&1; fi
    echo "@@rc $?"
  fi
fi
if has amd-smi; then
  echo "@@amd-health"
  @@AMD@@ 2>&1
  echo "@@rc $?"
elif has rocm-smi; then
  echo "@@amd-no-amd-smi"
fi
if has nvidia-smi || has amd-smi || has rocm-smi; then
  gh_num() { case $1 in ''|*[!0-9]*) return 1 ;; esac; }
  gh_mark=$HOME/.clusterctl/gpu-health.mark gh_now=$(date +%s) gh_since="" gh_opened="" gh_last=""
  if [ -r "$gh_mark" ]; then read -r gh_since gh_opened gh_last < "$gh_mark"; fi
  if ! gh_num "$gh_since" || ! gh_num "$gh_opened" || ! gh_num "$gh_last"; then
    gh_since=$((gh_now - @@LOOKBACK@@)) gh_opened=$gh_now
  elif [ $((gh_now - gh_opened)) -gt @@SAME@@ ]; then
    gh_since=$gh_last gh_opened=$gh_now
  fi
  gh_read=no
  echo "@@kernel-log dmesg $gh_since"
  if gh_log=$(dmesg --time-format iso 2>&1); then
    printf '%s\n' "$gh_log" | grep -a 'NVRM: Xid' | tail -n 200
    echo "@@rc 0"
    gh_read=yes
  else
    printf '%s\n' "$gh_log" | head -n 2
    echo "@@rc 1"
    if has journalctl; then
      gh_log=$(journalctl -k -b --no-pager -o short-iso 2>&1)
      echo "@@kernel-log journalctl $gh_since"
      if printf '%s\n' "$gh_log" | grep -q ' kernel: '; then
        printf '%s\n' "$gh_log" | grep -a 'NVRM: Xid' | tail -n 200
        echo "@@rc 0"
        gh_read=yes
      else
        printf '%s\n' "$gh_log" | head -n 2
        echo "@@rc 1"
      fi
    fi
  fi
  if [ "$gh_read" = yes ] && mkdir -p "$HOME/.clusterctl" 2>/dev/null; then
    gh_tmp="$gh_mark.$(hostname 2>/dev/null).$$"
    printf '%s %s %s\n' "$gh_since" "$gh_opened" "$gh_now" > "$gh_tmp" && mv -f "$gh_tmp" "$gh_mark"
  fi
fi
""".replace("@@NVIDIA@@", " ".join(NVIDIA_HEALTH_ARGV)).replace("@@NVLINK@@", " ".join(NVLINK_ARGV))
    .replace("@@DCGM@@", " ".join(DCGM_DIAG_ARGV)).replace("@@AMD@@", " ".join(AMD_HEALTH_ARGV))
    .replace("@@LOOKBACK@@", str(LOOKBACK_S)).replace("@@SAME@@", str(SAME_WINDOW_S))
    .replace("@@DIAG_S@@", str(DIAG_TIMEOUT_S)))


def probe_options(inv, checks: list[str]) -> list[str]:
    """The check names the probe script is told: `gpu_diag` besides gpu_health when the inventory
    asks for dcgmi's diagnostic (`checks.gpu_diag`), which the probe's `want gpu_diag` reads."""
    return list(checks) + (["gpu_diag"] if inv.checks.gpu_diag and "gpu_health" in checks else [])


@dataclass(frozen=True)
class Finding:
    """One thing wrong on a node: on GPU `gpu` (None: the node), fail or warn, and its fix."""

    severity: str  # fail | warn
    gpu: int | None
    what: str
    remedy: str

    def __str__(self) -> str:
        return (f"GPU {self.gpu}: " if self.gpu is not None else "") + self.what


def _reset(i: int) -> str:
    return f"reset GPU {i} with nothing running on it (`sudo nvidia-smi -r -i {i}`) or reboot the node"


_RECOVERY = {"gpu reset": _reset, "node reboot": lambda i: "reboot the node",
             "drain p2p": lambda i: "stop the jobs using peer-to-peer on this node, then reset the GPU",
             "drain and reset": lambda i: f"drain the node, then {_reset(i)}"}


def nvidia_findings(g: NvidiaHealth) -> list[Finding]:
    """The rules for one GPU of `nvidia-smi -q`."""
    i, out = g.index, []
    if g.recovery:
        out.append(Finding("fail", i, f"the driver asks for a recovery action: {g.recovery}",
                           _RECOVERY.get(g.recovery.lower(), lambda i: f"do what the driver asks ({g.recovery})")(i)))
    if g.ecc_volatile_uncorrectable:
        out.append(Finding("fail", i, f"{g.ecc_volatile_uncorrectable} uncorrectable ECC error(s) since the driver "
                           "loaded", f"{_reset(i)}; errors that come back mean the GPU needs replacing"))
    if g.remap_failed:
        out.append(Finding("fail", i, "row remapping failed: the GPU can no longer replace bad memory rows",
                           "take the GPU out of service and have it replaced (RMA)"))
    if g.remap_pending:
        rows = f" ({g.remap_uncorrectable} uncorrectable row(s))" if g.remap_uncorrectable else ""
        out.append(Finding("fail", i, f"row remapping pending{rows}: the bad rows stay in use until a reset",
                           _reset(i)))
    if g.retired_pending:
        out.append(Finding("fail", i, "page retirement pending: the bad pages stay in use until a reset", _reset(i)))
    if g.slowdowns:
        cause = ("power brake: check the node's power supplies and the BMC's power-brake signal"
                 if "HW Power Brake Slowdown" in g.slowdowns else "check the cooling (fans, airflow, inlet "
                 "temperature)" if "HW Thermal Slowdown" in g.slowdowns else "check cooling and power")
        out.append(Finding("fail", i, f"hardware slowdown active ({', '.join(g.slowdowns)}): the GPU runs at "
                           "reduced clocks to protect itself", cause))
    if g.pcie_width and g.pcie_width_max and g.pcie_width < g.pcie_width_max:
        out.append(Finding("warn", i, f"PCIe link x{g.pcie_width} of x{g.pcie_width_max}",
                           "reseat the GPU (and riser), and check the slot's lane setting in the BIOS"))
    if g.pcie_gen and g.pcie_gen_max and g.pcie_gen < g.pcie_gen_max and (g.utilization or 0) > 0:
        out.append(Finding("warn", i, f"PCIe gen {g.pcie_gen} of {g.pcie_gen_max} while busy ({g.utilization} %)",
                           "check the riser and the slot's PCIe speed setting in the BIOS"))
    if g.persistence is False:
        out.append(Finding("warn", i, "persistence mode off",
                           "`sudo nvidia-smi -pm 1` or run nvidia-persistenced: without it the driver state is "
                           "rebuilt at every CUDA start"))
    return out


_NVLINK_REMEDY = ("check the NVLink bridge or NVSwitch and the fabric manager (`systemctl status "
                  "nvidia-fabricmanager`); `nvidia-smi nvlink -e` shows the error counters")


def nvlink_findings(gpus: list[NvLinks]) -> list[Finding]:
    """Warn per GPU with inactive links, or none active where other GPUs of the node have some."""
    linked = [g.index for g in gpus if g.links and not g.all_inactive]
    out = []
    for g in gpus:
        if g.links and 0 < len(g.inactive) < len(g.links):
            links = ", ".join(map(str, g.inactive))
            out.append(Finding("warn", g.index, f"NVLink link(s) {links} inactive ({len(g.links) - len(g.inactive)} of "
                               f"{len(g.links)} up): NCCL traffic takes the slower links", _NVLINK_REMEDY))
        elif g.all_inactive and [i for i in linked if i != g.index]:
            others = ", ".join(map(str, linked))
            out.append(Finding("warn", g.index, f"no active NVLink while GPU(s) {others} have some: its traffic "
                               "goes over PCIe", _NVLINK_REMEDY))
    return out


def xid_findings(xids: list[Xid], since: float, gpu_of: dict[str, int]) -> list[Finding]:
    """One finding per GPU and code among the Xids logged since `since` (a line whose time the log
    does not say counts as new). Application codes warn; the others fail."""
    new: dict[tuple[str, int], list[Xid]] = {}
    for x in xids:
        if x.time is None or x.time >= since:
            new.setdefault((x.pci, x.code), []).append(x)
    out = []
    for (pci, code), seen in new.items():
        gpu = gpu_of.get(pci)
        where = "" if gpu is not None else f"PCI {pci}: "
        when = time.strftime(" at %Y-%m-%d %H:%M:%S UTC", time.gmtime(seen[-1].time)) if seen[-1].time else ""
        times = f" ({len(seen)} times)" if len(seen) > 1 else ""
        meaning = XID_MEANING.get(code, "see NVIDIA's Xid catalog")
        what = f"{where}Xid {code} ({meaning}){times}{when}: {seen[0].message[:140]}"
        if code in APPLICATION_XIDS:
            out.append(Finding("warn", gpu, what, "an application's fault on the GPU (a bad address, a killed "
                               "job); look at the job that ran there if it repeats"))
        else:
            fix = _reset(gpu) if gpu is not None else "reset the GPU at that address or reboot the node"
            out.append(Finding("fail", gpu, what, f"{fix}; if the Xid comes back, have the GPU serviced"))
    return out


def amd_findings(e: AmdEcc) -> list[Finding]:
    """Uncorrectable or deferred (poisoned) ECC errors on an AMD GPU fail, naming the blocks."""
    out = []
    for kind, counts in (("uncorrectable", e.uncorrectable), ("deferred (poisoned)", e.deferred)):
        blocks = {b: n for b, n in counts.items() if b != "TOTAL" and n > 0}
        total = counts.get("TOTAL") or sum(blocks.values())
        if total:
            where = f" ({', '.join(f'{b} {n}' for b, n in blocks.items())})" if blocks else ""
            gpu = "" if e.index is None else f" -g {e.index}"
            out.append(Finding("fail", e.index, f"{total} {kind} ECC error(s){where}",
                               f"reset the GPU (`sudo amd-smi reset -G{gpu}`) or reboot the node; errors that "
                               "come back mean the GPU needs replacing"))
    return out


def dcgm_findings(tests: list[DcgmTest], error: str | None) -> list[Finding]:
    out = []
    for t in tests:
        if t.status not in ("fail", "warn"):
            continue
        on = "" if t.gpus is None else f" on GPU {', '.join(map(str, t.gpus))}"
        note = f": {t.warnings[0][:160]}" if t.warnings else ""
        verdict = "failed" if t.status == "fail" else "warns"
        out.append(Finding(t.status, None, f"dcgmi diag: {t.name} {verdict}{on}{note}",
                           "run `dcgmi diag -r 2 -v` on the node for the details"))
    if error:
        out.append(Finding("warn", None, f"dcgmi diag did not run: {error[:160]}",
                           "check the DCGM install (`nv-hostengine` running, plugins present)"))
    return out


# ---------------------------------------------------------------- the verdict

def _nvidia(secs: dict, notes: list[str], diag: bool) -> tuple[list[Finding], dict[str, int]]:
    """nvidia-smi's findings, and each GPU's index by its PCI address (for the Xid lines)."""
    s = secs["nvidia-health"]
    if s.rc not in (0, None):
        first = next((ln.strip() for ln in s.body.splitlines() if ln.strip()), f"exit code {s.rc}")
        return [Finding("fail", None, f"`nvidia-smi -q` failed: {first[:200]}",
                        "a GPU the driver cannot reach: reboot the node; if it stays, the GPU or its slot "
                        "needs service")], {}
    attached, gpus = parse_nvidia_query(s.body)
    found = [f for g in gpus for f in nvidia_findings(g)]
    if attached is not None and len(gpus) < attached:
        found.append(Finding("warn", None, f"`nvidia-smi -q` described {len(gpus)} of the {attached} GPUs it "
                             "says are attached (its answer was cut short)", "run `nvidia-smi -q` on the node"))
    if "nvlink" in secs and secs["nvlink"].rc in (0, None):
        found += nvlink_findings(parse_nvlink_status(secs["nvlink"].body))
    if "dcgm-diag" in secs and secs["dcgm-diag"].rc == 124:
        found.append(Finding("warn", None, f"dcgmi diag -r 1 did not finish in {DIAG_TIMEOUT_S} s",
                             "run `dcgmi diag -r 1` on the node by hand"))
    elif "dcgm-diag" in secs:
        found += dcgm_findings(*parse_dcgm_diag(secs["dcgm-diag"].body))
    elif diag:
        notes.append("dcgmi diag not run: no dcgmi on the node")
    return found, {pci_key(g.bus_id): g.index for g in gpus if g.bus_id}


def _kernel_log(logs: list, gpu_of: dict[str, int], notes: list[str]) -> list[Finding]:
    """The Xids of the first kernel log the node could read; otherwise why it could not."""
    readable = next((s for s in logs if s.rc == 0), None)
    if readable is None:
        if logs:
            why = "; ".join(f"{s.arg.split()[0]}: {(s.body.strip().splitlines() or ['unreadable'])[0][:120]}"
                            for s in logs)
            notes.append(f"Xids not checked: the kernel log is not readable by this account ({why}); "
                         "allow it with `sysctl kernel.dmesg_restrict=0` or the adm/systemd-journal group")
        return []
    since = float(readable.arg.split()[1]) if len(readable.arg.split()) > 1 else 0.0
    return xid_findings(parse_xids(readable.body), since, gpu_of)


def parse_gpu_health(text: str, ctx: Ctx) -> CheckResult:
    if ctx.node.gpus == 0:
        return skip("gpu_health", "CPU node (gpus: 0)")
    all_secs = sections(text)
    secs = {s.name: s for s in all_secs}
    if "nvidia-health" not in secs and "amd-health" not in secs:
        return skip("gpu_health", "rocm-smi but no amd-smi on the node: the ECC counters need amd-smi"
                    if "amd-no-amd-smi" in secs else "no GPU tool on the node")
    notes: list[str] = []
    diag = ctx.inventory.checks.gpu_diag
    found, gpu_of = _nvidia(secs, notes, diag) if "nvidia-health" in secs else ([], {})
    if "amd-health" in secs:
        found += [f for e in parse_amd_ecc(secs["amd-health"].body) for f in amd_findings(e)]
    found += _kernel_log([s for s in all_secs if s.name == "kernel-log"], gpu_of, notes)
    return verdict(found, notes, ctx.node.name)


def verdict(found: list[Finding], notes: list[str], node: str) -> CheckResult:
    """Failures first, then warnings, each once; the remedies of the worst ones, in order."""
    worst = [f for f in found if f.severity == "fail"] or [f for f in found if f.severity == "warn"]
    if not worst:
        return ok("gpu_health", "; ".join(["GPUs healthy"] + notes))
    shown = [str(f) for f in worst[:6]] + ([f"and {len(worst) - 6} more"] if len(worst) > 6 else [])
    others = len(found) - len(worst)
    detail = "; ".join(shown + ([f"{others} warning(s) besides"] if others else []) + notes)
    remedy = f"on {node}: " + "; ".join(dict.fromkeys(f.remedy for f in worst))
    return (fail if worst[0].severity == "fail" else warn)("gpu_health", detail, remedy)


GPU_HEALTH = Check(
    "gpu_health", "the GPUs report no memory errors, slowdowns, bad links or new Xids",
    "reset or service the GPU the finding names (or the node), then check again",
    probes=(HEALTH,), parse=parse_gpu_health, fast=True)  # before every launch and restart: sick nodes are quarantined
