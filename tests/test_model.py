"""The drafter: config, shapes, KV injection, block independence, reference forward,
and loading the target's embedding / LM head without building the target."""

import json

import pytest
import torch
import torch.nn.functional as F

from dflash.train import attention, model
from dflash.train.model import DFlashDrafter, DrafterConfig


def tiny_config(**over):
    kw = dict(
        hidden_size=32,
        intermediate_size=48,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        vocab_size=50,
        target_layer_ids=[0, 1, 2],
        num_target_layers=4,
        mask_token_id=49,
        num_hidden_layers=2,
        block_size=4,
        rope_theta=10000.0,
    )
    kw.update(over)
    return DrafterConfig(**kw)


def make_inputs(cfg, anchors, block_valid, ctx_len, S, seed=0):
    gen = torch.Generator().manual_seed(seed)
    bsz, n_blocks = anchors.shape
    B = cfg.block_size
    q_len = n_blocks * B
    context = torch.randn(bsz, S, cfg.num_context_layers * cfg.hidden_size, generator=gen)
    embeds = torch.randn(bsz, q_len, cfg.hidden_size, generator=gen)
    ctx_pos = torch.arange(S)
    blk_pos = (anchors[..., None] + torch.arange(B)).reshape(bsz, q_len)
    mask = attention.dense_mask(anchors, block_valid, ctx_len, S, B)
    return context, ctx_pos, embeds, blk_pos, mask


@pytest.fixture
def drafter():
    torch.manual_seed(0)
    return DFlashDrafter(tiny_config()).eval()


def default_case():
    anchors = torch.tensor([[2, 3, 9], [0, 5, 0]])  # 2 and 3 are closer than B=4
    valid = torch.tensor([[True, True, True], [True, True, False]])
    ctx_len = torch.tensor([12, 10])
    return anchors, valid, ctx_len, 12


# ---------------------------------------------------------------------------- config


def qwen3_config(**over):
    from transformers import Qwen3Config

    kw = dict(
        hidden_size=64, intermediate_size=96, num_hidden_layers=6, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, vocab_size=300, rope_theta=123456.0,
        max_position_embeddings=2048, rms_norm_eps=1e-5,
    )
    kw.update(over)
    return Qwen3Config(**kw)


@pytest.mark.parametrize("as_dict", [False, True])
def test_config_from_target_config(as_dict):
    hf = qwen3_config()
    src = hf.to_dict() if as_dict else hf
    cfg = DrafterConfig.from_target_config(src, [1, 3], mask_token_id=299, block_size=8, num_hidden_layers=3)
    assert (cfg.hidden_size, cfg.intermediate_size, cfg.num_attention_heads) == (64, 96, 4)
    assert (cfg.num_key_value_heads, cfg.head_dim, cfg.vocab_size) == (2, 16, 300)
    assert cfg.num_target_layers == 6 and cfg.num_hidden_layers == 3 and cfg.block_size == 8
    assert cfg.rope_theta == 123456.0 and cfg.rms_norm_eps == 1e-5
    assert cfg.max_position_embeddings == 2048 and cfg.target_layer_ids == [1, 3]
    assert DrafterConfig.from_dict(json.loads(json.dumps(cfg.to_dict()))) == cfg


def test_config_validation():
    hf = qwen3_config()
    with pytest.raises(ValueError, match="mask_token_id"):
        DrafterConfig.from_target_config(hf, [1], mask_token_id=300)
    with pytest.raises(ValueError, match="mask_token_id"):
        DrafterConfig.from_target_config(hf, [1], mask_token_id=-1)
    with pytest.raises(ValueError, match="outside 0..5"):
        DrafterConfig.from_target_config(hf, [1, 6], mask_token_id=5)
    with pytest.raises(ValueError, match="outside 0..5"):
        DrafterConfig.from_target_config(hf, [-1], mask_token_id=5)
    with pytest.raises(ValueError, match="unknown"):
        DrafterConfig.from_dict({**tiny_config().to_dict(), "hidden_sise": 3})


