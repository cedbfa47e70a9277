"""Builds fixtures/serve/scripted: the embedded tiny model (crates/server/assets/tiny-model) with weights edited so
that its greedy output is a fixed script, for end-to-end tests of reasoning_content and tool calls through the real
model code (no mock): every attention output projection and MLP/expert down projection is zeroed (expert scales set
to 0), so the residual stream at the last layer is the current token's embedding; the script's tokens get
orthogonal one-hot embeddings and lm_head maps each to its successor. The greedy continuation after any prompt that
ends in `<|im_middle|>` (the assistant header) is therefore:

    <think>Hmm</think>Ok<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0
    <|tool_call_argument_begin|>{"city": "Paris"}<|tool_call_end|><|tool_calls_section_end|><|im_end|>

Also fixtures/serve/tiny-drafter: a random EAGLE-3 drafter for the embedded tiny model in the SpecForge layout
(`LlamaForCausalLMEagle3`, `midlayer.*`, `fc`, target embedding, full vocabulary), for the server's speculative
decoding tests (its acceptance is low; the tests check that output does not change).

Run: python3 scripts/fixtures_serve.py   (needs torch, safetensors, tokenizers)
"""
import json
import os
import shutil

import torch
from safetensors.torch import load_file, save_file
from tokenizers import Tokenizer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SRC = os.path.join(ROOT, "crates/server/assets/tiny-model")
DST = os.path.join(ROOT, "fixtures/serve/scripted")

PIECES = [
    "<think>", "Hmm", "</think>", "Ok",
    "<|tool_calls_section_begin|>", "<|tool_call_begin|>", "functions.get_weather:0",
    "<|tool_call_argument_begin|>", '{"city": "Paris"}', "<|tool_call_end|>", "<|tool_calls_section_end|>",
    "<|im_end|>",
]


def main():
    tok = Tokenizer.from_file(os.path.join(SRC, "tokenizer.json"))
    start = tok.token_to_id("<|im_middle|>")
    script = [start]
    for p in PIECES:
        script += tok.encode(p, add_special_tokens=False).ids
    # Each token must have one successor: no token may repeat (the last one, <|im_end|>, ends generation).
    assert len(set(script)) == len(script), f"the script repeats a token: {script}"
    weights = load_file(os.path.join(SRC, "model.safetensors"))
    hidden = weights["model.embed_tokens.weight"].shape[1]
    assert len(script) <= hidden, "one-hot embeddings need hidden_size >= script length"
    for name in list(weights):
        if name.endswith("o_proj.weight") or name.endswith("down_proj.weight"):
            weights[name] = torch.zeros_like(weights[name])
        if name.endswith("down_proj.weight_scale"):
            weights[name] = torch.zeros_like(weights[name])
    embed = weights["model.embed_tokens.weight"].float()
    lm_head = weights["lm_head.weight"].float() * 0.01
    for i, t in enumerate(script):
        embed[t] = 0.0
        embed[t, i] = 1.0
    for i, (t, nxt) in enumerate(zip(script, script[1:])):
        # After the final RMSNorm the one-hot is sqrt(hidden) * norm.weight[i] in coordinate i.
        lm_head[nxt, i] = 10.0
    weights["model.embed_tokens.weight"] = embed.to(torch.bfloat16)
    weights["lm_head.weight"] = lm_head.to(torch.bfloat16)
    weights["model.norm.weight"] = torch.ones_like(weights["model.norm.weight"])
    shutil.rmtree(DST, ignore_errors=True)
    os.makedirs(DST)
    for f in os.listdir(SRC):
        if f not in ("model.safetensors", "README.md"):
            shutil.copy(os.path.join(SRC, f), os.path.join(DST, f))
    save_file(weights, os.path.join(DST, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(DST, "script.json"), "w") as f:
        json.dump({"pieces": PIECES, "ids": script[1:]}, f, indent=1)
    print(f"wrote {DST}: script of {len(script) - 1} tokens")


def drafter():
    dst = os.path.join(ROOT, "fixtures/serve/tiny-drafter")
    cfg = json.load(open(os.path.join(SRC, "config.json")))
    h, vocab, inter, heads, head_dim = cfg["hidden_size"], cfg["vocab_size"], 128, 4, 16
    g = torch.Generator().manual_seed(7)
    rnd = lambda *shape, scale: torch.randn(*shape, generator=g) * scale
    w = {
        "fc.weight": rnd(h, 3 * h, scale=(3 * h) ** -0.5),
        "midlayer.input_layernorm.weight": 1 + rnd(h, scale=0.1),
        "midlayer.hidden_norm.weight": 1 + rnd(h, scale=0.1),
        "midlayer.post_attention_layernorm.weight": 1 + rnd(h, scale=0.1),
        "midlayer.self_attn.q_proj.weight": rnd(heads * head_dim, 2 * h, scale=(2 * h) ** -0.5),
        "midlayer.self_attn.k_proj.weight": rnd(heads * head_dim, 2 * h, scale=(2 * h) ** -0.5),
        "midlayer.self_attn.v_proj.weight": rnd(heads * head_dim, 2 * h, scale=(2 * h) ** -0.5),
        "midlayer.self_attn.o_proj.weight": rnd(h, heads * head_dim, scale=(heads * head_dim) ** -0.5),
        "midlayer.mlp.gate_proj.weight": rnd(inter, h, scale=h**-0.5),
        "midlayer.mlp.up_proj.weight": rnd(inter, h, scale=h**-0.5),
        "midlayer.mlp.down_proj.weight": rnd(h, inter, scale=inter**-0.5),
        "norm.weight": 1 + rnd(h, scale=0.1),
        "lm_head.weight": rnd(vocab, h, scale=3 * h**-0.5),
    }
    config = dict(
        architectures=["LlamaForCausalLMEagle3"], model_type="llama", hidden_size=h, intermediate_size=inter,
        num_attention_heads=heads, num_key_value_heads=heads, head_dim=head_dim, num_hidden_layers=1,
        rms_norm_eps=1e-5, vocab_size=vocab, hidden_act="silu", max_position_embeddings=cfg["max_position_embeddings"],
        rope_theta=10000.0, tie_word_embeddings=False, draft_vocab_size=vocab,
        eagle_config={"use_aux_hidden_state": True, "eagle_aux_hidden_state_layer_ids": [0, 1, 1]},
    )
    shutil.rmtree(dst, ignore_errors=True)
    os.makedirs(dst)
    save_file({k: v.to(torch.bfloat16).contiguous() for k, v in w.items()}, os.path.join(dst, "model.safetensors"),
              metadata={"format": "pt"})
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump(config, f, indent=1)
    print(f"wrote {dst}")


if __name__ == "__main__":
    main()
    drafter()
