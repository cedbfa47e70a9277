"""Golden fixtures for eyrie-model's DeepSeek-V3 / MLA forward pass, computed by HF transformers in f32.

Run from the repository root:

    python3 scripts/fixtures_model.py

Last run with transformers 5.24.0, torch 2.15.0+cu132 (run on the CPU), compressed-tensors 0.20.1, safetensors 0.8.0, Python 3.11.7.
The output is deterministic (fixed seeds, CPU f32 arithmetic, eager attention, sorted JSON keys).

Writes `fixtures/model/<name>/` for four tiny models (hidden 64, 4 heads, vocab 256):

- `yarn_qlora`: YaRN rope (factor 4, original_max_position_embeddings 32, so positions past 32 are extrapolated),
  q_lora_rank set, 3 layers (first dense, then MoE), 8 routed experts in 4 groups with topk_group 2, top-2 routing,
  1 shared expert, routed_scaling_factor 2.5, norm_topk_prob, rms_norm_eps 1e-5 and a random (non-zero)
  e_score_correction_bias. Saved as 3 shards with `model.safetensors.index.json`, plus a fake DeepSeek MTP layer
  `model.layers.3.*` (num_nextn_predict_layers 1) that a loader must skip.
- `v2lite`: no q_lora (plain `q_proj`), default rope, rope_interleave false, one expert group, 2 shared experts,
  norm_topk_prob false.
- `int4_experts`: `yarn_qlora`'s weights with every routed expert quantized INT4 (group 32, symmetric, bf16 scales)
  by the real compressed-tensors library: targets `Linear` with Kimi-K2's `ignore` list (so only
  `mlp.experts.*` is quantized), min-max calibration, `ModelCompressor.compress_model`, config.json written by
  `ModelCompressor.update_config`. Its reference outputs are HF's on the DEcompressed weights (bf16 values widened to
  f32), so the comparison is exact up to f32 arithmetic.
- `kimi_k25`: `yarn_qlora`'s weights under `language_model.model.*` / `language_model.lm_head.weight`, plus
  fake `vision_tower.*` / `mm_projector.*` tensors, with a K2.5-style config.json (`KimiK25ForConditionalGeneration`,
  the LM config under `text_config` in the published `rope_scaling` + top-level `rope_theta` form).

Every checkpoint has a `model.safetensors.index.json` (one-file ones too), so that `reference.safetensors` is not
mistaken for a shard. Each directory holds `reference.safetensors` with, for prompts p = 0 (7 tokens) and 1 (12 tokens):
`tokens.{p}` (I64 [n]), `logits.{p}` (F32 [n, vocab]), `hidden.{p}.{i}` (F32 [n, hidden]) for every entry i of HF's
`output_hidden_states` (i < num_hidden_layers: the residual stream at the input of layer i; the last entry: the
final normed state), and `greedy.{p}` (I64 [32]): `model.generate(do_sample=False)` with eos disabled.

The script checks that the fixtures are robust to f32 rounding: every greedy step's top-1/top-2 logit gap and every
router decision (expert top-k and group top-k) has a margin of at least 5e-4 (logits are O(1); f32 errors are ~1e-6), so an implementation that is correct to
f32 precision reproduces the same tokens and expert choices.
"""

import json
import os
import shutil
import sys
import tempfile

import torch
from safetensors.torch import load_file, save_file

import compressed_tensors
import transformers
from compressed_tensors.compressors.model_compressors.model_compressor import ModelCompressor
from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
from compressed_tensors.quantization import QuantizationArgs, QuantizationConfig, QuantizationScheme
from compressed_tensors.quantization.lifecycle.apply import apply_quantization_config
from compressed_tensors.quantization.utils import compute_dynamic_scales_and_zp
from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

OUT_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "fixtures", "model")
PROMPTS = [
    [1, 17, 200, 45, 99, 3, 128],
    [5, 250, 64, 31, 77, 12, 140, 9, 201, 33, 180, 2],
]
NEW_TOKENS = 32
MIN_MARGIN = 5e-4
KIMI_IGNORE = ["lm_head", "re:.*self_attn.*", "re:.*shared_experts.*", "re:.*mlp\\.(gate|up|gate_up|down)_proj.*"]

