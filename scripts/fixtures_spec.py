"""Golden fixtures for eyrie-spec-decode's EAGLE-3 drafter, computed by a PyTorch reference of the EAGLE-3 layer.

Run from the repository root:

    python3 scripts/fixtures_spec.py

Last run with transformers 5.24.0, torch 2.15.0+cu132 (on the CPU), safetensors 0.8.0. Deterministic (fixed seeds, CPU
f32 arithmetic).

The reference layer follows SpecForge's `specforge/modeling/draft/llama3_eagle.py` (`LlamaDecoderLayer.forward`:
`residual = hidden; hidden = hidden_norm(hidden); emb = input_layernorm(emb); attn(cat(emb, hidden))`, q/k/v over
`2 * hidden_size` inputs, `residual + attn`, then the post-attention-norm SwiGLU MLP with its residual; the model's
`fc` over the three concatenated aux states, `norm` then `lm_head` for logits, `d2t` mapping draft ids to target ids)
and speculators' `src/speculators/models/eagle3/{core,model_definitions}.py` for its variants (`norm_before_residual`:
the residual is the normed hidden state; `norm_before_fc`: `input_norm` over the concatenation before `fc`; `fc_norm`:
one RMSNorm per aux chunk). RMSNorm, SwiGLU MLP, RoPE (rotate-half, default and llama3 scaling) and `repeat_kv` are
transformers' own Llama functions. Attention is the serving form (as SGLang's and vLLM's `llama_eagle3.py` run it): each
row attends causally to every cached row of its sequence; rows from the target are "extended", then chain steps feed
the layer's own pre-norm output back as the hidden state (no `fc`), and a second extend first drops those draft-only
rows.

Writes `fixtures/spec/<name>/` (config.json + model.safetensors, weights in bf16) for three tiny drafters of the target
`fixtures/model/yarn_qlora` (hidden 64, vocab 256, 3 layers):

- `specforge`: `LlamaForCausalLMEagle3`, `midlayer.*`, draft vocab 64 with `d2t`/`t2d`, no `embed_tokens` (the target's
  embedding is used), no aux ids (the default `[2, L/2, L-3]`), 4 heads over 2 kv heads, default RoPE.
- `speculators`: `Eagle3Speculator`, `layers.0.*`, own `embed_tokens`, `norm_before_residual` and `norm_before_fc`,
  llama3 RoPE scaling, aux ids `[0, 1, 2]`, draft vocab 64.
- `speculators_fcnorm`: like `speculators` with `fc_norm` instead of `norm_before_fc` and no `draft_vocab_size` (full
  vocabulary, no `d2t`/`t2d`).

and `fixtures/spec/reference.safetensors` with, per drafter `<name>`: `<name>.features` (F32 [n, 192], aux states),
`<name>.tokens` (I64 [n], the token after each position), `<name>.prenorm` (F32 [n, 64], the layer output) and
`<name>.logits` (F32 [n, draft_vocab]) of the first extend; `<name>.chain_tokens` (I64 [2]) fed by two chain steps and
their `<name>.chain_prenorm` / `<name>.chain_logits`; `<name>.features2` / `tokens2` / `prenorm2` / `logits2` of a
second extend (m rows, after the chain's rows are dropped); `<name>.d2t_abs` (I64 [draft_vocab], target id of each
draft id).
"""

import json
import os

import torch
from safetensors.torch import load_file, save_file
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaMLP, LlamaRMSNorm, LlamaRotaryEmbedding, apply_rotary_pos_emb, repeat_kv

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
OUT_DIR = os.path.join(ROOT, "fixtures", "spec")
TARGET = os.path.join(ROOT, "fixtures", "model", "yarn_qlora")

H, INTER, HEADS, KV_HEADS, HEAD_DIM, EPS = 64, 64, 4, 2, 16, 1e-5
N_FIRST, N_SECOND = 6, 3


def target_embedding():
    index = json.load(open(os.path.join(TARGET, "model.safetensors.index.json")))
    shard = index["weight_map"]["model.embed_tokens.weight"]
    return load_file(os.path.join(TARGET, shard))["model.embed_tokens.weight"].float()


def bf16(t):
    return t.to(torch.bfloat16)


