# On the GPU machine (after the part_aa call; carry .gpu/b .gpu/deps .gpu/tok):
#   bash bench/gpu/profile.sh
# 1. the engine's pieces in-process (profile_step.py) for Llama-3-8B and Qwen3-0.6B bf16 shapes;
# 2. single-stream server decode, ours vs mlx_lm.server vs the engine alone, and ours with
#    mlx-lm's plain BatchGenerator (MLX_SERVER_PLAIN_BATCH=1) for the before/after.
# Results land in $OUT. Steps have their own timeouts so that one call stays under 10 minutes.
set +e
source bench/gpu/install.sh
mkdir -p /root/m
nvidia-smi --query-gpu=name,memory.total,clocks.max.memory --format=csv
for shape in ${SHAPES:-llama3-8b qwen3-0.6b}; do
  timeout ${PROF_TIMEOUT:-150} python3 bench/gpu/profile_step.py --shape $shape ${PROF_ARGS} --json-out $OUT/prof-$shape.json 2>&1 | grep -v "^\[" | tee $OUT/prof-$shape.txt
done
for spec in ${SERVER_SPECS:-"l8b-bf16:llama3-8b"}; do
  name=${spec%%:*}; shape=${spec##*:}
  [ -d /root/m/$name ] || python3 bench/make_random_model.py --shape $shape --tokenizer-from .gpu/tok --out /root/m/$name 2>&1 | tail -1
  timeout ${BENCH_TIMEOUT:-200} python3 bench/bench.py --model /root/m/$name --servers ours,mlx_lm --engine-forms 4bit --workloads single --rounds 3 --bandwidth 4.8e12 --json-out $OUT/$name-single.json > $OUT/$name-single.txt 2>&1
  grep -v "^\[" $OUT/$name-single.txt | tail -14
  MLX_SERVER_PLAIN_BATCH=1 timeout ${PLAIN_TIMEOUT:-100} python3 bench/bench.py --model /root/m/$name --servers ours --no-engine --workloads single --rounds 3 --bandwidth 4.8e12 --json-out $OUT/$name-single-plain.json > $OUT/$name-single-plain.txt 2>&1
  echo "== plain BatchGenerator:"; grep -E "decode tok/s|tokens/s" $OUT/$name-single-plain.txt | grep -v "^\[" | head -3
done
