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
from speculators.models.dflash2.core import DFlash2DraftModel
from speculators.models.dspark.core import DSparkDraftModel
from speculators.models.peagle.core import PEagleDraftModel
from speculators.models.attention import create_float_mask


def eager(model):
    """CPU: eager attention (flex attention needs a compiled BlockMask); the layers read the config at run time."""
    model.config.transformer_layer_config._attn_implementation = "eager"
    model._attn_impl, model._create_mask_fn = "eager", create_float_mask
    return model


def load(cls, kind):
    """(speculators' ``cls`` loaded from ROOT/KIND in float32, eager, what eyas computed with it: ROOT/KIND.pt)"""
    return eager(cls.from_pretrained(f"{root}/{kind}")).float().eval(), torch.load(f"{root}/{kind}.pt")


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
    m, data = load(Eagle3DraftModel, kind)
    print(kind, "class", type(m).__name__, "aux ids", m.config.eagle_aux_hidden_state_layer_ids, "fc_norm",
          m.config.fc_norm, "norm_output", m.config.norm_output)
    assert m.config.fc_norm == flags and m.config.norm_output == flags and (m.fc_norm is not None) == flags
    assert not any(torch.isnan(p).any() for p in m.state_dict().values() if p.is_floating_point()), "NaN weights left"
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
p, data = load(PEagleDraftModel, "peagle")
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


def block_states(m, data):
    """speculators' backbone over [root, MASK x (G-1)] after the context: its final-normed states [G, E]."""
    C, G = data["context_len"], m.block_size
    ctx = m.hidden_norm(m.fc(data["features"].float()))
    block = torch.full((1, G), m.mask_token_id); block[0, 0] = data["root"]
    x = m.embed_tokens(block)
    pos = torch.arange(C + G)[None]
    pe = m.rotary_emb(x, pos)
    for layer in m.layers:
        x = layer(hidden_states=x, target_hidden=ctx, attention_mask=None, position_ids=pos, use_cache=False,
                  position_embeddings=pe)
    return m.norm(x)[0]


# ---- DFlash ------------------------------------------------------------------------------------------------
d, data = load(DFlashDraftModel, "dflash")
print("dflash class", type(d).__name__, "aux ids", d.config.aux_hidden_state_layer_ids, "mask", d.config.mask_token_id)
assert not any(torch.isnan(p).any() for n, p in d.state_dict().items() if p.is_floating_point()), "NaN weights left"
with torch.no_grad():
    logits = d.lm_head(block_states(d, data)[1:])
diff = (logits - data["logits"][0, 1:]).abs().max().item()
print(f"dflash max |speculators - eyas| logits = {diff:.3e} over {tuple(logits.shape)}")
assert diff < 1e-4


# ---- DSpark: every slot drafts; the Markov bias of the token before it; the confidence of [hidden ; w1(prev)] --
s, data = load(DSparkDraftModel, "dspark")
print("dspark class", type(s).__name__, "markov", s.config.markov_rank, s.config.markov_head_type, "from anchor",
      s.config.sample_from_anchor, "confidence", s.confidence_head is not None)
assert s.config.sample_from_anchor and s.confidence_head is not None
with torch.no_grad():
    hidden = block_states(s, data)  # [G, E]: slot k drafts the token at anchor + k + 1
    prev = torch.tensor([data["root"], *data["tokens"][:-1]])[None]  # the anchor, then each drafted token
    emb = s.markov_head.prev_embeddings(prev)
    logits = (s.lm_head(hidden)[None] + s.markov_head.block_bias(prev_token_ids=prev, hidden_states=hidden[None],
                                                                 prev_emb=emb))[0]
    confidence = s.confidence_head(torch.cat([hidden[None], emb], -1)).sigmoid()[0]
diff = (logits.softmax(-1) - data["probs"]).abs().max().item()
conf_diff = (confidence - data["confidence"]).abs().max().item()
unary_diff = (s.lm_head(hidden) - data["unary"]).abs().max().item()
print(f"dspark max |speculators - eyas| backbone logits = {unary_diff:.3e}, walk probs = {diff:.3e}, "
      f"confidence = {conf_diff:.3e}; tokens {logits.argmax(-1).tolist()} vs eyas {data['tokens']}")
assert unary_diff < 1e-4 and diff < 1e-5 and conf_diff < 1e-5 and logits.argmax(-1).tolist() == data["tokens"]
# ---- DFlash2: the dynamic convolutions in the backbone; the selector over the unary top-k after each drafted token ---
f, data = load(DFlash2DraftModel, "dflash2")
print("dflash2 class", type(f).__name__, "conv", f.config.conv_kernel_size, f.config.conv_group_size, "selector",
      f.config.selector_rank, f.config.selector_top_k)
with torch.no_grad():
    hidden = block_states(f, data)[1:]  # slots 1..G-1 draft
    unary = f.lm_head(hidden)
    prev = torch.tensor([data["root"], *data["tokens"][:-1]])
    candidates, scores = f.candidate_selector.select(unary, hidden, prev)
    picks = candidates.gather(-1, scores.argmax(-1, keepdim=True))[:, 0]
    probs = torch.zeros_like(unary).scatter(-1, candidates, scores.softmax(-1))
unary_diff = (unary - data["unary"][1:]).abs().max().item()
diff = (probs - data["probs"]).abs().max().item()
print(f"dflash2 max |speculators - eyas| unary logits = {unary_diff:.3e}, selector probs = {diff:.3e}; tokens "
      f"{picks.tolist()} vs eyas {data['tokens']}")
assert unary_diff < 1e-4 and diff < 1e-5 and picks.tolist() == data["tokens"]
print("OK")