@pytest.mark.parametrize("ids,needle", [([1, 5], r"5 is the last layer \(L-1\)"), ([3, 1], "not in ascending order"),
                                        ([1, 1, 2], r"\[1\] repeated")])
def test_config_refuses_layers_serving_engines_cannot_feed(ids, needle):
    """The 6-layer target's id 5 has no capture point in SGLang or vLLM, and both concatenate
    layers in ascending order: the error says so, also when loading a saved config."""
    with pytest.raises(ValueError, match=needle) as info:
        DrafterConfig.from_target_config(qwen3_config(), ids, mask_token_id=5)
    assert "input of decoder layer i + 1" in str(info.value)
    saved = {**tiny_config().to_dict(), "target_layer_ids": [0, 3]}
    with pytest.raises(ValueError, match="last layer"):
        DrafterConfig.from_dict(saved)


# ---------------------------------------------------------------------------- structure


def expected_names(cfg):
    names = {"fc.weight", "hidden_norm.weight", "norm.weight"}
    for i in range(cfg.num_hidden_layers):
        p = f"layers.{i}."
        names |= {p + f"self_attn.{n}_proj.weight" for n in "qkvo"}
        names |= {p + "self_attn.q_norm.weight", p + "self_attn.k_norm.weight"}
        names |= {p + "input_layernorm.weight", p + "post_attention_layernorm.weight"}
        names |= {p + f"mlp.{n}_proj.weight" for n in ("gate", "up", "down")}
    return names


def test_state_dict_names_and_shapes(drafter):
    cfg = drafter.config
    sd = drafter.state_dict()
    assert set(sd) == expected_names(cfg)
    D, hd = cfg.hidden_size, cfg.head_dim
    assert sd["fc.weight"].shape == (D, 3 * D)
    assert sd["layers.0.self_attn.q_proj.weight"].shape == (4 * hd, D)
    assert sd["layers.0.self_attn.k_proj.weight"].shape == (2 * hd, D)
    assert sd["layers.0.self_attn.o_proj.weight"].shape == (D, 4 * hd)
    assert sd["layers.1.self_attn.k_norm.weight"].shape == (hd,)
    assert sd["layers.1.mlp.down_proj.weight"].shape == (D, cfg.intermediate_size)


def test_forward_shape_and_context_width(drafter):
    cfg = drafter.config
    anchors, valid, ctx_len, S = default_case()
    context, ctx_pos, embeds, blk_pos, mask = make_inputs(cfg, anchors, valid, ctx_len, S)
    out = drafter(context, ctx_pos, embeds, blk_pos, mask)
    assert out.shape == (2, 3 * cfg.block_size, cfg.hidden_size)
    with pytest.raises(ValueError, match="features"):
        drafter(context[..., :-1], ctx_pos, embeds, blk_pos, mask)


def test_context_enters_only_through_k_and_v(drafter):
    cfg = drafter.config
    anchors, valid, ctx_len, S = default_case()
    inputs = make_inputs(cfg, anchors, valid, ctx_len, S)
    seen = {}

    def hook(name):
        def fn(module, args, output):
            seen.setdefault(name, set()).add(args[0].shape[1])
        return fn

    layer = drafter.layers[0]
    handles = [
        layer.self_attn.q_proj.register_forward_hook(hook("q")),
        layer.self_attn.k_proj.register_forward_hook(hook("k")),
        layer.self_attn.o_proj.register_forward_hook(hook("o")),
        layer.mlp.gate_proj.register_forward_hook(hook("mlp")),
    ]
    drafter(*inputs)
    for h in handles:
        h.remove()
    Q = anchors.shape[1] * cfg.block_size
    assert seen["q"] == {Q} and seen["o"] == {Q} and seen["mlp"] == {Q}
    assert seen["k"] == {S + Q}


