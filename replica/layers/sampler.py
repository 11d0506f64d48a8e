"""Token sampling for one step: greedy, or temperature / top-k / top-p then a draw; seeded
requests draw from their own torch.Generator so their output does not depend on the batch."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from replica.request import SamplingParams


@dataclass
class SamplerOutput:
    token_ids: list[int]
    # per row: (logprob of the sampled token, {token: logprob} of the top-k), or None when the
    # request did not ask for logprobs
    logprobs: list[tuple[float, dict[int, float]] | None]


class Sampler:
    def __call__(
        self,
        logits: torch.Tensor,
        params: list[SamplingParams],
        generators: list[torch.Generator | None],
        default_generator: torch.Generator | None = None,
    ) -> SamplerOutput:
        """Sample one token per row of `logits` [B, V]. `generators[i]` is row i's own
        generator (seeded request) or None (drawn from `default_generator` in one op)."""
        greedy = [p.temperature == 0.0 for p in params]
        if all(greedy) and all(p.logprobs is None for p in params):
            # no logprobs to compute (bf16 is widened first: its CPU argmax is ~4x slower)
            return SamplerOutput(logits.float().argmax(dim=-1).tolist(), [None] * len(params))
        logits = logits.float()
        if all(greedy):
            sampled = logits.argmax(dim=-1)
        else:
            sampled = self._sample(logits, params, greedy, generators, default_generator)
        token_ids = sampled.tolist()
        return SamplerOutput(token_ids, self._logprobs(logits, params, sampled))

    def _sample(
        self,
        logits: torch.Tensor,
        params: list[SamplingParams],
        greedy: list[bool],
        generators: list[torch.Generator | None],
        default_generator: torch.Generator | None,
    ) -> torch.Tensor:
        device = logits.device
        temperatures = torch.tensor(
            [1.0 if g else p.temperature for p, g in zip(params, greedy)], device=device
        )
        scaled = logits / temperatures[:, None]
        top_ks = [p.top_k if p.top_k > 0 else 0 for p in params]
        top_ps = [p.top_p for p in params]
        if any(top_ks) or any(p < 1.0 for p in top_ps):
            scaled = _top_k_top_p(scaled, top_ks, top_ps)
        probs = torch.softmax(scaled, dim=-1)
        # Exponential race: argmax(p / E) with E ~ Exp(1) draws from p, and needs exactly one
        # draw of V numbers per row, so a seeded row's stream is independent of the batch.
        noise = torch.empty_like(probs)
        unseeded = [i for i, g in enumerate(generators) if g is None]
        if unseeded:
            if len(unseeded) == len(generators):
                noise.exponential_(generator=default_generator)
            else:
                rows = torch.tensor(unseeded, device=device)
                draw = torch.empty(len(unseeded), probs.shape[1], device=device)
                noise.index_copy_(0, rows, draw.exponential_(generator=default_generator))
        for i, generator in enumerate(generators):
            if generator is not None:
                noise[i].exponential_(generator=generator)
        sampled = (probs / noise).argmax(dim=-1)
        if any(greedy):
            greedy_rows = torch.tensor(greedy, device=device)
            sampled = torch.where(greedy_rows, logits.argmax(dim=-1), sampled)
        return sampled

    def _logprobs(
        self, logits: torch.Tensor, params: list[SamplingParams], sampled: torch.Tensor
    ) -> list[tuple[float, dict[int, float]] | None]:
        wanted = [p.logprobs for p in params]
        if all(k is None for k in wanted):
            return [None] * len(params)
        # from the model's raw distribution (before temperature / top-k / top-p), as vLLM does
        logprobs = torch.log_softmax(logits, dim=-1)
        chosen = logprobs.gather(1, sampled[:, None])[:, 0].tolist()
        k_max = max(k or 0 for k in wanted)
        top_values, top_ids = logprobs.topk(k_max, dim=-1) if k_max else (None, None)
        top_values = top_values.tolist() if k_max else None
        top_ids = top_ids.tolist() if k_max else None
        out: list[tuple[float, dict[int, float]] | None] = []
        for i, k in enumerate(wanted):
            if k is None:
                out.append(None)
            elif k == 0:
                out.append((chosen[i], {}))
            else:
                out.append((chosen[i], dict(zip(top_ids[i][:k], top_values[i][:k]))))
        return out


def _top_k_top_p(logits: torch.Tensor, top_ks: list[int], top_ps: list[float]) -> torch.Tensor:
    """Mask to -inf every token outside each row's top-k, then outside its top-p nucleus (the
    smallest set of most likely tokens whose mass reaches p; the top token always stays)."""
    device = logits.device
    vocab = logits.shape[-1]
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    ranks = torch.arange(vocab, device=device)[None, :]
    ks = torch.tensor([k if 0 < k < vocab else vocab for k in top_ks], device=device)
    sorted_logits = sorted_logits.masked_fill(ranks >= ks[:, None], float("-inf"))
    ps = torch.tensor(top_ps, device=device, dtype=logits.dtype)
    sorted_probs = torch.softmax(sorted_logits, dim=-1)
    mass_before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs
    # p == 1 keeps everything exactly (cumulative sums can round past 1.0)
    outside = (mass_before >= ps[:, None]) & (ps[:, None] < 1.0)
    sorted_logits = sorted_logits.masked_fill(outside, float("-inf"))
    return torch.full_like(logits, float("-inf")).scatter(1, order, sorted_logits)
