# On the GPU machine (after the part_aa call; carry .gpu/b .gpu/deps .gpu/tok):  bash bench/gpu/gemv.sh
# engine/gemv.py's CUDA matrix-vector kernel: its error against MLX's matmul and its bandwidth per
# projection shape (bench/gpu/kernels.py); in-process decode of the Llama-3-8B bf16 shape with and
# without it (bench/gpu/profile_step.py, +g); then single-stream decode through the servers:
# ours, ours with --gemv on, mlx_lm.server and the engine alone.
set +e
source bench/gpu/install.sh
timeout 120 python3 bench/gpu/kernels.py --variants none 2>&1 | grep -v "^\[" | tee $OUT/gemv-kernels.txt
grep -q "gemv 4096x14336:" $OUT/gemv-kernels.txt || { echo "the kernel did not run"; exit 1; }
timeout 200 python3 bench/gpu/profile_step.py --shape llama3-8b --repeat 3 \
  --modes stream,ours-1t+c,ours-1t+gc,ours-1t+fgc,sched+c,sched+gc,ours-4r+gc --json-out $OUT/gemv-profile.json 2>&1 \
  | grep -v "^\[" | tee $OUT/gemv-profile.txt
mkdir -p /root/m
[ -d /root/m/l8b-bf16 ] || python3 bench/make_random_model.py --shape llama3-8b --tokenizer-from .gpu/tok --out /root/m/l8b-bf16 2>&1 | tail -1
timeout 200 python3 bench/bench.py --model /root/m/l8b-bf16 --servers ours,mlx_lm --ours-variant "gemv=--gemv=on" \
  --workloads single --engine-forms 4bit --bandwidth 4.8e12 --rounds 5 --json-out $OUT/gemv-l8b-bf16.json > $OUT/gemv-l8b.txt 2>&1
grep -v "^\[" $OUT/gemv-l8b.txt | grep -v "^{" | tail -14
