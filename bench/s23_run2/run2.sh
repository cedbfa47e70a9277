set -x
cd .device-s23
for f in *.gz; do gunzip -f $f; done; chmod +x gpu_attention
export LD_LIBRARY_PATH=/usr/local/cuda/lib64
timeout 280 ./gpu_attention --quick --mma --json $OUT/att_h64.json > $OUT/att_h64.txt 2>&1; echo rc=$?
grep -c "ok |" $OUT/att_h64.txt; grep -h FAIL $OUT/att_h64.txt | head -20
grep "tensor cores" $OUT/att_h64.txt | grep "^| [0-9]" | sort -t'|' -k2,2n -k3,3n -k11,11n | awk -F'|' '{k=$2"|"$3; if (!(k in best) || $10+0 < best[k]+0) {best[k]=$10; line[k]=$0}} END {for (k in line) print line[k]}'
grep "tensor cores" $OUT/att_h64.txt | grep "^| [0-9]" | grep -E "\| (32|64|128|256|512|1024) \|" | head -120
grep "best dims" $OUT/att_h64.txt
EYRIE_ATTENTION_MMA=1 timeout 100 ncu --clock-control none --kernel-name regex:mla_attention_mma --launch-count 1 --section WarpStateStats --section LaunchStats --section Occupancy --section SpeedOfLight --section ComputeWorkloadAnalysis --section InstructionStats --page raw --csv ./gpu_attention --profile 1x8192 > $OUT/ncu_mma_1x8k.csv 2>&1; echo ncu rc=$?
