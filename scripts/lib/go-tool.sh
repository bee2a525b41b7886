# What the scripts that build a Go tool into the user's cache share (compose.sh, helm.sh):
# the cache, CACHE_ROOT, and the build of a tool into it, once.

CACHE_ROOT="${XDG_CACHE_HOME:-$HOME/.cache}/spanguard"
SCRIPT=$(basename "$0")  # names the caller in its messages

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

# build_tool BINARY TOOL GO_NEEDED STARTING BUILD: BINARY, built once. Unless it is built
# already (see tool_ready; the lock is TOOL-build.lock), says STARTING and runs `BUILD SCRATCH`,
# which leaves the binary, named as BINARY is, in the scratch directory SCRATCH; the binary is
# then moved in whole, so a reader never sees a half-written one, and the scratch directory is
# removed. Without go, says to install GO_NEEDED.
build_tool() {
  local binary=$1 tool=$2 go_needed=$3 starting=$4 build=$5
  tool_ready "$binary" "$tool-build.lock" \
    "go not found: $tool is built from the Go module proxy; install $go_needed (https://go.dev/dl/ or your distribution's golang package) and retry" &&
    return 0
  local started=$SECONDS work name dir
  name=$(basename "$binary")
  dir=$(dirname "$binary")
  say "$starting; the first build takes a few minutes"
  work=$(mktemp -d "$CACHE_ROOT/$tool-build.XXXXXX")
  # chmod first: copies out of the module cache are read-only.
  # shellcheck disable=SC2064
  trap "chmod -R u+w '$work' 2>/dev/null; rm -rf '$work'" EXIT
  "$build" "$work"
  [[ -x $work/$name ]] || die "the build finished but $work/$name is missing"
  mkdir -p "$dir"
  mv "$work/$name" "$dir/.$name.tmp"
  mv "$dir/.$name.tmp" "$binary"
  chmod -R u+w "$work" 2>/dev/null
  rm -rf "$work"
  trap - EXIT
  say "built $binary in $((SECONDS - started))s"
}
