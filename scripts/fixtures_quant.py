"""Golden fixtures for eyrie-quant's compressed-tensors INT4 (`pack-quantized`) support.

Run from the repository root:

    python3 scripts/fixtures_quant.py

Last run with compressed-tensors 0.20.1, torch 2.15.0 (CPU), safetensors 0.8.0, transformers 5.24.0 (imported by
compressed-tensors), Python 3.11.7. The output is deterministic (fixed seed, CPU arithmetic, sorted JSON keys).

What it does, using only the library's own code paths:

1. builds a tiny torch model of bf16 `nn.Linear`s named like Kimi-K2's MoE layers
   (`model.layers.1.mlp.experts.{i}.gate_proj`) plus a few dense Linears matched by Kimi's `ignore` list;
2. `apply_quantization_config` with one config group per case (targets: the class `Linear`, a `re:` pattern, exact
   names) and Kimi's `ignore` list;
3. calibrates each weight with min-max over its groups (`calculate_qparams`, what llm-compressor's `minmax` observer
   feeds it; `compute_dynamic_scales_and_zp` for the group strategy);
4. compresses with `ModelCompressor.compress_model` (format `pack-quantized`: `PackedQuantizationCompressor`) and
   writes `config.json` with `ModelCompressor.update_config`;
5. saves the compressed state dict as a 2-shard safetensors checkpoint with `model.safetensors.index.json`
   (`weight_shape` stored as I64 for some modules and I32 for others, as real checkpoints differ);
6. re-reads the shards and decompresses every module with `PackedQuantizationCompressor.decompress`, checks it
   equals `decompress_module` on the in-memory model, and stores the result as `<module>.weight` (bf16) in
   `expected.safetensors`, together with the original weight as `<module>.weight_original`.

The library rejects groups that do not divide `in_features` (`_process_group`: "tensor column shape must be divisible
by the given group_size"), so the odd-width cases use group sizes that divide the width but not 8 (in=100, group 20;
in=200, group 40) and the channel strategy (in=100). Partial last groups are covered by the Rust property tests.
"""

import json
import os
import sys

import torch
from safetensors.torch import load_file, save_file

import compressed_tensors
from compressed_tensors.compressors.base import decompress_module
from compressed_tensors.compressors.model_compressors.model_compressor import ModelCompressor
from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
from compressed_tensors.quantization import (
    QuantizationArgs,
    QuantizationConfig,
    QuantizationScheme,
)
from compressed_tensors.quantization.lifecycle.apply import apply_quantization_config
from compressed_tensors.quantization.utils import calculate_qparams, compute_dynamic_scales_and_zp

OUT_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "fixtures", "quant")
PREFIX = "model.layers.1.mlp.experts"
SEED = 20240601

# (expert index, out, in, group size or None for channel, symmetric, weight_shape dtype, targets of its group)
CASES = [
    (0, 32, 256, 32, True, torch.int64, ["Linear"]),
    (1, 16, 512, 128, True, torch.int32, ["re:.*experts\\.1\\.gate_proj$"]),
    (2, 37, 128, 32, False, torch.int64, [f"{PREFIX}.2.gate_proj"]),
    (3, 24, 100, 20, True, torch.int32, [f"{PREFIX}.3.gate_proj"]),
    (4, 19, 200, 40, False, torch.int64, [f"{PREFIX}.4.gate_proj"]),
    (5, 45, 100, None, False, torch.int32, [f"{PREFIX}.5.gate_proj"]),
]
# Kimi-K2-Thinking / K2.5's ignore list (kimi-k2-formats.md section 1).
IGNORE = ["lm_head", "re:.*self_attn.*", "re:.*shared_experts.*", "re:.*mlp\\.(gate|up|gate_up|down)_proj.*"]
# Dense Linears every one of which an IGNORE entry matches (the class target `Linear` would otherwise take them).
DENSE = {
    "lm_head": (24, 16),
    "model.layers.1.self_attn.o_proj": (16, 24),
    "model.layers.1.mlp.shared_experts.gate_proj": (8, 16),
    "model.layers.0.mlp.gate_proj": (8, 16),
}


def module_name(expert):
    return f"{PREFIX}.{expert}.gate_proj"


def build_model():
    """A module tree whose named_modules() are the Linears above, all bf16 with seeded random weights."""
    root = torch.nn.Module()
    gen = torch.Generator().manual_seed(SEED)
    shapes = {module_name(e): (out, inp) for e, out, inp, *_ in CASES}
    shapes.update(DENSE)
    for name, (out, inp) in shapes.items():
        parent = root
        parts = name.split(".")
        for part in parts[:-1]:
            if not hasattr(parent, part):
                parent.add_module(part, torch.nn.Module())
            parent = getattr(parent, part)
        linear = torch.nn.Linear(inp, out, bias=False, dtype=torch.bfloat16)
        w = torch.randn(out, inp, generator=gen) * 0.02
        # A few outliers per row, as real weights have.
        w[:, ::37] *= 6.0
        linear.weight.data = w.to(torch.bfloat16)
        parent.add_module(parts[-1], linear)
    # Expert 0: an all-zero group (scale falls back to the bf16 epsilon) and an all-negative one.
    w0 = root.get_submodule(module_name(0)).weight.data
    w0[3, 64:96] = 0
    w0[5, 0:32] = -w0[5, 0:32].abs() - 0.01
    # Expert 2 (asymmetric): an all-positive group, so min = 0 and the zero point sits at -8.
    w2 = root.get_submodule(module_name(2)).weight.data
    w2[1, 32:64] = w2[1, 32:64].abs()
    return root