YARN_QLORA = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=96,
    moe_intermediate_size=32,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=4,
    n_shared_experts=1,
    n_routed_experts=8,
    routed_scaling_factor=2.5,
    kv_lora_rank=32,
    q_lora_rank=48,
    qk_rope_head_dim=16,
    v_head_dim=24,
    qk_nope_head_dim=32,
    n_group=4,
    topk_group=2,
    num_experts_per_tok=2,
    first_k_dense_replace=1,
    norm_topk_prob=True,
    max_position_embeddings=128,
    rms_norm_eps=1e-5,
    rope_interleave=True,
    num_nextn_predict_layers=1,
    bos_token_id=0,
    eos_token_id=1,
    rope_scaling={
        "type": "yarn",
        "factor": 4.0,
        "original_max_position_embeddings": 32,
        "beta_fast": 32,
        "beta_slow": 1,
        "mscale": 1.0,
        "mscale_all_dim": 1.0,
    },
    rope_theta=10000.0,
)

V2LITE = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=80,
    moe_intermediate_size=24,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=4,
    n_shared_experts=2,
    n_routed_experts=6,
    routed_scaling_factor=1.0,
    kv_lora_rank=24,
    q_lora_rank=None,
    qk_rope_head_dim=8,
    v_head_dim=16,
    qk_nope_head_dim=16,
    n_group=1,
    topk_group=1,
    num_experts_per_tok=2,
    first_k_dense_replace=1,
    norm_topk_prob=False,
    max_position_embeddings=256,
    rms_norm_eps=1e-6,
    rope_interleave=False,
    num_nextn_predict_layers=0,
    bos_token_id=0,
    eos_token_id=1,
    rope_theta=5000.0,
)


class MarginError(Exception):
    """A fixture whose greedy tokens or expert choices could flip under f32 rounding differences."""


