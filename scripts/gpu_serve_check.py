"""`eyrie serve` on the GPU machine (stdlib only; run there by hand, see docs/DEVELOPING.md):

- starts the server on CUDA and on the CPU (embedded tiny model), checks greedy completions are the same on both,
  and that EAGLE-3 speculative serving on CUDA (fixtures/serve/tiny-drafter) gives the same tokens;
- measures load time, GPU memory while serving and after exit (the process must leave nothing behind);
- runs scripts/bench_serve.py against the CUDA server when present;
- the CUDA server again with `--disable-overlap-schedule`: the same greedy text, and the sweep again;
- SIGTERM: exit code 0.

usage: python3 scripts/gpu_serve_check.py BIN OUT_DIR
"""
import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request

BIN, OUT = sys.argv[1], sys.argv[2]
os.makedirs(OUT, exist_ok=True)
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
report = {}


def gpu_memory_mib():
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=30).stdout
        return int(out.split()[0])
    except Exception:
        return None


def start(args, name):
    started = time.time()
    log = open(os.path.join(OUT, f"{name}.log"), "w")
    p = subprocess.Popen([BIN, "serve", "--port", "0"] + args, stdout=subprocess.PIPE, stderr=log, text=True)
    for line in p.stdout:
        m = re.search(r"at (http://\S+)", line)
        if m:
            return p, m.group(1), time.time() - started
    raise RuntimeError(f"{name}: no URL; see {name}.log")


def post(url, path, body):
    req = urllib.request.Request(url + path, data=json.dumps(body).encode(), headers={"content-type": "application/json"})
    with urllib.request.urlopen(req, timeout=600) as r:
        return json.loads(r.read())


def stop(p, name):
    p.send_signal(signal.SIGTERM)
    code = p.wait(timeout=120)
    report[f"{name}_exit_code"] = code
    return code


PROMPTS = [[(i * 31 + j * 7) % 1000 for j in range(3 + 11 * i)] for i in range(6)]


def greedy(url):
    return [post(url, "/v1/completions", {"prompt": p, "max_tokens": 24, "temperature": 0, "ignore_eos": True})
            ["choices"][0]["text"] for p in PROMPTS]


report["gpu_memory_before_mib"] = gpu_memory_mib()
cuda, cuda_url, report["cuda_load_s"] = start(["--device", "cuda"], "cuda")
report["gpu_memory_serving_mib"] = gpu_memory_mib()
cpu, cpu_url, report["cpu_load_s"] = start(["--device", "cpu", "--max-total-tokens", "8192"], "cpu")
t = time.time()
cuda_text = greedy(cuda_url)
report["cuda_greedy_s"] = time.time() - t
t = time.time()
cpu_text = greedy(cpu_url)
report["cpu_greedy_s"] = time.time() - t
report["cuda_equals_cpu_greedy"] = [a == b for a, b in zip(cuda_text, cpu_text)]
chat = post(cuda_url, "/v1/chat/completions", {"messages": [{"role": "user", "content": "Hello"}], "max_tokens": 16})
report["cuda_chat_usage"] = chat["usage"]
bench = os.path.join(ROOT, "scripts", "bench_serve.py")
if os.path.exists(bench):
    r = subprocess.run([sys.executable, bench, "--url", cuda_url, "--json", os.path.join(OUT, "serve_gpu.json")],
                       capture_output=True, text=True, timeout=400)
    report["bench_serve_rc"] = r.returncode
    with open(os.path.join(OUT, "bench_serve_gpu.txt"), "w") as f:
        f.write(r.stdout + r.stderr)
stop(cpu, "cpu")
stop(cuda, "cuda")
# The same server with every step run to its end before the next is queued (no overlap scheduling): the same
# greedy text, and the sweep again for the difference overlap scheduling makes.
plain, plain_url, report["plain_load_s"] = start(["--device", "cuda", "--disable-overlap-schedule"], "plain")
report["no_overlap_equals_overlap_greedy"] = [a == b for a, b in zip(greedy(plain_url), cuda_text)]
if os.path.exists(bench):
    r = subprocess.run([sys.executable, bench, "--url", plain_url, "--json",
                        os.path.join(OUT, "serve_gpu_no_overlap.json")], capture_output=True, text=True, timeout=400)
    report["bench_serve_no_overlap_rc"] = r.returncode
    with open(os.path.join(OUT, "bench_serve_gpu_no_overlap.txt"), "w") as f:
        f.write(r.stdout + r.stderr)
stop(plain, "plain")
spec, spec_url, report["spec_load_s"] = start(
    ["--device", "cuda", "--speculative-algorithm", "EAGLE3", "--speculative-draft-model-path",
     os.path.join(ROOT, "fixtures/serve/tiny-drafter"), "--speculative-num-steps", "3"], "spec")
spec_text = greedy(spec_url)
report["spec_equals_plain_greedy"] = [a == b for a, b in zip(spec_text, cuda_text)]
metrics = urllib.request.urlopen(spec_url + "/metrics", timeout=60).read().decode()
report["spec_acceptance"] = [l for l in metrics.splitlines() if l.startswith("eyrie:spec_decode")]
stop(spec, "spec")
time.sleep(2)
report["gpu_memory_after_exit_mib"] = gpu_memory_mib()
procs = subprocess.run(["nvidia-smi", "--query-compute-apps=pid", "--format=csv,noheader"], capture_output=True,
                       text=True).stdout.split()
report["gpu_processes_after_exit"] = procs
print(json.dumps(report, indent=1))
with open(os.path.join(OUT, "gpu_serve_check.json"), "w") as f:
    json.dump(report, f, indent=1)
