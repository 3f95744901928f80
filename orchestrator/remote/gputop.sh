# GPU probe for `clusterctl top`: run on a node as `sh -s`. One invocation answers everything:
# sections start with a line "@@<name>", parsed by orchestrator.top.parse_probe.
# NVIDIA first, then ROCm; neither -> "@@none". Then, for each pid on a GPU, its command line
# and CLUSTERCTL_RUN_ID when /proc lets us read them (our own processes, or root).
pids=""
if command -v nvidia-smi >/dev/null 2>&1; then
  echo "@@nvidia-gpus"
  nvidia-smi --query-gpu=index,uuid,name,utilization.gpu,memory.used,memory.total,temperature.gpu,power.draw \
    --format=csv,noheader,nounits 2>&1
  echo "@@rc $?"
  echo "@@nvidia-apps"
  apps=$(nvidia-smi --query-compute-apps=gpu_uuid,pid,process_name,used_memory --format=csv,noheader,nounits 2>/dev/null)
  printf '%s\n' "$apps"
  pids=$(printf '%s\n' "$apps" | cut -d, -f2)
elif command -v rocm-smi >/dev/null 2>&1; then
  echo "@@rocm-gpus"
  rocm-smi --showid --showproductname --showuse --showmeminfo vram --showtemp --showpower --json 2>/dev/null
  echo "@@rc $?"
  echo "@@rocm-pids"
  apps=$(rocm-smi --showpids --json 2>/dev/null)
  printf '%s\n' "$apps"
  pids=$(printf '%s\n' "$apps" | grep -o 'PID[0-9]*' | cut -c4-)
else
  echo "@@none"
fi
for pid in $pids; do
  case $pid in *[!0-9]*|'') continue ;; esac
  echo "@@proc $pid"
  if [ -r "/proc/$pid/cmdline" ]; then tr '\000' ' ' < "/proc/$pid/cmdline" 2>/dev/null; fi
  echo
  if [ -r "/proc/$pid/environ" ]; then
    tr '\000' '\n' < "/proc/$pid/environ" 2>/dev/null | grep '^CLUSTERCTL_RUN_ID=' | head -n1
  fi
done
echo "@@end"