def randomize(model, seed):
    """Weights with O(1) activations (HF's init, std 0.02, makes the model nearly linear and would hide bugs), norm
    weights around 1, a non-zero router bias (HF initializes it to zero), and layer 1's latents scaled down."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=gen))
            elif name.endswith("embed_tokens.weight"):
                p.copy_(torch.randn(p.shape, generator=gen))
            else:
                # Linear-like [.., out, in]: std 1/sqrt(in).
                p.copy_(torch.randn(p.shape, generator=gen) / p.shape[-1] ** 0.5)
        for name, b in sorted(model.named_buffers()):
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.15 * torch.randn(b.shape, generator=gen))
        # Tiny latents in one layer, so that the eps of q_a_layernorm / kv_a_layernorm (transformers: 1e-6, not
        # rms_norm_eps) changes the outputs far beyond the test tolerance when rms_norm_eps != 1e-6.
        attn = model.model.layers[1].self_attn
        if attn.q_a_proj is not None:
            attn.q_a_proj.weight.mul_(0.003)
        attn.kv_a_proj_with_mqa.weight[: attn.kv_lora_rank].mul_(0.003)


def build(cfg_kwargs, seed):
    config = DeepseekV3Config(**cfg_kwargs)
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = DeepseekV3ForCausalLM(config).eval()
    randomize(model, seed)
    return model


def load(path):
    model = DeepseekV3ForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()
    return model


def router_margins(model, ids):
    """Smallest margin of any router decision (group top-k, expert top-k) over a forward of `ids`."""
    margins = []

    def hook(module, args, _out):
        x = args[0].reshape(-1, module.hidden_dim).float()
        scores = torch.nn.functional.linear(x, module.weight.float()).sigmoid()
        choice = scores + module.e_score_correction_bias
        per = module.num_experts // module.num_group
        if module.num_group > 1:
            group = choice.view(-1, module.num_group, per).topk(2, dim=-1)[0].sum(-1)
            s = group.sort(dim=-1, descending=True)[0]
            margins.append((s[:, module.topk_group - 1] - s[:, module.topk_group]).min().item())
            keep = torch.zeros_like(group).scatter_(1, group.topk(module.topk_group, dim=-1)[1], 1)
            mask = keep.unsqueeze(-1).expand(-1, module.num_group, per).reshape(-1, module.num_experts)
            choice = choice.masked_fill(~mask.bool(), float("-inf"))
        s = choice.sort(dim=-1, descending=True)[0]
        margins.append((s[:, module.top_k - 1] - s[:, module.top_k]).min().item())

    handles = [m.register_forward_hook(hook) for m in model.modules() if type(m).__name__ == "DeepseekV3TopkRouter"]
    with torch.no_grad():
        model(torch.tensor([ids]))
    for h in handles:
        h.remove()
    return min(margins)


def reference(model):
    """Logits, hidden states and greedy tokens for each prompt, with robustness checks."""
    out = {}
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    for p, ids in enumerate(PROMPTS):
        x = torch.tensor([ids])
        with torch.no_grad():
            res = model(x, output_hidden_states=True)
            gen = model.generate(x, do_sample=False, max_new_tokens=NEW_TOKENS, min_new_tokens=0)
        assert gen.shape == (1, len(ids) + NEW_TOKENS), gen.shape
        greedy = gen[0, len(ids) :].clone()
        assert len(res.hidden_states) == model.config.num_hidden_layers + 1
        out[f"tokens.{p}"] = x[0].clone()
        out[f"logits.{p}"] = res.logits[0].contiguous()
        for i, h in enumerate(res.hidden_states):
            out[f"hidden.{p}.{i}"] = h[0].contiguous()
        out[f"greedy.{p}"] = greedy
        # Self-consistency (the full forward's argmax is the greedy choice) and margins.
        with torch.no_grad():
            full = model(gen).logits[0, len(ids) - 1 : -1]
        top = full.topk(2, dim=-1)[0]
        gap = (top[:, 0] - top[:, 1]).min().item()
        assert torch.equal(full.argmax(-1), greedy), f"prompt {p}: generate disagrees with the full forward"
        if gap < MIN_MARGIN:
            raise MarginError(f"prompt {p}: greedy top-1/top-2 gap {gap:.2e} too small")
        rm = router_margins(model, gen[0].tolist())
        if rm < MIN_MARGIN:
            raise MarginError(f"prompt {p}: router margin {rm:.2e} too small")
        print(f"    prompt {p}: {len(ids)} tokens, min greedy gap {gap:.4f}, min router margin {rm:.4f}")
    return out


def save_reference(ref, path):
    save_file({k: v.contiguous() for k, v in ref.items()}, os.path.join(path, "reference.safetensors"))


def write_index(path, shards):
    weight_map = {}
    total = 0
    for fname, tensors in shards.items():
        save_file(tensors, os.path.join(path, fname), metadata={"format": "pt"})
        weight_map.update({k: fname for k in tensors})
        total += sum(t.numel() * t.element_size() for t in tensors.values())
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
        json.dump(index, f, indent=2, sort_keys=True)
        f.write("\n")


def index_single_file(path):
    """An index for a one-file checkpoint: without one, readers treat every *.safetensors in the directory
    (including reference.safetensors) as a shard."""
    tensors = load_file(os.path.join(path, "model.safetensors"))
    os.remove(os.path.join(path, "model.safetensors"))
    write_index(path, {"model.safetensors": tensors})


def read_checkpoint(path):
    tensors = {}
    for f in sorted(os.listdir(path)):
        if f.endswith(".safetensors") and f != "reference.safetensors":
            tensors.update(load_file(os.path.join(path, f)))
    return tensors


def write_config(path, config):
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f, indent=2, sort_keys=True)
        f.write("\n")


def fresh(name):
    path = os.path.join(OUT_DIR, name)
    shutil.rmtree(path, ignore_errors=True)
    os.makedirs(path)
    return path


def first_robust_seed(cfg_kwargs, seeds, extra_check=None):
    """The first seed whose model passes the margin checks of `reference` (and `extra_check(tmp)`, which may raise
    MarginError too): a deterministic search. Returns the saved checkpoint's temp dir, the reference and the extra
    check's result."""
    for seed in seeds:
        model = build(cfg_kwargs, seed)
        tmp = tempfile.mkdtemp()
        model.save_pretrained(tmp)
        try:
            ref = reference(load(tmp))
            extra = extra_check(tmp) if extra_check else None
        except MarginError as e:
            print(f"    seed {seed} rejected: {e}")
            shutil.rmtree(tmp)
            continue
        print(f"    seed {seed}")
        return tmp, ref, extra
    raise RuntimeError("no robust seed found")


