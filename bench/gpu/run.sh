source bench/gpu/install.sh
mkdir -p /root/m
run() {  # name, make args, bench timeout
  [ -d /root/m/$1 ] || python3 bench/make_random_model.py $2 --tokenizer-from .gpu/tok --out /root/m/$1 2>&1 | tail -1
  timeout $3 python3 bench/bench.py --model /root/m/$1 --servers ours,mlx_lm --engine-forms 4bit --clients ${CLIENTS:-1,4,8,32} --bandwidth 4.8e12 $EXTRA --json-out $OUT/$1.json > $OUT/$1.txt 2>&1
  grep -v "^\[" $OUT/$1.txt | tail -40
  rm -rf /root/m/$1
}
for spec in "$@"; do eval "run $spec"; done
