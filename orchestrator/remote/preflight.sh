# Preflight probe: every per-node check's facts in ONE invocation, run as
#   sh -s -- CHECKS WORKDIR OUTDIR PORT IFACE MASTER ROLE PYTHON CONNECT_TIMEOUT [--output DIR]...
#            [--include GLOB]... [--exclude GLOB]...
# CHECKS is a comma list of check names; ROLE is master|worker. This is the header; after it
# come the snippets of the chosen checks (orchestrator/checks/registry.py probe_script), each
# printing sections that start with a line "@@name" (and "@@rc N" after a tool's output), then
# "@@end". Nothing here decides a verdict: that is the parsers' job.
checks=",$1," wd=$2 out=$3 port=$4 iface=$5 master=$6 role=$7 py=$8 ct=$9
shift 9  # what is left: --output DIR for each of the run's output directories (not code), and the
# inventory's sync --include/--exclude: nodeinfo's arguments for code_sync
PATH=$PATH:/usr/sbin:/sbin
export PATH LC_ALL=C
want() { for c in "$@"; do case $checks in *",$c,"*) return 0 ;; esac; done; return 1; }
has() { command -v "$1" >/dev/null 2>&1; }
