#!/usr/bin/env bash
# The fast static checks, from the repository root with the venv's tools; stops at the first failure and
# prints each step's time. The README's test command runs it first.
#   ruff check, ruff format --check     lint rules and formatting ([tool.ruff] in pyproject.toml)
#   mypy src/vmplane                     types: strict on vmplane.core and vmplane.store ([tool.mypy])
#   lint-imports                         the layers contract ([tool.importlinter])
#   scripts/import_cycles.py             no import circle, TYPE_CHECKING and function-level imports included
set -euo pipefail
cd "$(dirname "$0")/.."
bin=.venv/bin
paths=(src tests bench scripts)

step() {
  local name=$1 start=$SECONDS
  shift
  echo "lint: $name"
  if ! "$@"; then
    echo "lint: $name FAILED ($((SECONDS - start)) s)" >&2
    exit 1
  fi
  echo "lint: $name ok ($((SECONDS - start)) s)"
}

step "ruff check" "$bin/ruff" check --output-format concise "${paths[@]}"
step "ruff format --check" "$bin/ruff" format --check --output-format concise "${paths[@]}"
step "mypy" "$bin/mypy" src/vmplane
step "lint-imports" "$bin/lint-imports"
step "import circles" "$bin/python" scripts/import_cycles.py
echo "lint: all passed"
