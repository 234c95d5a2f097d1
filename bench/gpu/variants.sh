# On the GPU machine (after the part_aa call; carry .gpu/b .gpu/deps .gpu/tok):  bash bench/gpu/variants.sh
# In-process decode of the decode-step variants (fused projections +f, compiled decode steps +c, both
# +fc) against mlx-lm's generate_step, for the Llama-3-8B and Qwen3-0.6B bf16 shapes; the one-time
# cost of a new batch size with and without compiled steps; then writes the Llama-3-8B bf16 model to
# /root/m for a server bench in the next call (bench/gpu/run.sh or bench.py directly).
set +e
source bench/gpu/install.sh
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,power.draw --format=csv
M=${MODES:-stream,stream+f,stream+c,stream+fc,ours-1t,ours-1t+f,ours-1t+c,ours-1t+fc,sched,sched+fc,ours-8,ours-8+fc,ours-4r,ours-4r+fc,newbatch,newbatch+fc}
for shape in llama3-8b qwen3-0.6b; do
  timeout ${T1:-240} python3 bench/gpu/profile_step.py --shape $shape --modes $M --repeat 3 \
    --json-out $OUT/variants-$shape.json 2>&1 | grep -v "^\[" | tee $OUT/variants-$shape.txt
done
mkdir -p /root/m
[ -d /root/m/l8b-bf16 ] || python3 bench/make_random_model.py --shape llama3-8b --tokenizer-from .gpu/tok --out /root/m/l8b-bf16 2>&1 | tail -1