def test_fully_masked_context_is_ignored(drafter):
    cfg = drafter.config
    anchors = torch.zeros(2, 3, dtype=torch.long)  # anchor 0: no context is visible
    valid = torch.ones(2, 3, dtype=torch.bool)
    context, ctx_pos, embeds, blk_pos, mask = make_inputs(cfg, anchors, valid, torch.tensor([12, 12]), 12)
    out = drafter(context, ctx_pos, embeds, blk_pos, mask)
    out2 = drafter(context + 5 * torch.randn_like(context), ctx_pos, embeds, blk_pos, mask)
    assert torch.equal(out, out2)


def test_context_at_or_after_anchor_is_invisible(drafter):
    cfg = drafter.config
    B = cfg.block_size
    anchors, valid, ctx_len, S = default_case()
    context, ctx_pos, embeds, blk_pos, mask = make_inputs(cfg, anchors, valid, ctx_len, S)
    out = drafter(context, ctx_pos, embeds, blk_pos, mask)
    pos = 3  # blocks anchored at <= 3 must not move; blocks anchored later must
    bumped = context.clone()
    bumped[:, pos] += 3.0
    out2 = drafter(bumped, ctx_pos, embeds, blk_pos, mask)
    for b in range(2):
        for blk in range(3):
            if not valid[b, blk]:
                continue
            sl = slice(blk * B, (blk + 1) * B)
            same = torch.equal(out[b, sl], out2[b, sl])
            assert same == (int(anchors[b, blk]) <= pos), (b, blk)


def test_blocks_are_independent(drafter):
    cfg = drafter.config
    B = cfg.block_size
    anchors, valid, ctx_len, S = default_case()
    context, ctx_pos, embeds, blk_pos, mask = make_inputs(cfg, anchors, valid, ctx_len, S)
    out = drafter(context, ctx_pos, embeds, blk_pos, mask)
    changed = embeds.clone()
    changed[0, B : 2 * B] = torch.randn(B, cfg.hidden_size)  # block 1 (anchor 3) of row 0
    out2 = drafter(context, ctx_pos, changed, blk_pos, mask)
    assert torch.equal(out[0, :B], out2[0, :B])  # anchor 2, overlapping positions
    assert torch.equal(out[0, 2 * B :], out2[0, 2 * B :])
    assert torch.equal(out[1], out2[1])
    assert not torch.allclose(out[0, B : 2 * B], out2[0, B : 2 * B])


def test_dense_and_flex_forward_agree(drafter):
    cfg = drafter.config
    anchors, valid, ctx_len, S = default_case()
    context, ctx_pos, embeds, blk_pos, dense = make_inputs(cfg, anchors, valid, ctx_len, S)
    attention.allow_uncompiled_flex(True)
    try:
        block_mask = attention.build_mask("flex", anchors, valid, ctx_len, S, cfg.block_size)
        with torch.no_grad():  # flex has no CPU backward, even a graph is refused
            out_flex = drafter(context, ctx_pos, embeds, blk_pos, block_mask)
    finally:
        attention.allow_uncompiled_flex(False)
    out_dense = drafter(context, ctx_pos, embeds, blk_pos, dense)
    valid_rows = valid.repeat_interleave(cfg.block_size, dim=1)
    torch.testing.assert_close(out_flex[valid_rows], out_dense[valid_rows], atol=1e-5, rtol=1e-5)


def test_backward_on_cpu_dense(drafter):
    cfg = drafter.config
    anchors, valid, ctx_len, S = default_case()
    inputs = make_inputs(cfg, anchors, valid, ctx_len, S)
    drafter.train()
    drafter(*inputs).square().mean().backward()
    grads = {n: p.grad for n, p in drafter.named_parameters()}
    assert all(g is not None and torch.isfinite(g).all() for g in grads.values())
    assert grads["fc.weight"].abs().sum() > 0


