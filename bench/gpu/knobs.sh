# On the GPU machine (carry .gpu/b .gpu/deps .gpu/tok): MLX CUDA settings against in-process decode.
#   bash bench/gpu/knobs.sh     -> $OUT/knobs-*.txt
set +e
[ -d /tmp/site/mlx ] || source bench/gpu/install.sh
export PYTHONPATH=/tmp/site:$PWD:$PYTHONPATH
for shape in ${SHAPES:-qwen3-0.6b llama3-8b}; do
  for knob in "" MLX_USE_CUDA_GRAPHS=0 MLX_MAX_OPS_PER_BUFFER=20 MLX_MAX_OPS_PER_BUFFER=50 MLX_MAX_OPS_PER_BUFFER=400; do
    echo "== $shape ${knob:-default}"
    env $knob timeout 60 python3 bench/gpu/profile_step.py --shape $shape --modes ${MODES:-stream,ours-1t,sched} --repeat 3 2>&1 | grep -v "^\[" | grep -v "equal to" | tee -a $OUT/knobs-$shape.txt
  done
done