class Reference:
    """The EAGLE-3 drafter layer with a per-sequence KV cache, in f32, from bf16-stored weights."""

    def __init__(self, w, cfg, embed, prefix, llama_config, norm_before_residual, norm_before_fc, fc_norm, d2t_abs):
        f = lambda name: w[name].float()
        self.cfg = cfg
        self.embed = embed
        self.fc = f("fc.weight")
        self.input_norm = self.norm(f("input_norm.weight"), 3 * H) if norm_before_fc else None
        self.fc_norms = [self.norm(f(f"fc_norm.{i}.weight"), H) for i in range(3)] if fc_norm else None
        self.input_layernorm = self.norm(f(f"{prefix}.input_layernorm.weight"), H)
        self.hidden_norm = self.norm(f(f"{prefix}.hidden_norm.weight"), H)
        self.post_attention_layernorm = self.norm(f(f"{prefix}.post_attention_layernorm.weight"), H)
        self.q, self.k, self.v, self.o = (f(f"{prefix}.self_attn.{p}_proj.weight") for p in "qkvo")
        self.mlp = LlamaMLP(llama_config)
        self.mlp.gate_proj.weight.data = f(f"{prefix}.mlp.gate_proj.weight")
        self.mlp.up_proj.weight.data = f(f"{prefix}.mlp.up_proj.weight")
        self.mlp.down_proj.weight.data = f(f"{prefix}.mlp.down_proj.weight")
        self.final_norm = self.norm(f("norm.weight"), H)
        self.lm_head = f("lm_head.weight")
        self.rotary = LlamaRotaryEmbedding(llama_config)
        self.norm_before_residual = norm_before_residual
        self.keys, self.values = [], []  # per row: [1, kv, 1, hd]

    @staticmethod
    def norm(weight, width):
        n = LlamaRMSNorm(width, eps=EPS)
        n.weight.data = weight
        return n

    def fuse(self, features):
        a = features
        if self.input_norm is not None:
            a = self.input_norm(a)
        if self.fc_norms is not None:
            a = torch.cat([n(c) for n, c in zip(self.fc_norms, a.split(H, dim=-1))], dim=-1)
        return a @ self.fc.T

    def layer(self, tokens, hidden):
        """tokens [n], hidden [n, H] at positions len(self.keys)..; returns the pre-norm outputs [n, H]."""
        n = hidden.shape[0]
        start = len(self.keys)
        emb = self.embed[tokens]
        residual = hidden
        hidden = self.hidden_norm(hidden)
        if self.norm_before_residual:
            residual = hidden
        z = torch.cat([self.input_layernorm(emb), hidden], dim=-1)[None]  # [1, n, 2H]
        q = (z @ self.q.T).view(1, n, HEADS, HEAD_DIM).transpose(1, 2)
        k = (z @ self.k.T).view(1, n, KV_HEADS, HEAD_DIM).transpose(1, 2)
        v = (z @ self.v.T).view(1, n, KV_HEADS, HEAD_DIM).transpose(1, 2)
        positions = torch.arange(start, start + n)[None]
        cos, sin = self.rotary(v, positions)
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        for i in range(n):
            self.keys.append(k[:, :, i : i + 1])
            self.values.append(v[:, :, i : i + 1])
        keys = repeat_kv(torch.cat(self.keys, dim=2), HEADS // KV_HEADS)
        values = repeat_kv(torch.cat(self.values, dim=2), HEADS // KV_HEADS)
        total = keys.shape[2]
        scores = q @ keys.transpose(2, 3) / HEAD_DIM**0.5
        mask = torch.arange(total)[None, :] > (start + torch.arange(n))[:, None]
        scores = scores.masked_fill(mask, float("-inf"))
        attn = torch.softmax(scores, dim=-1, dtype=torch.float32) @ values  # [1, heads, n, hd]
        attn = attn.transpose(1, 2).reshape(n, HEADS * HEAD_DIM)
        h = residual + attn @ self.o.T
        return h + self.mlp(self.post_attention_layernorm(h))

    def logits(self, prenorm):
        return self.final_norm(prenorm) @ self.lm_head.T

    def truncate(self, n):
        del self.keys[n:]
        del self.values[n:]


def make(name, seed, fmt, embed_target, norm_before_residual=False, norm_before_fc=False, fc_norm=False, draft_vocab=64, rope_scaling=None):
    g = torch.Generator().manual_seed(seed)
    rnd = lambda *shape, scale: torch.randn(*shape, generator=g) * scale
    vocab = 256
    prefix = "midlayer" if fmt == "specforge" else "layers.0"
    w = {
        "fc.weight": rnd(H, 3 * H, scale=(3 * H) ** -0.5),
        f"{prefix}.input_layernorm.weight": 1 + rnd(H, scale=0.1),
        f"{prefix}.hidden_norm.weight": 1 + rnd(H, scale=0.1),
        f"{prefix}.post_attention_layernorm.weight": 1 + rnd(H, scale=0.1),
        f"{prefix}.self_attn.q_proj.weight": rnd(HEADS * HEAD_DIM, 2 * H, scale=(2 * H) ** -0.5),
        f"{prefix}.self_attn.k_proj.weight": rnd(KV_HEADS * HEAD_DIM, 2 * H, scale=(2 * H) ** -0.5),
        f"{prefix}.self_attn.v_proj.weight": rnd(KV_HEADS * HEAD_DIM, 2 * H, scale=(2 * H) ** -0.5),
        f"{prefix}.self_attn.o_proj.weight": rnd(H, HEADS * HEAD_DIM, scale=(HEADS * HEAD_DIM) ** -0.5),
        f"{prefix}.mlp.gate_proj.weight": rnd(INTER, H, scale=H**-0.5),
        f"{prefix}.mlp.up_proj.weight": rnd(INTER, H, scale=H**-0.5),
        f"{prefix}.mlp.down_proj.weight": rnd(H, INTER, scale=INTER**-0.5),
        "norm.weight": 1 + rnd(H, scale=0.1),
        "lm_head.weight": rnd(draft_vocab, H, scale=3 * H**-0.5),
    }
    if norm_before_fc:
        w["input_norm.weight"] = 1 + rnd(3 * H, scale=0.1)
    if fc_norm:
        for i in range(3):
            w[f"fc_norm.{i}.weight"] = 1 + rnd(H, scale=0.1)
    if embed_target:
        embed = target_embedding()
    else:
        w["embed_tokens.weight"] = rnd(vocab, H, scale=1.0)
    w = {k: bf16(v) for k, v in w.items()}
    if not embed_target:
        embed = w["embed_tokens.weight"].float()
    if draft_vocab < vocab:
        targets = torch.sort(torch.randperm(vocab, generator=g)[:draft_vocab]).values
        w["d2t"] = targets - torch.arange(draft_vocab)
        t2d = torch.zeros(vocab, dtype=torch.bool)
        t2d[targets] = True
        w["t2d"] = t2d
    else:
        targets = torch.arange(vocab)

    llama = dict(
        hidden_size=H, intermediate_size=INTER, num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, head_dim=HEAD_DIM,
        num_hidden_layers=1, rms_norm_eps=EPS, vocab_size=vocab, hidden_act="silu", max_position_embeddings=128,
        rope_theta=10000.0, tie_word_embeddings=False,
    )
    if rope_scaling is not None:
        llama["rope_scaling"] = rope_scaling
    if fmt == "specforge":
        config = dict(architectures=["LlamaForCausalLMEagle3"], model_type="llama", **llama, draft_vocab_size=draft_vocab,
                      eagle_config={"use_aux_hidden_state": True})
    else:
        config = dict(architectures=["Eagle3Speculator"], speculators_model_type="eagle3",
                      transformer_layer_config=dict(model_type="llama", **llama), norm_before_residual=norm_before_residual,
                      norm_before_fc=norm_before_fc, fc_norm=fc_norm, target_hidden_size=H,
                      eagle_aux_hidden_state_layer_ids=[0, 1, 2])
        if draft_vocab < vocab:
            config["draft_vocab_size"] = draft_vocab
    out = os.path.join(OUT_DIR, name)
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "config.json"), "w") as fh:
        json.dump(config, fh, indent=2, sort_keys=True)
        fh.write("\n")
    save_file({k: v.contiguous() for k, v in w.items()}, os.path.join(out, "model.safetensors"))

    llama_config = LlamaConfig(**llama)
    ref = Reference(w, config, embed, prefix, llama_config, norm_before_residual, norm_before_fc, fc_norm, targets)
    feats = rnd(N_FIRST, 3 * H, scale=1.0)
    tokens = torch.randint(0, vocab, (N_FIRST,), generator=g)
    result = {}
    with torch.no_grad():
        pre = ref.layer(tokens, ref.fuse(feats))
        result.update({f"{name}.features": feats, f"{name}.tokens": tokens, f"{name}.prenorm": pre, f"{name}.logits": ref.logits(pre)})
        # Two chain steps: greedy draft ids mapped to target ids, the layer's own output fed back.
        last = pre[-1:]
        chain_tokens, chain_pre, chain_logits = [], [], []
        for _ in range(2):
            d = int(torch.argmax(ref.logits(last)[0]))
            t = int(targets[d])
            last = ref.layer(torch.tensor([t]), last)
            chain_tokens.append(t)
            chain_pre.append(last)
            chain_logits.append(ref.logits(last))
        result.update({f"{name}.chain_tokens": torch.tensor(chain_tokens), f"{name}.chain_prenorm": torch.cat(chain_pre),
                       f"{name}.chain_logits": torch.cat(chain_logits)})
        ref.truncate(N_FIRST)
        feats2 = rnd(N_SECOND, 3 * H, scale=1.0)
        tokens2 = torch.randint(0, vocab, (N_SECOND,), generator=g)
        pre2 = ref.layer(tokens2, ref.fuse(feats2))
        result.update({f"{name}.features2": feats2, f"{name}.tokens2": tokens2, f"{name}.prenorm2": pre2,
                       f"{name}.logits2": ref.logits(pre2), f"{name}.d2t_abs": targets.to(torch.int64)})
    return result


def main():
    torch.set_grad_enabled(False)
    ref = {}
    ref.update(make("specforge", 1, "specforge", embed_target=True))
    ref.update(make("speculators", 2, "speculators", embed_target=False, norm_before_residual=True, norm_before_fc=True,
                    rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                      original_max_position_embeddings=32)))
    ref.update(make("speculators_fcnorm", 3, "speculators", embed_target=False, fc_norm=True, draft_vocab=256))
    save_file({k: v.contiguous() for k, v in sorted(ref.items())}, os.path.join(OUT_DIR, "reference.safetensors"))
    total = sum(os.path.getsize(os.path.join(dp, f)) for dp, _, fs in os.walk(OUT_DIR) for f in fs)
    print(f"wrote {OUT_DIR} ({total} bytes)")


if __name__ == "__main__":
    main()
