"""Logits -> next tokens, batched over requests with per-request parameters and no host sync.

Random draws come from a counter-based hash of (request seed, output index, token id) rather than
a stateful generator, so a seeded request draws the same numbers alone or inside any batch, after
a preemption too, and a whole batch samples in a few tensor ops. Sampling is an exponential race:
argmax(p / E) with E ~ Exp(1) picks token i with probability p_i, and needs no normalisation.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

_M32 = 0xFFFFFFFF


def _fmix32(x: Tensor) -> Tensor:
    """MurmurHash3's 32-bit finaliser on int64 tensors of 32-bit values (low bits stay exact)."""
    x = ((x ^ (x >> 16)) * 0x85EBCA6B) & _M32
    x = ((x ^ (x >> 13)) * 0xC2B2AE35) & _M32
    return x ^ (x >> 16)


def uniform_noise(seeds: Tensor, steps: Tensor, vocab_size: int) -> Tensor:
    """[S, V] uniforms in (0, 1), a pure function of (seed, step, token id)."""
    s = (seeds ^ (seeds >> 32)) & _M32
    row = _fmix32(s ^ _fmix32((steps * 0x9E3779B9 + 0x7F4A7C15) & _M32))
    col = (torch.arange(vocab_size, device=seeds.device, dtype=torch.int64) * 0x27D4EB2F) & _M32
    bits = _fmix32(row[:, None] ^ col[None, :])
    # 23 bits: k + 0.5 is exact in float32, so no draw rounds up to 1 (where -log u = 0 would win the race).
    return ((bits >> 9).float() + 0.5) * (1.0 / (1 << 23))


@dataclass
class SamplingMetadata:
    """Per-row sampling parameters of one step ([S] tensors on the logits' device; empty when every row is
    greedy, since the sampler then reads none of them)."""

    temperature: Tensor
    top_k: Tensor  # 0 = disabled
    top_p: Tensor
    min_p: Tensor
    seeds: Tensor  # int64
    steps: Tensor  # int64: output tokens the row already has (the draw's counter)
    all_greedy: bool
    any_top_k: bool
    any_top_p: bool
    any_min_p: bool
    # Penalties (None when no row uses any): [S] factors and [S, V] token statistics.
    presence: Tensor | None = None
    frequency: Tensor | None = None
    repetition: Tensor | None = None
    output_counts: Tensor | None = None  # occurrences of each token in the row's output
    seen_mask: Tensor | None = None  # token occurs in the prompt or the output
    max_num_logprobs: int | None = None  # largest top-N any row asked for
    token_bitmask: Tensor | None = None  # [S, ceil(V / 32)] int32: bit t of row i set iff row i may pick t
    logit_bias: Tensor | None = None  # [S, V] added first: requested biases, -inf on banned tokens


@dataclass
class SamplerOutput:
    token_ids: Tensor  # [S]
    logprobs: Tensor | None = None  # [S] logprob of the sampled token
    topk_ids: Tensor | None = None  # [S, N]
    topk_logprobs: Tensor | None = None  # [S, N]


def apply_penalties(logits: Tensor, m: SamplingMetadata) -> Tensor:
    """Repetition (prompt and output tokens; divides positive logits, multiplies negative ones),
    then frequency and presence (output tokens only), as vLLM and OpenAI define them."""
    rep = m.repetition[:, None]
    logits = torch.where(m.seen_mask, torch.where(logits > 0, logits / rep, logits * rep), logits)
    counts = m.output_counts.to(logits.dtype)
    return logits - m.frequency[:, None] * counts - m.presence[:, None] * (counts > 0).to(logits.dtype)


def filter_probs(probs: Tensor, m: SamplingMetadata) -> Tensor:
    """Zero out what min-p, top-k and top-p exclude (probabilities need not stay normalised)."""
    if m.any_min_p:
        probs = probs.masked_fill(probs < m.min_p[:, None] * probs.amax(-1, keepdim=True), 0.0)
    if m.any_top_k or m.any_top_p:
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        rank = torch.arange(probs.shape[-1], device=probs.device)[None, :]
        drop = torch.zeros_like(sorted_probs, dtype=torch.bool)
        if m.any_top_k:
            k = torch.where(m.top_k > 0, m.top_k, probs.shape[-1])
            drop |= rank >= k[:, None]
        if m.any_top_p:
            # Keep the smallest prefix whose mass reaches top_p: drop a token once the mass before it does.
            before = sorted_probs.cumsum(-1) - sorted_probs
            drop |= before >= m.top_p[:, None] * sorted_probs.sum(-1, keepdim=True)
        probs = probs.scatter(-1, order, sorted_probs.masked_fill(drop, 0.0))
    return probs


def allowed_tokens(bitmask: Tensor, vocab_size: int) -> Tensor:
    """[S, words] int32 -> [S, vocab_size] int32, 1 where allowed: token t is bit t % 32 (lowest first) of
    word t // 32."""
    bits = torch.arange(32, device=bitmask.device, dtype=torch.int32)
    return ((bitmask[:, :, None] >> bits) & 1).flatten(1)[:, :vocab_size]


def verify(drafts: list[int], targets: list[int]) -> list[int]:
    """The tokens a request emits after verifying `drafts` in one step: `targets[i]` is the token sampled at
    draft position i (given the drafts before it, with the draw decoding without drafts makes at that
    output index), so the drafts are kept while each equals its target, and the first target that differs,
    or the one after the last draft, follows them.

    Every emitted token is the one decoding without drafts would have sampled, so greedy and seeded output
    is unchanged and the output distribution is the model's. For drafts without probabilities this is exact
    rejection sampling: a draft d is accepted with probability p(d), and a rejected position's token is the
    draw given it is not d, distributed as p with d removed and renormalised."""
    n = 0
    while n < len(drafts) and drafts[n] == targets[n]:
        n += 1
    return targets[: n + 1]


def sample(logits: Tensor, m: SamplingMetadata) -> SamplerOutput:
    """logits [S, V] float32 -> one token per row; logprobs are of the raw model distribution."""
    out = SamplerOutput(token_ids=torch.empty(0))
    if m.max_num_logprobs is not None:
        raw = logits.log_softmax(-1)
    if m.logit_bias is not None:
        logits = logits + m.logit_bias
    if m.token_bitmask is not None:
        # Less 1e30 rather than -inf: exp gives 0 all the same, and a subtraction vectorises where CPU
        # masked_fill does not.
        logits = logits - (1 - allowed_tokens(m.token_bitmask, logits.shape[-1])) * 1e30
    if m.repetition is not None:
        logits = apply_penalties(logits, m)
    greedy = logits.max(-1).indices  # the first maximum, as argmax, which is slower on CPU
    if m.all_greedy:
        out.token_ids = greedy
    else:
        temp = torch.where(m.temperature > 0, m.temperature, 1.0)
        probs = filter_probs((logits / temp[:, None]).softmax(-1), m)
        race = probs / -torch.log(uniform_noise(m.seeds, m.steps, logits.shape[-1]))
        out.token_ids = torch.where(m.temperature > 0, race.max(-1).indices, greedy)
    if m.max_num_logprobs is not None:
        out.logprobs = raw.gather(-1, out.token_ids[:, None])[:, 0]
        if m.max_num_logprobs > 0:
            out.topk_logprobs, out.topk_ids = raw.topk(m.max_num_logprobs, dim=-1)
    return out
