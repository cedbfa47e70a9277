"""`eyrie serve --tp-size / --ep-size` on a machine with >= 2 GPUs (stdlib only; see docs/DEVELOPING.md):

- starts the embedded tiny model on one GPU and as tp 2, ep 2 and tp 2 x ep 2 groups over GPUs 0 and 1 (NCCL);
- sends the same greedy completions to each, one at a time and 12 at once (continuous batching), and checks the
  texts equal the one-GPU server's;
- reads GPU memory per device while serving and after SIGTERM (exit code 0, nothing left on either GPU).

usage: python3 scripts/gpu_parallel_serve.py BIN OUT_DIR
"""
import concurrent.futures
import glob
import json
import os
import re
import signal
import site
import subprocess
import sys
import tempfile
import time
import urllib.request

BIN, OUT = sys.argv[1], sys.argv[2]
os.makedirs(OUT, exist_ok=True)
report = {}
env = dict(os.environ, NCCL_NVLS_ENABLE="0")


def nccl_env():
    """cudarc loads libnccl.so; pip's NCCL wheel ships libnccl.so.2 only: link it under that name."""
    if "libnccl.so " in subprocess.run(["ldconfig", "-p"], capture_output=True, text=True).stdout:
        return
    dirs = site.getsitepackages() + [site.getusersitepackages()]
    hits = sorted(h for d in dirs for h in glob.glob(os.path.join(d, "nvidia", "**", "libnccl.so*"), recursive=True))
    if hits:
        link = tempfile.mkdtemp()
        os.symlink(hits[0], os.path.join(link, "libnccl.so"))
        env["LD_LIBRARY_PATH"] = link + ":" + env.get("LD_LIBRARY_PATH", "")
        report["nccl"] = hits[0]


def gpu_memory_mib():
    out = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
                         capture_output=True, text=True, timeout=30).stdout
    return [int(v) for v in out.split()]


def start(args, name):
    started = time.time()
    log = open(os.path.join(OUT, f"{name}.log"), "w")
    p = subprocess.Popen([BIN, "serve", "--port", "0"] + args, stdout=subprocess.PIPE, stderr=log, text=True, env=env)
    for line in p.stdout:
        m = re.search(r"at (http://\S+)", line)
        if m:
            return p, m.group(1), time.time() - started
    raise RuntimeError(f"{name}: no URL (exit {p.wait()}); see {name}.log")


def post(url, body):
    req = urllib.request.Request(url + "/v1/completions", data=json.dumps(body).encode(),
                                 headers={"content-type": "application/json"})
    with urllib.request.urlopen(req, timeout=600) as r:
        return json.loads(r.read())


PROMPTS = [[(i * 31 + j * 7) % 1000 for j in range(3 + 11 * i)] for i in range(6)]


def greedy(url, prompt):
    return post(url, {"prompt": prompt, "max_tokens": 24, "temperature": 0, "ignore_eos": True})["choices"][0]["text"]


def texts(url):
    one_by_one = [greedy(url, p) for p in PROMPTS]
    with concurrent.futures.ThreadPoolExecutor(12) as pool:
        together = list(pool.map(lambda p: greedy(url, p), PROMPTS + PROMPTS))
    return one_by_one, together


def stop(p, name):
    p.send_signal(signal.SIGTERM)
    report[f"{name}_exit_code"] = p.wait(timeout=120)


nccl_env()
report["gpu_memory_before_mib"] = gpu_memory_mib()
plain, url, report["plain_load_s"] = start(["--device", "cuda:0"], "plain")
want, want_together = texts(url)
report["plain_batched_equals_one_by_one"] = want_together == want + want
stop(plain, "plain")
for name, flags in [("tp2", ["--tp-size", "2"]), ("ep2", ["--ep-size", "2"]),
                    ("tp2_ep2", ["--tp-size", "2", "--ep-size", "2"])]:
    try:
        p, url, report[f"{name}_load_s"] = start(["--device", "cuda:0"] + flags, name)
    except Exception as e:  # keep going: one split failing must not hide the others
        report[f"{name}_error"] = str(e)
        continue
    report[f"{name}_gpu_memory_serving_mib"] = gpu_memory_mib()
    t = time.time()
    got, together = texts(url)
    report[f"{name}_greedy_s"] = round(time.time() - t, 2)
    report[f"{name}_equals_one_gpu"] = got == want
    report[f"{name}_batched_equals_one_gpu"] = together == want + want
    metrics = urllib.request.urlopen(url + "/metrics", timeout=60).read().decode()
    report[f"{name}_kv_blocks_used_after"] = [l for l in metrics.splitlines() if l.startswith("eyrie:kv_cache_blocks_used")]
    stop(p, name)
time.sleep(2)
report["gpu_memory_after_exit_mib"] = gpu_memory_mib()
report["gpu_processes_after_exit"] = subprocess.run(
    ["nvidia-smi", "--query-compute-apps=pid", "--format=csv,noheader"], capture_output=True, text=True).stdout.split()
print(json.dumps(report, indent=1))
with open(os.path.join(OUT, "gpu_parallel_serve.json"), "w") as f:
    json.dump(report, f, indent=1)
