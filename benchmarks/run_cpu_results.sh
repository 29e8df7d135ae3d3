#!/bin/bash
# The CPU results of the README (benchmarks/results/cpu/): one job at a time on an otherwise idle
# machine (a busy core stalls every OpenMP barrier), the load average logged before each.
# Then: python benchmarks/report/make_readme_cpu_performance.py
cd "$(dirname "$0")/.."
export HF_HUB_OFFLINE=1
R=benchmarks/results/cpu
log() { echo "== $(date +%T) load: $(cut -d' ' -f1-3 /proc/loadavg) :: $*" | tee -a $R/run.log; }
: > $R/run.log
log start
# The CPU default (issue 25): bert-base and all-MiniLM-L6-v2, dense 8x128 / ragged 16x256 / 1x128, fp32 and
# (on a CPU with bf16 units) bf16, against transformers SDPA, ONNX Runtime fp32 and int8, OpenVINO default and f32.
log "bench default (fp32 + bf16)"; bert-fast bench --threads 2 --max-seconds 45 --no-progress --json $R/bench_cpu.json > $R/bench_cpu.txt 2>&1
log "bench encode"; bert-fast bench --encode --threads 2 --max-seconds 60 --no-progress --json $R/encode.json > $R/encode.txt 2>&1
log "dropin"; python benchmarks/model/dropin.py --budget 45 --json $R/dropin.json > $R/dropin.txt 2>&1
log "train"; python benchmarks/training/cpu_train_bf16.py train --budget 150 --json $R/train_mlm.json > $R/train_mlm.txt 2>&1
log "bf16 error"; python benchmarks/training/cpu_train_bf16.py bf16-error --json $R/bf16_error.json > $R/bf16_error.txt 2>&1
log done