def int4_variant(tmp):
    """The INT4-experts checkpoint and its HF reference, for the model saved in `tmp`."""
    state = read_checkpoint(tmp)
    with open(os.path.join(tmp, "config.json")) as f:
        config = json.load(f)
    compressed, decompressed, compressor = quantize_experts(state)
    dense = {k: v for k, v in state.items() if ".mlp.experts." not in k}
    # HF reference on the decompressed weights.
    with tempfile.TemporaryDirectory() as dec:
        save_file({**dense, **decompressed}, os.path.join(dec, "model.safetensors"), metadata={"format": "pt"})
        write_config(dec, config)
        ref = reference(load(dec))
    return {**dense, **compressed}, compressor, ref


def make_yarn_qlora_and_int4():
    print("yarn_qlora (+ int4_experts)")
    tmp, ref, (int4_state, compressor, int4_ref) = first_robust_seed(YARN_QLORA, range(1, 100), int4_variant)
    state = read_checkpoint(tmp)
    with open(os.path.join(tmp, "config.json")) as f:
        config = json.load(f)
    shutil.rmtree(tmp)

    path = fresh("yarn_qlora")
    # A fake DeepSeek MTP layer (num_nextn_predict_layers 1) that loaders must skip; HF ignores it too.
    gen = torch.Generator().manual_seed(7)
    mtp = {
        "model.layers.3.enorm.weight": torch.randn(64, generator=gen),
        "model.layers.3.hnorm.weight": torch.randn(64, generator=gen),
        "model.layers.3.eh_proj.weight": torch.randn(64, 128, generator=gen),
    }
    # Three shards by layer, as real checkpoints are split; the MTP layer goes into the last.
    shards = {f"model-0000{i}-of-00003.safetensors": {} for i in (1, 2, 3)}
    names = list(shards)
    for k, v in {**state, **mtp}.items():
        shard = 0 if not k.startswith("model.layers.") else min(int(k.split(".")[2]), 2)
        shards[names[shard]][k] = v.contiguous()
    write_index(path, shards)
    write_config(path, config)
    save_reference(ref, path)

    path = fresh("int4_experts")
    save_file(int4_state, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    cfg = dict(config)
    cfg["num_nextn_predict_layers"] = 0
    write_config(path, cfg)
    compressor.update_config(path)
    with open(os.path.join(path, "config.json")) as f:
        cfg = json.load(f)
    write_config(path, cfg)
    index_single_file(path)
    save_reference(int4_ref, path)
    return state, config, ref


def make_v2lite():
    print("v2lite")
    path = fresh("v2lite")
    tmp, ref, _ = first_robust_seed(V2LITE, range(100, 200))
    for f in ("config.json", "model.safetensors"):
        shutil.copy(os.path.join(tmp, f), path)
    shutil.rmtree(tmp)
    index_single_file(path)
    save_reference(ref, path)


def quantize_experts(state):
    """Quantizes every routed expert of a per-expert state dict with compressed-tensors; returns the compressed
    tensors of the quantized modules, the decompressed weights (f32) and the compressor."""
    linears = sorted({k[: -len(".weight")] for k, v in state.items() if k.endswith(".weight") and v.dim() == 2})
    linears = [n for n in linears if not n.endswith(".mlp.gate") and "embed_tokens" not in n]
    root = torch.nn.Module()
    for name in linears:
        parent = root
        parts = name.split(".")
        for part in parts[:-1]:
            if not hasattr(parent, part):
                parent.add_module(part, torch.nn.Module())
            parent = getattr(parent, part)
        w = state[f"{name}.weight"]
        # Experts as Kimi ships them before quantization (bf16); the rest stays f32 and is ignored anyway.
        dtype = torch.bfloat16 if ".mlp.experts." in name else torch.float32
        lin = torch.nn.Linear(w.shape[1], w.shape[0], bias=False, dtype=dtype)
        lin.weight.data = w.to(dtype)
        parent.add_module(parts[-1], lin)
    weights = QuantizationArgs(
        num_bits=4, type="int", symmetric=True, strategy="group", group_size=32, dynamic=False, observer="minmax"
    )
    qconfig = QuantizationConfig(
        config_groups={"group_0": QuantizationScheme(targets=["Linear"], weights=weights)},
        format="pack-quantized",
        ignore=KIMI_IGNORE,
    )
    apply_quantization_config(root, qconfig, show_progress=False)
    quantized = sorted(n for n, m in root.named_modules() if hasattr(m, "quantization_scheme"))
    assert quantized == sorted(n for n in linears if ".mlp.experts." in n), quantized
    for name in quantized:
        module = root.get_submodule(name)
        scale, zp = compute_dynamic_scales_and_zp(module.weight.data, module.quantization_scheme.weights, module)
        module.weight_scale.data.copy_(scale)
        module.weight_zero_point.data.copy_(zp)
    compressor = ModelCompressor(quantization_config=qconfig, force_compression_format="pack-quantized")
    compressor.compress_model(root)
    compressed = {k: v.detach().clone().contiguous() for k, v in root.state_dict().items()}
    decompressed = {}
    for name in quantized:
        local = {k[len(name) + 1 :]: v for k, v in compressed.items() if k.startswith(name + ".")}
        assert "weight_packed" in local and "weight" not in local, sorted(local)
        w = PackedQuantizationCompressor.decompress(local, root.get_submodule(name).quantization_scheme)["weight"]
        assert w.dtype == torch.bfloat16
        decompressed[f"{name}.weight"] = w.float().contiguous()
    compressed = {k: v for k, v in compressed.items() if any(k.startswith(n + ".") for n in quantized)}
    return compressed, decompressed, compressor


def make_kimi_k25(state, config, ref):
    print("kimi_k25")
    path = fresh("kimi_k25")
    renamed = {}
    for k, v in state.items():
        renamed[f"language_model.{k}"] = v
    gen = torch.Generator().manual_seed(25)
    renamed["vision_tower.patch_embed.proj.weight"] = torch.randn(8, 3, 2, 2, generator=gen)
    renamed["vision_tower.encoder.blocks.0.norm0.weight"] = torch.randn(8, generator=gen)
    renamed["mm_projector.proj.0.weight"] = torch.randn(64, 32, generator=gen)
    save_file(renamed, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    # Keys a published Kimi config has (no HF-derived head_dim / qk_head_dim, rope_interleave left to its default).
    dropped = ("rope_parameters", "architectures", "dtype", "head_dim", "qk_head_dim", "rope_interleave")
    text = {k: v for k, v in config.items() if k not in dropped}
    rp = dict(config["rope_parameters"])
    text["rope_theta"] = rp.pop("rope_theta")
    rp.pop("rope_type", None)
    text["rope_scaling"] = rp
    text["model_type"] = "kimi_k2"
    text["num_nextn_predict_layers"] = 0
    text["torch_dtype"] = "float32"
    k25 = {
        "architectures": ["KimiK25ForConditionalGeneration"],
        "auto_map": {
            "AutoConfig": "configuration_kimi_k25.KimiK25Config",
            "AutoModel": "modeling_kimi_k25.KimiK25ForConditionalGeneration",
        },
        "model_type": "kimi_k25",
        "media_placeholder_token_id": 250,
        "pad_token_id": 0,
        "text_config": text,
        "vision_config": {"mm_hidden_size": 32, "text_hidden_size": 64, "vt_hidden_size": 8, "patch_size": 2},
        "torch_dtype": "float32",
        "transformers_version": transformers.__version__,
    }
    write_config(path, k25)
    index_single_file(path)
    save_reference(ref, path)


def main():
    torch.use_deterministic_algorithms(True)
    torch.set_num_threads(1)
    os.makedirs(OUT_DIR, exist_ok=True)
    state, config, ref = make_yarn_qlora_and_int4()
    make_v2lite()
    make_kimi_k25(state, config, ref)

    print(
        f"transformers {transformers.__version__}, torch {torch.__version__}, "
        f"compressed-tensors {compressed_tensors.__version__}, python {sys.version.split()[0]}"
    )
    grand = 0
    for name in sorted(os.listdir(OUT_DIR)):
        size = sum(os.path.getsize(os.path.join(OUT_DIR, name, f)) for f in os.listdir(os.path.join(OUT_DIR, name)))
        grand += size
        print(f"  {name:14s} {size:9d} bytes")
    print(f"  {'total':14s} {grand:9d} bytes")
    assert grand < 10 * 1024 * 1024, "model fixtures must stay under 10 MB"


if __name__ == "__main__":
    main()
