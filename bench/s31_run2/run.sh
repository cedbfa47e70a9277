# Session 31, lease 2: the TF32 attention kernel with the sums' rescale fixed, six score accumulators, 4 or 8 warps:
# checks at every case, the quick benchmark at 8 heads (TF32 pick, then EYRIE_ATTENTION_TF32=0), the --tf32 sweep
# at 8 heads, and Nsight Compute on the picked launch at 8 x 8k.
cd .device-s31 && for f in *.gz; do gunzip -f $f; done; chmod +x gpu_attention; cd ..
export LD_LIBRARY_PATH=/usr/local/cuda/lib64
W=/tmp/w2; rm -rf $W; mkdir -p $W; pack() { tar -C /tmp -czf $OUT/run.tgz w2; }
D=.device-s31; T0=$(date +%s); el() { echo "[$(( $(date +%s) - T0 )) s]"; }
timeout 150 $D/gpu_attention --quick --heads 8 --json $W/ga8.json > $W/ga8.txt 2>&1; echo "ga8 rc=$? $(el)"; pack
echo "ok: $(grep -c '| ok' $W/ga8.txt)"; grep -E "FAIL|rror" $W/ga8.txt | head -8 | cut -c1-250
grep "TF32" $W/ga8.txt | grep -v "^| [0-9]" | awk -F'|' '{print $7 $8}' | sort | uniq -c | sort -rn | head -3
grep "TF32" $W/ga8.txt | grep -v "^| [0-9]" | awk -F'|' '{print $8}' | sort -g | tail -3
grep -E "copy bandwidth|^\| [0-9]+ \| [0-9]+ \| [0-9.]+ \|" $W/ga8.txt | cut -c1-250
EYRIE_ATTENTION_TF32=0 timeout 100 $D/gpu_attention --quick --heads 8 > $W/ga8_dims.txt 2>&1
echo "ga8 dims rc=$? $(el)"; pack; grep -E "^\| [0-9]+ \| [0-9]+ \| [0-9.]+ \|" $W/ga8_dims.txt | cut -c1-250
timeout 200 $D/gpu_attention --quick --tf32 --heads 8 --json $W/ga8_sweep.json > $W/ga8_sweep.txt 2>&1; echo "sweep rc=$? $(el)"; pack
grep -E "^\| [0-9]+ \| [0-9]+ \| TF32" $W/ga8_sweep.txt | sort -t'|' -k2,2n -k3,3n -k10,10g | awk -F'|' '{k=$2$3; if (c[k]++ < 4) print}' | cut -c1-200
grep -E "^best" $W/ga8_sweep.txt | cut -c1-220
timeout 120 ncu --section SpeedOfLight --section Occupancy --section WarpStateStats --section LaunchStats --page raw --csv \
  -k regex:tf32 $D/gpu_attention --profile 8x8192 --heads 8 > $W/ncu.csv 2> $W/ncu.err; echo "ncu rc=$? $(el)"; pack
python3 - $W/ncu.csv <<'PY'
import csv, sys
rows = list(csv.reader(open(sys.argv[1])))
hdr = next((i for i, r in enumerate(rows) if 'Kernel Name' in r), None)
if hdr is None: print(open(sys.argv[1]).read()[-2000:]); sys.exit()
h = rows[hdr]; last = rows[-1]
keys = ['gpu__time_duration.sum', 'dram__throughput.avg.pct_of_peak_sustained_elapsed', 'sm__warps_active.avg.pct_of_peak_sustained_active',
 'smsp__issue_active.avg.pct_of_peak_sustained_active', 'launch__registers_per_thread', 'launch__occupancy_limit_registers',
 'launch__occupancy_limit_shared_mem', 'smsp__warps_eligible.avg.per_cycle_active', 'sm__throughput.avg.pct_of_peak_sustained_elapsed']
for k in keys:
    if k in h: print(k, last[h.index(k)])
st = [(float(last[i].replace(',', '')), h[i]) for i in range(len(h)) if 'issue_stalled' in h[i] and 'per_issue_active' in h[i] and last[i].replace('.', '').replace(',', '').isdigit()]
for v, k in sorted(st, reverse=True)[:8]: print(f'{v:7.2f} {k}')
PY
