# Session 28, lease 4: the host's time a launch with the shared-memory attribute set once at load (default) and
# before every launch (EYRIE_FUNC_ATTR_EACH_LAUNCH=1), from the stream trace of the one-token layer benchmark.
cd .device-s28 && gunzip -f gk.gz && chmod +x gk && cd ..
export LD_LIBRARY_PATH=/usr/local/cuda/lib64
W=/tmp/w; mkdir -p $W; pack() { tar -C /tmp -czf $OUT/run.tgz w; }
for a in 0 1; do
  EYRIE_FUNC_ATTR_EACH_LAUNCH=$a EYRIE_TRACE_STREAM=$W/trace_attr$a.tsv timeout 75 .device-s28/gk bench --m 1 --no-sweep \
    > $W/gk_attr$a.txt 2>&1; echo "attr_each=$a rc=$?"; gzip -f $W/trace_attr$a.tsv; pack
  grep -E "^\| 1 \|" $W/gk_attr$a.txt
done
