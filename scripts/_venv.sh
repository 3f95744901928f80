# Sourced by scripts/demo and scripts/test: make .venv with everything clusterctl needs.
# The venv is built on the system Python (/usr/bin/python3) when there is one, because the
# test cluster's nodes run it as a non-root user, who cannot read a Python under /root.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
ROOT=$PWD

as_root() { if [ "$(id -u)" = 0 ]; then "$@"; elif command -v sudo >/dev/null; then sudo "$@"; else return 1; fi; }

pick_python() {
  for p in /usr/bin/python3 "$(command -v python3 || true)"; do
    [ -x "$p" ] || continue
    "$p" -c 'import sys; sys.exit(sys.version_info < (3, 10))' 2>/dev/null && { echo "$p"; return; }
  done
  echo "clusterctl needs Python >= 3.10 (python3 not found)" >&2; exit 2
}

ensure_apt() {  # ensure_apt CMD PACKAGE ...: install the Debian packages whose command is missing
  local missing=()
  while [ $# -gt 1 ]; do command -v "$1" >/dev/null 2>&1 || missing+=("$2"); shift 2; done
  [ ${#missing[@]} -eq 0 ] && return 0
  if command -v apt-get >/dev/null && as_root true 2>/dev/null; then
    echo "installing ${missing[*]} (apt-get)" >&2
    as_root apt-get update -qq >/dev/null
    DEBIAN_FRONTEND=noninteractive as_root apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
  else
    echo "please install: ${missing[*]}" >&2; return 1
  fi
}

# The venv lives in .venv, unless this checkout sits where other users cannot read it (a clone
# under /root, say): the test cluster's nodes run the venv as a non-root user, so then the venv
# goes to a world-readable place and clusterctl is installed into it as a copy, not editable.
VENV=.venv
EDITABLE=-e
if [ "$(id -u)" = 0 ] && id nobody >/dev/null 2>&1 \
   && ! runuser -u nobody -- test -r "$ROOT/pyproject.toml" 2>/dev/null; then
  VENV=/opt/clusterctl-venv/$(printf %s "$ROOT" | md5sum | cut -c1-12)
  EDITABLE=
  echo "note: $ROOT is not readable by other users; using the venv $VENV" >&2
fi

make_venv() {  # make_venv EXTRAS
  local py; py=$(pick_python)
  if [ ! -x "$VENV/bin/python" ]; then
    mkdir -p "$(dirname "$VENV")"
    if ! "$py" -m venv "$VENV" 2>/dev/null; then
      rm -rf "$VENV"
      ensure_apt __no_such_cmd__ python3-venv
      "$py" -m venv "$VENV"
    fi
  fi
  # pip's and the build backend's chatter goes to a log, shown only when a step fails
  local log="$VENV/pip.log"
  : > "$log"
  pip_q() {
    if ! "$VENV/bin/python" -m pip install -q "$@" >>"$log" 2>&1; then
      tail -n 40 "$log" >&2
      echo "pip install $* failed (full log: $log)" >&2
      return 1
    fi
  }
  # What was installed, and from what: pyproject.toml, the extras and the interpreter. An editable
  # venv that has it already is not installed again (pip spends ~10 s rebuilding the same editable
  # wheel and checking every requirement); a copy (not editable) is, to take the tree's changes.
  local stamp="$VENV/.clusterctl-installed" want
  want=$({ sha256sum pyproject.toml; echo "${1:-}"; "$VENV/bin/python" -VV; } | sha256sum | cut -c1-64)
  if [ -n "$EDITABLE" ] && [ "$(cat "$stamp" 2>/dev/null)" = "$want" ]; then
    return 0
  fi
  rm -f "$stamp"
  echo "installing clusterctl into $VENV (log: $log)" >&2
  pip_q --upgrade pip
  # torch pinned: 2.13.0 is the CPU wheel these machines carry; an unpinned torch pulls a multi-GB CUDA build
  pip_q "torch==2.13.0"
  pip_q $EDITABLE ".${1:-}"
  echo "$want" > "$stamp"
}
