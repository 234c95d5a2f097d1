# Sourced on the GPU machine: installs MLX CUDA + project deps into /tmp/site.
set -e
[ -f /root/stage/$(cat .gpu/b/NAME) ] || cat /root/stage/part_aa .gpu/b/part_ab > /root/stage/$(cat .gpu/b/NAME)
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site /root/stage/*.whl .gpu/b/*.whl .gpu/deps/*.whl 2>&1 | grep -v WARNING || true
export PYTHONPATH=/tmp/site:$PWD:$PYTHONPATH
python3 -c 'import mlx.core as mx; print(mx.default_device())'
set +e
