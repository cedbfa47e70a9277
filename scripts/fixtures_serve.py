"""Builds fixtures/serve/scripted: the embedded tiny model (crates/server/assets/tiny-model) with weights edited so
that its greedy output is a fixed script, for end-to-end tests of reasoning_content and tool calls through the real
model code (no mock): every attention output projection and MLP/expert down projection is zeroed (expert scales set
to 0), so the residual stream at the last layer is the current token's embedding; the script's tokens get
orthogonal one-hot embeddings and lm_head maps each to its successor. The greedy continuation after any prompt that
ends in `<|im_middle|>` (the assistant header) is therefore:

    <think>Hmm</think>Ok<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0
    <|tool_call_argument_begin|>{"city": "Paris"}<|tool_call_end|><|tool_calls_section_end|><|im_end|>

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


if __name__ == "__main__":
    main()
