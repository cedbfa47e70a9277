# Session 30, lease 7: CubeCL's client queues launches 32 at a time (cubecl-common's channel: its device thread takes
# a batch only when full or at a blocking call), which was the old BehindCopy figure's fixed cost. Does a step that
# starts after a blocking readback pay it too? `EYRIE_EARLY_FLUSH=1` (new, off by default) hands the queue to the
# device thread after the first layer; the slice's step each waiting for its ids, and overlapped, alternated.
cd .device-s30 && for f in *.gz; do gunzip -f $f; done; chmod +x bd; cd ..
export LD_LIBRARY_PATH=/usr/local/cuda/lib64
W=/tmp/w; mkdir -p $W; pack() { tar -C /tmp -czf $OUT/run.tgz w; }
D=.device-s30; T0=$(date +%s); el() { echo "[$(( $(date +%s) - T0 )) s]"; }
dec() {  # name, env...
  local n=$1; shift
  env "$@" timeout 80 $D/bd --splits 1x1 --layers 10 --batch 1 --context 1024 --steps 30 --warmup 4 --overlap \
    --json $W/decode_$n.json > $W/decode_$n.txt 2>&1
  echo "decode $n rc=$? $(el)"; pack; grep -E "ms/step median" $W/decode_$n.txt | cut -c1-200
  python3 -c "import json;d=json.load(open('$W/decode_$n.json'));print([{k:v for k,v in r.items() if 'ms' in k} for r in d['rows']])" 2>&1 | cut -c1-400
}
dec flush1_1 EYRIE_EARLY_FLUSH=1; dec flush0_1 EYRIE_EARLY_FLUSH=0; dec flush1_2 EYRIE_EARLY_FLUSH=1; dec flush0_2 EYRIE_EARLY_FLUSH=0
