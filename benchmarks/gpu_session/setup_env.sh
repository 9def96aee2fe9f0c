# Sourced by run.sh: unpacks the carried TensorFlow 2.21 (cp312) and points it at this image's CUDA 13 libraries.
REPO=$PWD
PY=${PY:-python3}
PYSITE=$($PY -c "import sysconfig;print(sysconfig.get_paths()['purelib'])")
# the roomiest of /tmp, the repo's disk, /root
WORK=/tmp/gw; best=0
for d in /tmp "$REPO/.." /root /var/tmp; do
  free=$(df -Pk "$d" 2>/dev/null | awk 'NR==2{print $4}'); [ -n "$free" ] && [ "$free" -gt "$best" ] && best=$free && WORK=$(cd "$d" && pwd)/gw
done
mkdir -p "$WORK"; echo "work dir $WORK ($((best/1024/1024)) GiB free)"
if [ -f "$WORK/tf/unpacked" ]; then echo "already unpacked by an earlier call on this machine"; else
  cat /tmp/p/part.* > "$WORK/payload.tar.xz"
  (cd "$WORK" && sha256sum payload.tar.xz)
  mkdir -p "$WORK/tf" && xz -dc -T0 "$WORK/payload.tar.xz" | tar -C "$WORK/tf" -xf - && rm -f "$WORK/payload.tar.xz" && touch "$WORK/tf/unpacked"
fi
echo "unpacked: $(du -sh $WORK/tf | cut -f1)"
mkdir -p "$REPO/../shared/realdata" && ln -sfn "$WORK/tf/flickr8k" "$REPO/../shared/realdata/flickr8k"
mkdir -p "$WORK/cu12"
libdirs=$(find "$PYSITE/nvidia" /usr/local/cuda/lib64 /usr/local/cuda/targets/x86_64-linux/lib -maxdepth 4 -name 'lib*.so*' 2>/dev/null | xargs -r -n1 dirname | sort -u | tr '\n' ':')
first() { find "$PYSITE/nvidia" /usr/local/cuda/lib64 /usr/local/cuda/targets/x86_64-linux/lib -maxdepth 4 -name "$1" 2>/dev/null | sort | head -1; }
for pair in libcublas.so.12:libcublas.so.1[0-9] libcublasLt.so.12:libcublasLt.so.1[0-9] libcufft.so.11:libcufft.so.1[0-9] \
            libcusolver.so.11:libcusolver.so.1[0-9] libcusparse.so.12:libcusparse.so.1[0-9] libcurand.so.10:libcurand.so.1[0-9] \
            libnvJitLink.so.12:libnvJitLink.so.1[0-9] libcupti.so.12:libcupti.so.1[0-9] libnvrtc.so.12:libnvrtc.so.1[0-9] \
            libcudnn.so.9:libcudnn.so.9; do
  want=${pair%%:*}; pat=${pair#*:}; src=$(first "$pat")
  [ -n "$src" ] && ln -sfn "$src" "$WORK/cu12/$want" && echo "  $want -> $src" || echo "  $want: none found ($pat)"
done
export LD_LIBRARY_PATH="$WORK/cu12:/usr/local/nvidia/lib64:$WORK/tf/site/nvidia/cuda_runtime/lib:${libdirs}${LD_LIBRARY_PATH:-}"
export PYTHONPATH="$WORK/tf/site:$REPO${EXTRA_PYTHONPATH:+:$EXTRA_PYTHONPATH}"
export TF_FORCE_GPU_ALLOW_GROWTH=true
ld=$(find /usr/local/cuda* "$PYSITE/nvidia" -name libdevice.10.bc 2>/dev/null | head -1)
[ -n "$ld" ] && export XLA_FLAGS="--xla_gpu_cuda_data_dir=$(dirname $(dirname $(dirname $ld)))" && echo "libdevice $ld"
px=$(command -v ptxas || find /usr/local/cuda* "$PYSITE/nvidia" -name ptxas -type f 2>/dev/null | head -1)
[ -n "$px" ] && export PATH="$(dirname $px):$PATH" && echo "ptxas $px ($($px --version | tail -1))"
export BENCH_WORK="$WORK/bench"
