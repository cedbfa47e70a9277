"""Cross-checks the embedded default model (`crates/server/assets/tiny-model`) against the Python reference libraries.

Run from the repository root:

    python3 scripts/check_tiny_model.py [DUMP]

DUMP is a file written by eyrie's test (`EYRIE_TINY_MODEL_DUMP=DUMP cargo test -p eyrie-model --test tiny_model
chat_prefill`); without it the script runs that test itself (honouring CARGO_TARGET_DIR). Checks:

- the `quantization_config`, read by compressed-tensors and applied to one `nn.Linear` per checkpoint Linear, selects
  exactly the routed experts (as Kimi-K2-Thinking's does);
- compressed-tensors decompresses every INT4 expert (`PackedQuantizationCompressor.decompress`);
- transformers' `DeepseekV3ForCausalLM` (f32, eager attention) on the decompressed weights gives eyrie's logits for
  the chat prompt plus eyrie's greedy tokens: prints `max|eyrie - hf| / max|hf|` (must be <= 1e-4) and checks
  HF's greedy choices;
- `tokenizers.Tokenizer.from_file` encodes the rendered prompt to eyrie's ids, and transformers'
  `apply_chat_template` renders the same prompt text from the same messages.

Last run with transformers 5.24.0, torch 2.15.0+cu132 (CPU), compressed-tensors 0.20.1, tokenizers 0.23.3.
"""

import json
import os
import subprocess
import sys
import tempfile

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
from compressed_tensors.quantization import QuantizationConfig
from compressed_tensors.quantization.lifecycle.apply import apply_quantization_config
from tokenizers import Tokenizer
from transformers import DeepseekV3ForCausalLM, PreTrainedTokenizerFast

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
MODEL = os.path.join(ROOT, "crates", "server", "assets", "tiny-model")
# The conversation of eyrie's test `chat_prefill_and_greedy_decode_over_the_kv_cache`.
MESSAGES = [
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "Hello! What is 2 + 2? Answer briefly 🙂"},
]
TOLERANCE = 1e-4


def eyrie_dump(path):
    if path is None:
        path = os.path.join(tempfile.mkdtemp(), "eyrie.safetensors")
        env = dict(os.environ, EYRIE_TINY_MODEL_DUMP=path)
        cmd = ["cargo", "test", "-p", "eyrie-model", "--test", "tiny_model", "chat_prefill"]
        subprocess.run(cmd, cwd=ROOT, env=env, check=True)
    with safe_open(path, "pt") as f:
        prompt = f.metadata()["prompt"]
        tokens = f.get_tensor("tokens")
        prompt_len = int(f.get_tensor("prompt_len")[0])
        logits = f.get_tensor("logits")
    return prompt, tokens, prompt_len, logits


def linear_tree(state):
    """One nn.Linear per checkpoint Linear (dense `.weight` of rank 2, or an INT4 `.weight_packed`), by name."""
    names = {k[: -len(".weight")] for k, v in state.items() if k.endswith(".weight") and v.dim() == 2}
    names |= {k[: -len(".weight_packed")] for k in state if k.endswith(".weight_packed")}
    # Not nn.Linear in transformers: the embedding, and the MoE router (DeepseekV3TopkRouter holds a bare weight).
    names = sorted(n for n in names if "embed_tokens" not in n and not n.endswith(".mlp.gate"))
    root = torch.nn.Module()
    for name in names:
        parent = root
        parts = name.split(".")
        for part in parts[:-1]:
            if not hasattr(parent, part):
                parent.add_module(part, torch.nn.Module())
            parent = getattr(parent, part)
        w = state.get(f"{name}.weight")
        out, inp = w.shape if w is not None else state[f"{name}.weight_shape"].tolist()
        parent.add_module(parts[-1], torch.nn.Linear(inp, out, bias=False, dtype=torch.bfloat16))
    return root, names


