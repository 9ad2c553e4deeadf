"""Run by test_speculators_thirdparty.py in a subprocess where speculators 0.9.0 imports (its transformers pin
conflicts with eyas's): the tool folder first on PYTHONPATH, or EYAS_SPECULATORS_PYTHON. speculators' own classes
load eyas's exports with from_pretrained, and their draft logits must equal eyas's (saved by the test) within 1e-4
in float32. Usage: python speculators_check.py DIR"""
import sys
import speculators
import speculators.version
import torch
import transformers
from speculators.models.eagle3.core import Eagle3DraftModel
from speculators.models.dflash.core import DFlashDraftModel
from speculators.models.peagle.core import PEagleDraftModel
from speculators.models.attention import create_float_mask


def eager(model):
    """CPU: eager attention (flex attention needs a compiled BlockMask); the layers read the config at run time."""
    model.config.transformer_layer_config._attn_implementation = "eager"
    model._attn_impl, model._create_mask_fn = "eager", create_float_mask
    return model


print(f"speculators {speculators.version.version} ({speculators.__file__}), transformers {transformers.__version__}, "
      f"torch {torch.__version__}")
assert speculators.version.version == "0.9.0", "the check is written against speculators 0.9.0"
root = sys.argv[1]
torch.manual_seed(0)
# ---- EAGLE-3 and EAGLE-3.1 ---------------------------------------------------------------------------------
def fused(m, hidden):
    """fc over the taps, after speculators' per-tap fc_norm where the config has one (EAGLE-3.1)."""
    if m.fc_norm is not None:
        hidden = torch.cat([norm(c) for norm, c in zip(m.fc_norm, hidden.chunk(len(m.fc_norm), -1))], -1)
    return m.fc(hidden)


def causal_logits(m, ids, hidden_states):
    """speculators' layers over (embed(ids), fused states) with a causal mask; logits read through its norm."""
    T = ids.shape[1]
    x = torch.cat([m.embed_tokens(ids), hidden_states], -1)
    pos = torch.arange(T)[None]
    pe = m.rotary_emb(x, pos)
    mask = torch.full((T, T), float("-inf")).triu(1)[None, None]
    for layer in m.layers:
        x = layer(x, attention_mask=mask, position_ids=pos, position_embeddings=pe)
    return m.lm_head(m.norm(x))


for kind, flags in (("eagle3", False), ("eagle3.1", True)):
    m = eager(Eagle3DraftModel.from_pretrained(f"{root}/{kind}")).float().eval()
    print(kind, "class", type(m).__name__, "aux ids", m.config.eagle_aux_hidden_state_layer_ids, "fc_norm",
          m.config.fc_norm, "norm_output", m.config.norm_output)
    assert m.config.fc_norm == flags and m.config.norm_output == flags and (m.fc_norm is not None) == flags
    assert not any(torch.isnan(p).any() for p in m.state_dict().values() if p.is_floating_point()), "NaN weights left"
    data = torch.load(f"{root}/{kind}.pt")
    with torch.no_grad():
        logits = causal_logits(m, data["ids"], fused(m, data["hidden"].float()))
        # and through its own forward (ttt_steps=1; default positions 1 + arange, a uniform shift RoPE ignores)
        draft = m(data["hidden"].float(), data["ids"], torch.zeros_like(data["ids"]), ttt_steps=1)
    diff = (logits - data["logits"]).abs().max().item()
    same_argmax = torch.equal(draft[0], data["logits"].argmax(-1))
    print(f"{kind} max |speculators - eyas| logits = {diff:.3e}; forward() argmax equal: {same_argmax}; "
          f"d2t buffer equal to offsets: {m.d2t[:5].tolist()}")
    assert diff < 1e-4 and same_argmax
# ---- P-EAGLE: the prefix entries, then depths - 1 entries of (mask token, mask_hidden), in one causal pass ---------
p = eager(PEagleDraftModel.from_pretrained(f"{root}/peagle")).float().eval()
data = torch.load(f"{root}/peagle.pt")
K, n = data["depths"], data["ids"].shape[1]
print("peagle class", type(p).__name__, "layers", len(p.layers), "mask id", p.mask_token_id, "mask_hidden",
      tuple(p.mask_hidden.shape))
assert len(p.layers) == 2 and p.mask_hidden.shape == (1, 1, data["hidden"].shape[-1])
with torch.no_grad():
    hidden = torch.cat([data["hidden"].float(), p.mask_hidden.float().expand(1, K - 1, -1)], 1)
    ids = torch.cat([data["ids"], torch.full((1, K - 1), p.mask_token_id)], 1)
    logits = causal_logits(p, ids, p.fc(hidden))[0, n - 1:]
diff = (logits - data["logits"]).abs().max().item()
print(f"peagle max |speculators - eyas| logits = {diff:.3e} over {tuple(logits.shape)} (one pass, {K} depths)")
assert diff < 1e-4
# ---- DFlash ------------------------------------------------------------------------------------------------
d = eager(DFlashDraftModel.from_pretrained(f"{root}/dflash")).float().eval()
print("dflash class", type(d).__name__, "aux ids", d.config.aux_hidden_state_layer_ids, "mask", d.config.mask_token_id)
assert not any(torch.isnan(p).any() for n, p in d.state_dict().items() if p.is_floating_point()), "NaN weights left"
data = torch.load(f"{root}/dflash.pt")
C, G = data["context_len"], d.block_size
with torch.no_grad():
    ctx = d.hidden_norm(d.fc(data["features"].float()))
    block = torch.full((1, G), d.mask_token_id); block[0, 0] = data["root"]
    x = d.embed_tokens(block)
    pos = torch.arange(C + G)[None]
    pe = d.rotary_emb(x, pos)
    for layer in d.layers:
        x = layer(hidden_states=x, target_hidden=ctx, attention_mask=None, position_ids=pos, use_cache=False,
                  position_embeddings=pe)
    logits = d.lm_head(d.norm(x))[0, 1:]
diff = (logits - data["logits"][0, 1:]).abs().max().item()
print(f"dflash max |speculators - eyas| logits = {diff:.3e} over {tuple(logits.shape)}")
assert diff < 1e-4
print("OK")
