# source bench/device_env.sh   (on the GPU machine, after `source .device/setup.sh`)
# The GPU image's Python has numpy 2, which Triton 2.51's Python backend stub cannot use
# (its pybind11 reads numpy 1's dtype layout: every tensor it builds comes out wrong). Give the
# server, and only the server, numpy 1.26 (carried in .device/np1) and hide the image's scipy
# and scikit-learn, built for numpy 2 (diffusers imports scipy only for beta sigmas, transformers
# sklearn only for assisted generation; we use neither).
python3 -m pip install -q --upgrade --no-index --no-deps --no-compile --target /tmp/np1 .device/np1/numpy-1.26.4-*.whl
echo "import sys; [sys.modules.setdefault(m, None) for m in ('scipy', 'sklearn')]" > /tmp/np1/easel_hide_numpy2.pth
rm -f /tmp/np1/easel_no_scipy.pth
export EASEL_SERVER_PYTHONPATH=/tmp/np1
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