def decompressed_state(config):
    state = load_file(os.path.join(MODEL, "model.safetensors"))
    qconfig = QuantizationConfig.model_validate(config["quantization_config"])
    root, linears = linear_tree(state)
    apply_quantization_config(root, qconfig, show_progress=False)
    quantized = sorted(n for n, m in root.named_modules() if hasattr(m, "quantization_scheme"))
    experts = sorted(n for n in linears if ".mlp.experts." in n)
    assert quantized == experts, f"quantization_config selects {quantized}, expected the {len(experts)} experts"
    assert sorted(k[: -len(".weight_packed")] for k in state if k.endswith(".weight_packed")) == experts
    out = {}
    for k, v in state.items():
        prefix = k.rsplit(".", 1)[0]
        if prefix in quantized:
            if k.endswith(".weight_packed"):
                local = {p: state[f"{prefix}.{p}"] for p in ("weight_packed", "weight_scale", "weight_shape")}
                assert local["weight_shape"].dtype == torch.int32 and local["weight_scale"].dtype == torch.bfloat16
                scheme = root.get_submodule(prefix).quantization_scheme
                w = PackedQuantizationCompressor.decompress(local, scheme)["weight"]
                assert w.dtype == torch.bfloat16, w.dtype
                out[f"{prefix}.weight"] = w.float()
            continue
        assert v.dtype in (torch.bfloat16, torch.float32), (k, v.dtype)
        out[k] = v.float()
    print(f"quantization_config: {len(quantized)} INT4 experts, {len(linears) - len(quantized)} dense Linears")
    return out


def hf_model(config, state):
    with tempfile.TemporaryDirectory() as tmp:
        plain = {k: v for k, v in config.items() if k != "quantization_config"}
        # transformers has no `kimi_k2` class without remote code; the architecture is DeepseekV3's.
        plain["model_type"] = "deepseek_v3"
        with open(os.path.join(tmp, "config.json"), "w") as f:
            json.dump(plain, f)
        save_file(state, os.path.join(tmp, "model.safetensors"), metadata={"format": "pt"})
        model, info = DeepseekV3ForCausalLM.from_pretrained(
            tmp, dtype=torch.float32, attn_implementation="eager", output_loading_info=True
        )
    model.eval()
    bad = {k: v for k, v in info.items() if v and k in ("missing_keys", "unexpected_keys", "mismatched_keys")}
    assert not bad, f"checkpoint vs transformers' model: {bad}"
    rp = model.config.rope_parameters
    assert rp["rope_type"] == "yarn" and rp["factor"] == 32.0 and rp["rope_theta"] == 50000.0, rp
    return model


def main():
    torch.set_num_threads(1)
    prompt, tokens, prompt_len, eyrie_logits = eyrie_dump(sys.argv[1] if len(sys.argv) > 1 else None)
    with open(os.path.join(MODEL, "config.json")) as f:
        config = json.load(f)

    # tokenizer_config.json names PreTrainedTokenizerFast; AutoTokenizer would read config.json, whose `kimi_k2`
    # model_type transformers only knows through remote code.
    hf_tok = PreTrainedTokenizerFast.from_pretrained(MODEL)
    rendered = hf_tok.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    assert rendered == prompt, f"transformers renders {rendered!r}, eyrie {prompt!r}"
    ids = Tokenizer.from_file(os.path.join(MODEL, "tokenizer.json")).encode(prompt, add_special_tokens=False).ids
    assert ids == tokens[:prompt_len].tolist(), f"tokenizers: {ids}\neyrie:      {tokens[:prompt_len].tolist()}"
    assert len(hf_tok) == config["vocab_size"], (len(hf_tok), config["vocab_size"])
    print(f"tokenizer and chat template agree: {prompt_len} prompt tokens")

    model = hf_model(config, decompressed_state(config))
    with torch.no_grad():
        hf_logits = model(tokens[None]).logits[0]
    err = ((eyrie_logits - hf_logits).abs().max() / hf_logits.abs().max()).item()
    greedy = hf_logits[prompt_len - 1 : -1].argmax(-1)
    same = torch.equal(greedy, tokens[prompt_len:])
    print(f"logits [{tokens.numel()}, {hf_logits.shape[-1]}]: max|eyrie - hf| / max|hf| = {err:.3e}")
    print(f"greedy tokens {tokens[prompt_len:].tolist()}: HF agrees: {same}")
    assert err <= TOLERANCE, f"relative logit error {err:.3e} above {TOLERANCE}"
    assert same, f"HF greedy {greedy.tolist()}"


if __name__ == "__main__":
    main()
