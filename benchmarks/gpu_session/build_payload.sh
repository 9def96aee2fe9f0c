#!/bin/bash
# Builds what the device machine lacks (it has Python 3.12, PyTorch and CUDA 13, no TensorFlow, no
# network): TensorFlow 2.21 and tensorflow-text for cp312, pruned and xz-compressed, plus the real
# Flickr8K captions that benchmarks.scale_data deals out, split into 56 MiB parts .gp00 ... (each
# part travels in one `run` call's carry; the calls append them under /tmp/p on the warm machine).
# Run from the repository root, beside ../shared; needs python3.12 with pip.
set -euo pipefail
W=${W:-/tmp/gpu_payload}; PY312=${PY312:-python3.12}
mkdir -p "$W/whl" && rm -rf "$W/site"
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d "$W/whl" \
  tensorflow==2.21.0 tensorflow-text==2.21.1 keras==3.15.1 nvidia-cuda-runtime-cu12==12.5.82 gast astunparse \
  google_pasta termcolor namex optree protobuf==7.36.2 ml_dtypes==0.6.0 h5py==3.14.0 'flatbuffers>=25.9.23' \
  opt_einsum wrapt rich absl-py
"$PY312" -m pip install -q --no-index --no-deps --no-compile --target "$W/site" "$W"/whl/*.whl
# the image's numpy (2.5) serves; headers are build-time only
rm -rf "$W/site/tensorflow/include" "$W"/site/numpy* "$W/site/bin"
python3 benchmarks/gpu_session/zero_cubins.py "$W/site/tensorflow/libtensorflow_cc.so.2" \
  "$W/site/tensorflow/libtensorflow_framework.so.2" "$W/site/tensorflow/python/profiler/internal/_pywrap_profiler_plugin.so"
mkdir -p "$W/flickr8k" && cp ../shared/realdata/flickr8k/Flickr8k.token.txt ../shared/realdata/flickr8k/Flickr8k.token.conllu "$W/flickr8k/"
tar -C "$W" -cf - site flickr8k | xz -9 -T2 > "$W/payload.tar.xz"      # ~10 min on 2 cores
sha256sum "$W/payload.tar.xz"
rm -rf .gp[0-9][0-9] && split -b 56M -d -a 2 "$W/payload.tar.xz" "$W/part."
for part in "$W"/part.*; do n=${part##*.}; mkdir -p ".gp$n" && mv "$part" ".gp$n/"; done
grep -qx '/.gp\[0-9\]\[0-9\]/' .git/info/exclude || echo '/.gp[0-9][0-9]/' >> .git/info/exclude
ls -la .gp*
