# Preflight probe: every per-node check's facts in ONE invocation, run as
#   sh -s -- CHECKS WORKDIR OUTDIR PORT IFACE MASTER ROLE PYTHON CONNECT_TIMEOUT
# CHECKS is a comma list of check names; ROLE is master|worker. Output is sections, each
# starting with a line "@@name" (and "@@rc N" after a tool's output), parsed by
# orchestrator/checks/*.py. Nothing here decides a verdict: that is the parsers' job.
checks=",$1," wd=$2 out=$3 port=$4 iface=$5 master=$6 role=$7 py=$8 ct=$9
PATH=$PATH:/usr/sbin:/sbin
export PATH LC_ALL=C
want() { for c in "$@"; do case $checks in *",$c,"*) return 0 ;; esac; done; return 1; }
has() { command -v "$1" >/dev/null 2>&1; }

if want clock_skew; then
  echo "@@time"; date +%s.%N
  if has timedatectl; then echo "@@timedatectl"; timedatectl show 2>&1; echo "@@rc $?"; fi
fi

if want gpu_count gpu_idle; then
  pids=""
  if has nvidia-smi; then
    echo "@@nvidia-gpus"
    gpus=$(nvidia-smi --query-gpu=index,uuid,name,utilization.gpu,memory.used,memory.total,temperature.gpu,power.draw \
      --format=csv,noheader,nounits 2>&1)
    rc=$?
    printf '%s\n' "$gpus"
    echo "@@rc $rc"
    # The process list costs a second nvidia-smi (tens of ms to seconds on a real node): ask for
    # it only when some GPU has memory in use (> 16 MiB, or a reading that is not a number). A
    # CUDA context alone takes hundreds of MiB, so no process can hide under that.
    if want gpu_idle && [ "$rc" = 0 ] && printf '%s\n' "$gpus" | awk -F', *' \
        '$5 !~ /^[0-9]+$/ || $5 + 0 > 16 { busy = 1 } END { exit !busy }'; then
      echo "@@nvidia-apps"
      apps=$(nvidia-smi --query-compute-apps=gpu_uuid,pid,process_name,used_memory --format=csv,noheader,nounits 2>/dev/null)
      printf '%s\n' "$apps"
      pids=$(printf '%s\n' "$apps" | cut -d, -f2)
    fi
  elif has rocm-smi; then
    echo "@@rocm-gpus"
    rocm-smi --showuse --showmeminfo vram --json 2>&1
    echo "@@rc $?"
    if want gpu_idle; then
      echo "@@rocm-pids"
      apps=$(rocm-smi --showpids --json 2>/dev/null)
      printf '%s\n' "$apps"
      pids=$(printf '%s\n' "$apps" | grep -o 'PID[0-9]*' | cut -c4-)
    fi
  else
    echo "@@no-gpu-tool"
  fi
  for pid in $pids; do
    case $pid in *[!0-9]*|'') continue ;; esac
    echo "@@proc $pid"
    if [ -r "/proc/$pid/cmdline" ]; then tr '\000' ' ' < "/proc/$pid/cmdline" 2>/dev/null; echo; fi
  done
fi

if want port_free && [ "$role" = master ]; then
  if has ss; then
    echo "@@ss"; ss -Hltnp 2>&1; echo "@@rc $?"
  else
    echo "@@proc-net-tcp"; cat /proc/net/tcp /proc/net/tcp6 2>/dev/null
    hex=$(printf '%04X' "$port")
    for ino in $(awk -v p=":$hex" '$4 == "0A" && substr($2, length($2) - 4) == p { print $10 }' \
                 /proc/net/tcp /proc/net/tcp6 2>/dev/null); do
      for fd in $(find /proc/[0-9]*/fd -lname "socket:\[$ino\]" 2>/dev/null); do
        pid=${fd#/proc/}; pid=${pid%%/*}
        echo "@@sockowner $pid $ino"
        tr '\000' ' ' < "/proc/$pid/cmdline" 2>/dev/null; echo
      done
    done
  fi
fi

if want firewall; then
  sudo=""
  if [ "$(id -u)" != 0 ] && has sudo && sudo -n true >/dev/null 2>&1; then sudo="sudo -n"; fi
  if has ufw; then
    if [ "$(id -u)" = 0 ] || [ -n "$sudo" ]; then
      echo "@@ufw"; $sudo ufw status verbose 2>&1; echo "@@rc $?"
    else  # ufw (a Python program, ~0.1 s) would only say it needs root; its config says if it is on
      echo "@@ufw-conf"; grep '^ENABLED=' /etc/ufw/ufw.conf 2>&1; echo "@@rc $?"
    fi
  fi
  if has firewall-cmd; then
    echo "@@firewalld-state"; firewall-cmd --state 2>&1; echo "@@rc $?"
    echo "@@firewalld"; $sudo firewall-cmd --list-all 2>&1; echo "@@rc $?"
  fi
  if has nft; then echo "@@nft"; $sudo nft list ruleset 2>&1; echo "@@rc $?"; fi
  if has iptables-save; then echo "@@iptables"; $sudo iptables-save 2>&1; echo "@@rc $?"; fi
fi

if want iface && [ -n "$iface" ]; then
  echo "@@ip-addr"; ip -j addr show dev "$iface" 2>&1; echo "@@rc $?"
  if [ "$role" != master ]; then
    dest=$master
    case $dest in *[!0-9.:]*) dest=$(getent ahosts "$dest" 2>/dev/null | awk 'NR == 1 { print $1 }') ;; esac
    echo "@@ip-route $dest"; ip -j route get "$dest" 2>&1; echo "@@rc $?"
  fi
fi

if want disk; then
  near() { d=$1; while [ -n "$d" ] && [ ! -e "$d" ]; do case $d in */*) d=${d%/*} ;; *) d=. ;; esac; done; printf '%s' "${d:-/}"; }
  echo "@@df"
  printf 'workdir %s\noutput %s\n' "$wd" "$out"
  df -Pk "$(near "$wd")" "$(near "$out")" 2>&1
  echo "@@rc $?"
fi

if want python_env code_sync; then
  pwd_arg=-
  if want code_sync; then pwd_arg=$wd; fi
  echo "@@python"
  # -S: no site (its .pth imports cost ~14 ms a node); nodeinfo finds site-packages itself
  "$py" -S - info "$pwd_arg" 2>&1 <<'PYEOF'
@@NODEINFO_PY@@
PYEOF
  echo "@@rc $?"
fi

if want port_reachable && [ "$role" = worker ] && [ "$ct" != 0 ]; then
  echo "@@connect $master $port"
  if has bash && has timeout; then
    timeout "$ct" bash -c 'exec 3<>"/dev/tcp/$0/$1"' "$master" "$port" 2>&1; echo "@@rc $?"
  elif has nc; then
    nc -z -w "$ct" "$master" "$port" 2>&1; echo "@@rc $?"
  else
    echo "@@rc 127"; echo "neither bash+timeout nor nc on the node"
  fi
fi
echo "@@end"
