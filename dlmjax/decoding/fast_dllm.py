"""Fast-dLLM v2's decoding (`fast-dllm-v2`), as its model's generate() runs it (NVlabs/Fast-dLLM `v2/`,
Efficient-Large-Model/Fast_dLLM_v2_7B), on its block-causal, shifted-logit model:

- A block whose first position is masked (it starts right after a finished block, or the prompt
  ends on a block boundary) takes that token first, alone, as the argmax of the logits at the
  previous column: generate() gets it autoregressively from the forward that completes (stores)
  the previous block. Here that forward is the one that starts the block (engine: the stored
  block's last hidden state scores position 0), so the token and the forward count agree.
- Then the block's sub-blocks of `sub_block` tokens are decoded in turn: each step forwards the
  whole block and commits, in the leftmost sub-block that still has masks, every masked position
  with confidence > `tau`, and always the most confident one.

Block 32 (the model's `bd_size`), sub-blocks of 8, tau 0.9 are its authors' settings (eval.py's
default): the spec `fast-dllm-v2` (`fast-dllm-v2:tau=0.9,sub_block=8`). Their benchmark script
(v2/eval_script.sh) runs gsm8k and minerva_math with threshold 1, one token per forward:
`fast-dllm-v2:tau=1`. Confidence excludes the mask token, as in
every decoder here (generate()'s softmax keeps it). generate()'s stop-token check ends a block
early once the stop token and everything before it are decoded; here the row finishes its block
(the tokens up to the stop token are the same, the forwards can be more). When sampling
(temperature > 0), confidence is the probability of the sampled token under the tempered, top-p
distribution it was drawn from, as generate()'s `sample_with_top_p` gives it (`sampled_scores`;
top_p 0.95 by default, generate()'s);
a block's first position is the argmax at any temperature, as generate() takes it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import jax.numpy as jnp

from dlmjax.decoding import policies
from dlmjax.decoding.spec import DecoderSpecError, DiffusionDecoder, register_decoder
from dlmjax.validation import AT_LEAST_1, OPEN_UNIT


@register_decoder
@dataclass(frozen=True)
class FastDLLMv2(DiffusionDecoder):
    """Fast-dLLM v2 (module docstring): tau (0.9), sub_block (8; must divide the block)."""

    name: ClassVar[str] = "fast-dllm-v2"
    limits = {"tau": OPEN_UNIT, "sub_block": AT_LEAST_1}
    tau: float = 0.9
    sub_block: int = 8
    sampled_scores: bool = True  # sampling: generate() compares tau with the tempered top-p probability
    top_p: float = 0.95  # generate()'s and batch_sample's default nucleus (read when sampling only)

    def scores(self, fwd, state, keys_b) -> policies.Scores:
        """As every decoder's, except that a block's first position takes the argmax (mask
        excluded) when sampling too: generate() takes it autoregressively, greedily, at any
        temperature."""
        scores = super().scores(fwd, state, keys_b)
        if self.temperature == 0.0:
            return scores
        first = fwd.block_scores(state.logits[:, :1], state.hidden[:, :1]).tokens[:, 0]  # the greedy path's argmax
        return scores.replace(tokens=scores.tokens.at[:, 0].set(first))

    def select(self, scores, masked_bk):
        k = masked_bk.shape[1]
        if k % self.sub_block:
            raise DecoderSpecError(f"fast-dllm-v2: sub_block={self.sub_block} does not divide the block {k}; "
                                   f"choose a divisor of {k}")
        sub_k = jnp.arange(k) // self.sub_block
        current = jnp.argmax(masked_bk, axis=-1) // self.sub_block  # the leftmost sub-block with a mask
        in_sub = masked_bk & (sub_k[None, :] == current[:, None])
        chosen = (in_sub & (scores.confidence > self.tau)) | policies.top_k_mask(scores.confidence, in_sub, 1)
        first = masked_bk[:, :1]  # position 0 masked: the autoregressive token, alone
        return jnp.where(first, (jnp.arange(k) == 0)[None, :], chosen) & masked_bk
