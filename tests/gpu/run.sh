#!/usr/bin/env bash
# The GPU tier (tests marked `gpu`), on a GPU host with the project's Python environment:
#   bash tests/gpu/run.sh [pytest args]          # every tier's GPU tests
#   bash tests/gpu/run.sh tests/gpu/test_x.py -s # those paths only
# (an offline GPU host first sources bench/device_env.sh). Elsewhere these tests skip with a
# reason; `make test` runs the other tiers.
set -euo pipefail
cd "$(dirname "$0")/../.."
paths=(tests/gpu tests/unit tests/export)
for arg in "$@"; do
  if [[ -e "${arg%%::*}" ]]; then  # a path (or path::test) given: run what it names instead
    paths=()
    break
  fi
done
exec python3 -m pytest -q -p no:cacheprovider -m gpu "${paths[@]}" "$@"