def quantization_config():
    groups = {}
    for idx, (_, _, _, group, symmetric, _, targets) in enumerate(CASES):
        weights = QuantizationArgs(
            num_bits=4,
            type="int",
            symmetric=symmetric,
            strategy="group" if group is not None else "channel",
            group_size=group,
            dynamic=False,
            observer="minmax",
        )
        groups[f"group_{idx}"] = QuantizationScheme(targets=targets, weights=weights)
    return QuantizationConfig(config_groups=groups, format="pack-quantized", ignore=IGNORE)


def calibrate(model):
    """Min-max qparams per group (or per row for channel), as the library computes them."""
    for name, module in model.named_modules():
        scheme = getattr(module, "quantization_scheme", None)
        if scheme is None:
            continue
        args = scheme.weights
        weight = module.weight.data
        if args.strategy == "group":
            scale, zp = compute_dynamic_scales_and_zp(weight, args, module)
        else:
            lo = torch.amin(weight, dim=-1, keepdim=True)
            hi = torch.amax(weight, dim=-1, keepdim=True)
            scale, zp = calculate_qparams(lo, hi, args)
        assert scale.shape == module.weight_scale.shape, (name, scale.shape, module.weight_scale.shape)
        module.weight_scale.data.copy_(scale)
        module.weight_zero_point.data.copy_(zp)


def main():
    os.makedirs(OUT_DIR, exist_ok=True)
    for f in os.listdir(OUT_DIR):
        os.remove(os.path.join(OUT_DIR, f))

    model = build_model()
    original = {module_name(e): model.get_submodule(module_name(e)).weight.data.clone() for e, *_ in CASES}
    qconfig = quantization_config()
    apply_quantization_config(model, qconfig, show_progress=False)
    quantized = sorted(n for n, m in model.named_modules() if hasattr(m, "quantization_scheme"))
    assert quantized == sorted(module_name(e) for e, *_ in CASES), quantized
    calibrate(model)

    compressor = ModelCompressor(quantization_config=qconfig, force_compression_format="pack-quantized")
    compressor.compress_model(model)
    state = {k: v.detach().clone().contiguous() for k, v in model.state_dict().items()}
    for e, *_, shape_dtype, _ in CASES:
        key = f"{module_name(e)}.weight_shape"
        state[key] = state[key].to(shape_dtype)

    # Two shards: experts 0..2 (and lm_head) in the first, the rest in the second.
    def shard_of(key):
        first = [module_name(e) for e in (0, 1, 2)] + ["lm_head"]
        return 0 if any(key.startswith(p + ".") for p in first) else 1

    shard_names = ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    shards = [{}, {}]
    for key, tensor in state.items():
        shards[shard_of(key)][key] = tensor
    weight_map = {}
    for fname, tensors in zip(shard_names, shards):
        save_file(tensors, os.path.join(OUT_DIR, fname), metadata={"format": "pt"})
        weight_map.update({k: fname for k in tensors})
    total = sum(t.numel() * t.element_size() for t in state.values())
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    with open(os.path.join(OUT_DIR, "model.safetensors.index.json"), "w") as f:
        json.dump(index, f, indent=2, sort_keys=True)
        f.write("\n")

    base_config = {
        "architectures": ["DeepseekV3ForCausalLM"],
        "model_type": "kimi_k2",
        "torch_dtype": "bfloat16",
    }
    with open(os.path.join(OUT_DIR, "config.json"), "w") as f:
        json.dump(base_config, f)
    compressor.update_config(OUT_DIR)

    # Decompress from the files, with the library's compressor.
    on_disk = {}
    for fname in shard_names:
        on_disk.update(load_file(os.path.join(OUT_DIR, fname)))
    schemes = {n: m.quantization_scheme for n, m in model.named_modules() if hasattr(m, "quantization_scheme")}
    expected = {}
    for name in quantized:
        local = {k[len(name) + 1 :]: v for k, v in on_disk.items() if k.startswith(name + ".")}
        assert "weight" not in local and "weight_packed" in local, sorted(local)
        assert ("weight_zero_point" in local) == (not schemes[name].weights.symmetric), sorted(local)
        weight = PackedQuantizationCompressor.decompress(local, schemes[name])["weight"]
        assert weight.dtype == torch.bfloat16 and weight.shape == original[name].shape
        expected[f"{name}.weight"] = weight.contiguous()
        expected[f"{name}.weight_original"] = original[name].contiguous()

    # Cross-check: the in-memory module path gives the same bits.
    for name in quantized:
        module = model.get_submodule(name)
        decompress_module(module)
        assert torch.equal(module.weight.data.view(torch.int16), expected[f"{name}.weight"].view(torch.int16)), name

    save_file(expected, os.path.join(OUT_DIR, "expected.safetensors"), metadata={"format": "pt"})

    print(f"compressed-tensors {compressed_tensors.__version__}, torch {torch.__version__}, python {sys.version.split()[0]}")
    print(f"wrote {os.path.relpath(OUT_DIR)}:")
    grand = 0
    for fname in sorted(os.listdir(OUT_DIR)):
        size = os.path.getsize(os.path.join(OUT_DIR, fname))
        grand += size
        print(f"  {fname:40s} {size:8d} bytes")
    print(f"  {'total':40s} {grand:8d} bytes")
    for e, out, inp, group, symmetric, shape_dtype, targets in CASES:
        name = module_name(e)
        g = "channel" if group is None else f"group {group}"
        sym = "symmetric" if symmetric else "asymmetric"
        shapes = {k.rsplit(".", 1)[1]: list(v.shape) for k, v in state.items() if k.startswith(name + ".")}
        print(f"  {name}: [{out}, {inp}] {g} {sym}, weight_shape {shape_dtype}, targets {targets}: {shapes}")
    assert grand < 2 * 1024 * 1024, "fixtures must stay under 2 MB"


if __name__ == "__main__":
    main()
