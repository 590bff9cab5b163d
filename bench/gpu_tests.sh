#!/usr/bin/env bash
# The GPU tier (tests marked `gpu`), on the GPU machine:
#   source .device/setup.sh && bash bench/gpu_tests.sh [pytest args]
# Elsewhere these tests skip with a reason; `make test` runs the other tiers.
set -euo pipefail
cd "$(dirname "$0")/.."
exec python3 -m pytest -q -p no:cacheprovider -m gpu tests/gpu tests/unit tests/export "$@"