# ---------------------------------------------------------------------------- reference


def reference_forward(drafter, hf_config, context, ctx_pos, embeds, blk_pos, anchors, valid, ctx_len):
    """float64 DFlash forward written independently: HF's Qwen3 RoPE and RMSNorm, explicit
    per-block attention over [visible context ; own block] (no mask tensor)."""
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RotaryEmbedding, apply_rotary_pos_emb

    cfg = drafter.config
    p = {k: v.double() for k, v in drafter.state_dict().items()}
    rotary = Qwen3RotaryEmbedding(hf_config)
    B, H, Hkv, hd = cfg.block_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim

    def rms(x, w):
        return w * (x / torch.sqrt((x * x).mean(-1, keepdim=True) + cfg.rms_norm_eps))

    bsz, S = context.shape[:2]
    out = torch.zeros(bsz, embeds.shape[1], cfg.hidden_size, dtype=torch.float64)
    for b in range(bsz):
        ctx = rms(context[b].double() @ p["fc.weight"].T, p["hidden_norm.weight"])  # (S, D)
        for blk in range(anchors.shape[1]):
            if not valid[b, blk]:
                continue
            n_vis = min(int(anchors[b, blk]), int(ctx_len[b]))
            sl = slice(blk * B, (blk + 1) * B)
            x = embeds[b, sl].double()
            pos_q = blk_pos[b, sl]
            pos_kv = torch.cat([ctx_pos[:n_vis], pos_q])
            for i in range(cfg.num_hidden_layers):
                lp = lambda n: p[f"layers.{i}.{n}"]
                h = rms(x, lp("input_layernorm.weight"))
                kv_in = torch.cat([ctx[:n_vis], h])
                q = (h @ lp("self_attn.q_proj.weight").T).view(B, H, hd)
                k = (kv_in @ lp("self_attn.k_proj.weight").T).view(-1, Hkv, hd)
                v = (kv_in @ lp("self_attn.v_proj.weight").T).view(-1, Hkv, hd)
                q = rms(q, lp("self_attn.q_norm.weight")).transpose(0, 1)[None]
                k = rms(k, lp("self_attn.k_norm.weight")).transpose(0, 1)[None]
                cos_q, sin_q = rotary(q, pos_q[None])
                cos_k, sin_k = rotary(k, pos_kv[None])
                q, _ = apply_rotary_pos_emb(q, q, cos_q.double(), sin_q.double())
                k, _ = apply_rotary_pos_emb(k, k, cos_k.double(), sin_k.double())
                k = k[0].repeat_interleave(H // Hkv, 0)
                v = v.transpose(0, 1).repeat_interleave(H // Hkv, 0)
                att = torch.softmax(q[0] @ k.transpose(-1, -2) / hd**0.5, -1) @ v  # (H, B, hd)
                x = x + att.transpose(0, 1).reshape(B, H * hd) @ lp("self_attn.o_proj.weight").T
                h = rms(x, lp("post_attention_layernorm.weight"))
                mlp = F.silu(h @ lp("mlp.gate_proj.weight").T) * (h @ lp("mlp.up_proj.weight").T)
                x = x + mlp @ lp("mlp.down_proj.weight").T
            out[b, sl] = rms(x, p["norm.weight"])
    return out


def test_forward_matches_independent_reference():
    from transformers import Qwen3Config

    torch.manual_seed(1)
    cfg = tiny_config()
    drafter = DFlashDrafter(cfg).eval()
    with torch.no_grad():  # non-trivial norm weights so a skipped norm is visible
        for name, param in drafter.named_parameters():
            if "norm" in name:
                param.uniform_(0.5, 1.5)
    hf = Qwen3Config(
        hidden_size=cfg.hidden_size, num_attention_heads=cfg.num_attention_heads,
        num_key_value_heads=cfg.num_key_value_heads, head_dim=cfg.head_dim,
        rope_theta=cfg.rope_theta, max_position_embeddings=cfg.max_position_embeddings,
    )
    anchors, valid, ctx_len, S = default_case()
    context, ctx_pos, embeds, blk_pos, mask = make_inputs(cfg, anchors, valid, ctx_len, S, seed=3)
    ctx_pos = ctx_pos + 100  # positions need not start at 0
    blk_pos = blk_pos + 100
    out = drafter(context, ctx_pos, embeds, blk_pos, mask)
    want = reference_forward(drafter, hf, context, ctx_pos, embeds, blk_pos, anchors, valid, ctx_len)
    rows = valid.repeat_interleave(cfg.block_size, dim=1)
    torch.testing.assert_close(out[rows].double(), want[rows], atol=2e-5, rtol=2e-5)


def test_rope_matches_hf():
    from transformers import Qwen3Config
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RotaryEmbedding

    hf = Qwen3Config(hidden_size=64, num_attention_heads=4, head_dim=16, rope_theta=1e6)
    pos = torch.tensor([[0, 1, 7, 4000, 40000]])
    cos, sin = model.rope_cos_sin(pos, 16, 1e6)
    cos_hf, sin_hf = Qwen3RotaryEmbedding(hf)(torch.zeros(1, dtype=torch.float32), pos)
    torch.testing.assert_close(cos, cos_hf, atol=1e-5, rtol=0)
    torch.testing.assert_close(sin, sin_hf, atol=1e-5, rtol=0)


# ---------------------------------------------------------------------------- target head


def save_tiny_qwen3(path, tied, shard=None):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen3Config(
        hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, vocab_size=128, tie_word_embeddings=tied,
    )
    m = Qwen3ForCausalLM(cfg)
    kwargs = {"max_shard_size": shard} if shard else {}
    m.save_pretrained(path, **kwargs)
    return path


@pytest.mark.parametrize("tied", [False, True])
def test_load_target_head_matches_hf(tmp_path, tied):
    from transformers import AutoModelForCausalLM

    path = save_tiny_qwen3(tmp_path / "target", tied)
    head = model.load_target_head(path)
    ref = AutoModelForCausalLM.from_pretrained(path)
    emb = ref.get_input_embeddings().weight
    torch.testing.assert_close(head.embed_weight, emb, atol=0, rtol=0)
    torch.testing.assert_close(head.weight, ref.lm_head.weight, atol=0, rtol=0)
    assert head.tied == tied
    if not tied:
        assert not torch.equal(head.weight, head.embed_weight)
    ids = torch.tensor([[0, 5, 127]])
    torch.testing.assert_close(head.embed(ids), ref.get_input_embeddings()(ids), atol=0, rtol=0)
    assert not any(t.requires_grad for t in (head.embed_weight, head.weight))
    assert list(head.parameters()) == [] and head.state_dict() == {}
    half = model.load_target_head(path, dtype=torch.bfloat16)
    assert half.weight.dtype == torch.bfloat16


def test_load_target_head_opens_only_needed_shards(tmp_path, monkeypatch):
    import safetensors

    path = save_tiny_qwen3(tmp_path / "sharded", tied=False, shard="40KB")
    index = json.loads((path / "model.safetensors.index.json").read_text())
    files = set(index["weight_map"].values())
    needed = {index["weight_map"]["model.embed_tokens.weight"], index["weight_map"]["lm_head.weight"]}
    assert len(files) > len(needed), "the checkpoint must be sharded for this test"
    opened = []
    real_open = safetensors.safe_open

    def spy(filename, *args, **kwargs):
        opened.append(str(filename).rsplit("/", 1)[-1])
        return real_open(filename, *args, **kwargs)

    monkeypatch.setattr(safetensors, "safe_open", spy)
    head = model.load_target_head(path)
    assert set(opened) == needed
    assert head.weight.shape == (128, 64)
