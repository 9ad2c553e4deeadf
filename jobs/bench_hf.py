"""transformers' own ``generate()`` as jobs.bench's baseline rows (hf, hf-assisted, hf-prompt-lookup): the same
checkpoint in the target's dtype, plain, assisted by the draft LM, and with prompt lookup."""
from __future__ import annotations

import torch

# transformers' own generate() as a baseline: method -> the extra generate() arguments it runs with
HF_METHODS = {
    "hf": lambda runner: {},
    "hf-assisted": lambda runner: {"assistant_model": runner.draft},
    "hf-prompt-lookup": lambda runner: {"prompt_lookup_num_tokens": runner.num_lookup},
}


class HFRunner:
    """transformers generate() on the same checkpoint: plain, assisted by the draft LM, and prompt lookup."""

    def __init__(self, target_path: str, draft_path: str | None, num_lookup: int,
                 dtype: torch.dtype = torch.float32) -> None:
        from transformers import AutoModelForCausalLM

        # the target's own dtype: eyas and transformers are compared on the same arithmetic
        self.model = AutoModelForCausalLM.from_pretrained(target_path, dtype=dtype).eval()
        self.draft = (AutoModelForCausalLM.from_pretrained(draft_path, dtype=dtype).eval()
                      if draft_path else None)
        self.num_lookup = num_lookup

    @torch.inference_mode()
    def run(self, method: str, prompt_ids: list[int], max_new_tokens: int, eos: list[int]) -> int:
        extra = HF_METHODS[method](self)
        input_ids = torch.tensor([prompt_ids])
        out = self.model.generate(input_ids, attention_mask=torch.ones_like(input_ids), do_sample=False,
                                  max_new_tokens=max_new_tokens, eos_token_id=eos or None,
                                  pad_token_id=eos[0] if eos else 0, **extra)
        return out.shape[1] - input_ids.shape[1]
