"""Writes one Kimi-K2-shaped INT4 expert checkpoint with the real compressed-tensors library, for GPU checks.

Usage: python3 scripts/kimi_expert_checkpoint.py OUT_DIR

The three Linears of one routed expert at Kimi-K2 shapes (gate/up [2048, 7168], down [7168, 2048]), random bf16
weights, group 32 symmetric, minmax qparams (`calculate_qparams`), compressed by
`PackedQuantizationCompressor.compress`, saved under Kimi's tensor names with a matching config.json. About 25 MB.
`eyrie dequant OUT_DIR --tensor model.layers.1.mlp.experts.0.gate_proj --device cuda` then dequantizes on the GPU
and checks the result bit for bit against the CPU reference (itself bit-exact with this library, see
crates/quant/tests/golden_compressed_tensors.rs).
"""

import json
import os
import sys

import torch
from safetensors.torch import save_file
from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme
from compressed_tensors.quantization.utils import calculate_qparams

GROUP = 32


def main(out):
    os.makedirs(out, exist_ok=True)
    torch.manual_seed(0)
    args = QuantizationArgs(num_bits=4, type="int", symmetric=True, strategy="group", group_size=GROUP)
    scheme = QuantizationScheme(targets=["Linear"], weights=args)
    tensors = {}
    for name, (o, i) in {"gate_proj": (2048, 7168), "up_proj": (2048, 7168), "down_proj": (7168, 2048)}.items():
        w = (torch.randn(o, i) * 0.02).to(torch.bfloat16)
        g = w.view(o, i // GROUP, GROUP)
        scale, zp = calculate_qparams(g.amin(-1), g.amax(-1), args)
        sd = PackedQuantizationCompressor.compress({"weight": w, "weight_scale": scale, "weight_zero_point": zp}, scheme)
        for k, v in sd.items():
            tensors[f"model.layers.1.mlp.experts.0.{name}.{k}"] = v.contiguous()
    save_file(tensors, os.path.join(out, "model.safetensors"))
    config = {
        "architectures": ["DeepseekV3ForCausalLM"],
        "model_type": "kimi_k2",
        "quantization_config": {
            "quant_method": "compressed-tensors",
            "format": "pack-quantized",
            "quantization_status": "compressed",
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": args.model_dump(), "input_activations": None, "output_activations": None}},
            "ignore": ["lm_head", "re:.*self_attn.*", "re:.*shared_experts.*", "re:.*mlp\\.(gate|up|gate_up|down)_proj.*"],
        },
    }
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    print({k: (tuple(v.shape), str(v.dtype)) for k, v in tensors.items()})


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else ".device/kimi_expert")
