cd .device-next && gunzip -f gk_probe.gz && chmod +x gk_probe && cd ..
export LD_LIBRARY_PATH=/usr/local/cuda/lib64
G=.device-next/gk_probe
timeout 70 $G stages --m 1 --stage gate_up > $OUT/gate_up_split.txt 2>&1; echo "gate_up with split rc=$?"
grep -E "^\| (8|4) \| 3 \|" $OUT/gate_up_split.txt
EYRIE_PROBE_SKIP_SPLIT=1 timeout 70 $G stages --m 1 --stage gate_up > $OUT/gate_up_nosplit.txt 2>&1; echo "gate_up without split rc=$?"
grep -E "^\| (8|4) \| 3 \|" $OUT/gate_up_nosplit.txt
EYRIE_MOE_FUSED_SPLIT=0 timeout 70 $G stages --m 1 --stage down > $OUT/down_split.txt 2>&1; echo "down with the intermediate's split launch rc=$?"
grep -E "^\| 1 \| (1|4) \| (1|2) \|" $OUT/down_split.txt
