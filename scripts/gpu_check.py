"""GPU checks of a release `eyrie` binary, run on the device machine from the repository root.

Usage (device machine): python3 scripts/gpu_check.py [BINARY] [OUT_DIR]
Prepare here with `cargo xtask gpu-bundle` (release build, stripped binary and a Kimi-shaped INT4 expert checkpoint
under .device/), then run it there carrying `.device`. Needs torch and safetensors (both on the device image).

1. INT4 dequantization with burn tensor ops on CUDA equals the CPU reference bit for bit (`eyrie dequant --device
   cuda` checks that itself), on the compressed-tensors fixtures and on a Kimi-shaped expert; the GPU results also
   equal the library's own decompression (fixtures/quant/expected.safetensors).
2. `eyrie score` on CUDA against `eyrie score` on the CPU and against HF transformers (fixtures/model/*/reference):
   max|a-b| / max|b| per tensor for the logits and every hidden state.
3. `eyrie generate` greedy on CUDA equals HF's 32 greedy tokens.
Prints a table; exits non-zero when a check fails.
"""

import json
import os
import subprocess
import sys

import torch
from safetensors.torch import load_file

BIN = sys.argv[1] if len(sys.argv) > 1 else ".device/eyrie"
OUT = sys.argv[2] if len(sys.argv) > 2 else "/tmp/gpu_check"
MODELS = ["yarn_qlora", "v2lite", "int4_experts", "kimi_k25"]
TOL = 1e-4  # relative to max|reference|, the golden tests' metric (met by the CPU path, tested in CI)
# CubeCL's tensor-core f32 matmul stages f32 operands as TF32 (cubek-matmul `definition/blueprint.rs`), so f32
# results on CUDA carry ~1e-3 relative error until issue 4's GEMMs replace it. The real model's weights are bf16,
# where this does not apply; this bound only keeps the tiny f32 fixtures honest meanwhile.
CUDA_TOL = 3e-3
failures = []


def run(*args):
    r = subprocess.run([BIN, *args], capture_output=True, text=True)
    if r.returncode != 0:
        failures.append(f"{' '.join(args[:2])}: {r.stderr.strip()}")
    return r


def rel(a, b):
    a, b = a.float(), b.float()
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()


def main():
    os.makedirs(OUT, exist_ok=True)
    subprocess.run(["nvidia-smi", "-L"])
    # 1. dequantization
    expected = load_file("fixtures/quant/expected.safetensors")
    for name in sorted(k for k in expected if k.endswith(".weight")):
        module = name[: -len(".weight")]
        path = f"{OUT}/{module}.safetensors"
        if run("dequant", "fixtures/quant", "--tensor", module, "--out", path, "--device", "cuda").returncode == 0:
            got = load_file(path)[name]
            ok = torch.equal(got.view(torch.int16), expected[name].view(torch.int16))
            print(f"dequant {module:45s} cuda == compressed-tensors: {ok}")
            if not ok:
                failures.append(f"dequant {module}: differs from compressed-tensors")
    if os.path.isdir(".device/kimi_expert"):
        for p in ["gate_proj", "up_proj", "down_proj"]:
            r = run("dequant", ".device/kimi_expert", "--tensor", f"model.layers.1.mlp.experts.0.{p}", "--out",
                    f"{OUT}/kimi_{p}.safetensors", "--device", "cuda")
            print(f"dequant kimi expert {p}: {r.stderr.strip().splitlines()[0] if r.stderr.strip() else r.returncode}")
    # 2. score, 3. generate
    rows = []
    for model in MODELS:
        d = f"fixtures/model/{model}"
        ref = load_file(f"{d}/reference.safetensors")
        for p in (0, 1):
            toks = ",".join(str(int(t)) for t in ref[f"tokens.{p}"].tolist())
            outs = {}
            for dev in ("cpu", "cuda"):
                path = f"{OUT}/{model}.{p}.{dev}.safetensors"
                if run("score", "--model", d, "--tokens", toks, "--out", path, "--device", dev).returncode == 0:
                    outs[dev] = load_file(path)
            if len(outs) < 2:
                continue
            cpu, cuda = outs["cpu"], outs["cuda"]
            hidden = sorted(k for k in cuda if k.startswith("hidden.") and k != "hidden.final")
            e_logits = rel(cuda["logits"], ref[f"logits.{p}"])
            e_cpu = rel(cuda["logits"], cpu["logits"])
            e_hidden = max(rel(cuda[k], ref[f"hidden.{p}.{k.split('.')[1]}"]) for k in hidden)
            g = run("generate", "--model", d, "--tokens", toks, "--max-tokens", "32", "--ignore-eos", "--json",
                    "--device", "cuda")
            same = False
            if g.returncode == 0:
                gen = json.loads(g.stdout.strip().splitlines()[-1])["tokens"]
                same = gen == [int(t) for t in ref[f"greedy.{p}"].tolist()]
            rows.append((model, p, e_cpu, e_logits, e_hidden, same))
            if max(e_logits, e_cpu, e_hidden) > CUDA_TOL or not same:
                failures.append(f"{model} prompt {p}: errors {e_cpu:.2e}/{e_logits:.2e}/{e_hidden:.2e}, greedy same={same}")
    print(f"\nCUDA tolerance {CUDA_TOL:g} (TF32 in CubeCL's f32 matmul; CPU path: {TOL:g})")
    print(f"\n{'model':14s} {'p':>2s} {'cuda vs cpu':>12s} {'cuda vs HF':>12s} {'hidden vs HF':>13s}  greedy == HF")
    for m, p, a, b, c, s in rows:
        print(f"{m:14s} {p:2d} {a:12.2e} {b:12.2e} {c:13.2e}  {s}")
    if failures:
        print("\nFAILED:\n  " + "\n  ".join(failures))
        sys.exit(1)
    print("\nall GPU checks passed")


if __name__ == "__main__":
    main()
