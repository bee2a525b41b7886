# What the scripts that build a Go tool into the user's cache share (compose.sh, helm.sh).
# Sourced after CACHE_ROOT is set; SCRIPT names the caller in its messages.

die() { echo "$SCRIPT: $*" >&2; exit 1; }
say() { echo "$SCRIPT: $*" >&2; }
usage() { sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; }

# tool_ready BINARY LOCK GO_MISSING: true when BINARY is built. Otherwise checks for go (dying
# with GO_MISSING) and takes LOCK, so one build runs at a time (parallel test runs, make -j):
# the others wait, then reuse what the first built.
tool_ready() {
  local binary=$1 lock=$2 go_missing=$3
  [[ -x $binary ]] && return 0
  command -v go >/dev/null 2>&1 || die "$go_missing"
  mkdir -p "$CACHE_ROOT"
  if command -v flock >/dev/null 2>&1; then
    exec 9>"$CACHE_ROOT/$lock"
    flock 9
    [[ -x $binary ]] && return 0
  fi
  return 1
}
