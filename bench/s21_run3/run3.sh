#!/bin/bash
# Session 21, run 3: the serving sweep against the CUDA server with and without overlap scheduling, alternated
# (plain, overlap, overlap, plain), 128 prompts a run, to tell the mode's effect from the order and the lease.
set -u
cd "$(dirname "$0")"
export LD_LIBRARY_PATH=/usr/local/cuda/lib64
gunzip -kf eyrie.gz && chmod +x eyrie
W=/tmp/s21run3 && mkdir -p $W
i=0
for mode in plain overlap overlap plain; do
  i=$((i+1))
  extra=""; [ $mode = plain ] && extra="--disable-overlap-schedule"
  ./eyrie serve --device cuda --port 31234 $extra > $W/server_$i.out 2> $W/server_$i.log &
  pid=$!
  for t in $(seq 1 120); do grep -q "at http" $W/server_$i.out 2>/dev/null && break; sleep 1; done
  timeout 200 python3 ../scripts/bench_serve.py --url http://127.0.0.1:31234 --num-prompts 128 --json $W/sweep_${i}_$mode.json > $W/sweep_${i}_$mode.txt 2>&1
  grep -h "concurrency\|TTFT" $W/sweep_${i}_$mode.txt | head -3
  python3 -c "import urllib.request;print(urllib.request.urlopen('http://127.0.0.1:31234/metrics').read().decode())" | grep "steps_total " > $W/steps_$i.txt
  cat $W/steps_$i.txt
  kill -TERM $pid; wait $pid
done
tar czf $OUT/s21_run3.tgz -C $W .
