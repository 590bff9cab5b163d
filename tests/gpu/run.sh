#!/usr/bin/env bash
# The GPU tier (tests marked `gpu`), on a GPU host with the project's Python environment:
#   bash tests/gpu/run.sh [pytest args]
# (an offline GPU host first sources bench/device_env.sh). Elsewhere these tests skip with a
# reason; `make test` runs the other tiers.
set -euo pipefail
cd "$(dirname "$0")/../.."
exec python3 -m pytest -q -p no:cacheprovider -m gpu tests/gpu tests/unit tests/export "$@"
