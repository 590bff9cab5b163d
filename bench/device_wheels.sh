# bash bench/device_wheels.sh [.device]   (here, after ../shared/device/bundle.sh, before carrying .device)
# Wheels of the project's dependencies that the GPU image lacks and the bundle does not fetch, for
# the device's Python 3.12, into the bundle's wheels folder (.device/setup.sh installs them all).
set -euo pipefail
OUT=${1:-.device}
mkdir -p "$OUT/wheels"
for p in $(grep -E '^(isal)==' requirements.txt); do
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
        -d "$OUT/wheels" "$p"
done
ls "$OUT/wheels"
