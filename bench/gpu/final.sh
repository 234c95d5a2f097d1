# On the GPU machine (after the part_aa call; carry .gpu/b .gpu/deps .gpu/tok):  bash bench/gpu/final.sh
# Every workload, ours vs mlx_lm.server vs the engine alone, for each shape; then our server with
# mlx-lm's plain BatchGenerator (MLX_SERVER_PLAIN_BATCH=1), single stream, for the before/after;
# then the in-process profile (profile_step.py). Results land in $OUT/final.tgz: the device tool
# brings back at most 8 files per call, so the many outputs travel as one archive.
set +e
source bench/gpu/install.sh
FINAL_OUT=$OUT; OUT=/root/out; mkdir -p $OUT
mkdir -p /root/m
mk() { [ -d /root/m/$1 ] || python3 bench/make_random_model.py $2 --tokenizer-from .gpu/tok --out /root/m/$1 2>&1 | tail -1; }
full() {  # name, bench timeout
  timeout $2 python3 bench/bench.py --model /root/m/$1 --servers ours,mlx_lm --engine-forms 4bit --clients 1,4,8,32 \
    --bandwidth 4.8e12 --rounds 3 --json-out $OUT/$1.json > $OUT/$1.txt 2>&1
  grep -v "^\[" $OUT/$1.txt | grep -v "^{"
}
plain() {  # name, timeout
  MLX_SERVER_PLAIN_BATCH=1 timeout $2 python3 bench/bench.py --model /root/m/$1 --servers ours --no-engine \
    --workloads single --rounds 3 --bandwidth 4.8e12 --json-out $OUT/$1-plain.json > $OUT/$1-plain.txt 2>&1
  echo "== $1, plain BatchGenerator:"; grep -E "decode tok/s|% of ceiling" $OUT/$1-plain.txt | grep -v "^\["
}
mk q06-bf16 "--shape qwen3-0.6b"; full q06-bf16 ${T1:-150}
mk l8b-bf16 "--shape llama3-8b"; full l8b-bf16 ${T2:-200}
plain l8b-bf16 ${T3:-120}; plain q06-bf16 ${T4:-90}
for shape in qwen3-0.6b llama3-8b; do
  timeout ${T5:-45} python3 bench/gpu/profile_step.py --shape $shape --modes stream,plain-1,ours-1t,sched --repeat 3 \
    --json-out $OUT/prof-$shape.json 2>&1 | grep -v "^\[" | tee $OUT/prof-$shape.txt
done
tar czf $FINAL_OUT/final.tgz -C $OUT .
