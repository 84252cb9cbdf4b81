#!/usr/bin/env bash
# Set up vmplane on a fresh machine: a virtual environment at .venv (repo root) with pinned packages.
#   scripts/setup.sh          what `vmplane up` needs
#   scripts/setup.sh --test   plus what the tests need
# Idempotent: a second run only checks.
set -euo pipefail
cd "$(dirname "$0")/.."
want_test=0
[ "${1:-}" = "--test" ] && want_test=1

py=""
for candidate in python3.11 python3; do
  if command -v "$candidate" >/dev/null 2>&1 && "$candidate" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 11))'; then
    py=$candidate; break
  fi
done
if [ -z "$py" ]; then
  echo "vmplane needs Python 3.11 (python3.11 or python3)" >&2
  exit 1
fi

# The tests run the same admission races on SQLite and on a throwaway PostgreSQL server they start.
if [ "$want_test" = 1 ] && ! ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    echo "vmplane: installing the PostgreSQL server for the tests (apt-get)"
    apt-get update -q >/dev/null
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends postgresql >/dev/null
  else
    echo "vmplane: no PostgreSQL server and not root: the PostgreSQL variants of the tests will be skipped" >&2
  fi
fi

[ -x .venv/bin/python ] || "$py" -m venv .venv
extra=""
[ "$want_test" = 1 ] && extra="[test]"
stamp=".venv/.vmplane-installed$extra"
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
  .venv/bin/python -m pip install -q --upgrade "pip==25.3" 2>&1 | grep -v -i "warning" || true
  .venv/bin/python -m pip install -q -e ".$extra" 2>&1 | grep -v -i "warning" || true
  .venv/bin/python -c "import vmplane, fastapi, sqlalchemy, typer" # fail loudly if the install did not work
  touch "$stamp"
fi
echo "vmplane: .venv ready ($(.venv/bin/python --version))"
