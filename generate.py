"""Text generation for any model with `decode_step(input_ids, caches, start)` (Flint, Mistral Large
4): sampling (greedy, temperature, top-k), and `stream`, the KV-cached decoding loop that yields
each token as it is chosen. It imports nothing of this repository."""

from __future__ import annotations

import math
from collections.abc import Iterator

import torch
import torch.nn as nn

# Below this, sampling is greedy in effect and logits / temperature can overflow FP32 (NaN
# probabilities).
MIN_TEMPERATURE = 1e-3


def usable_temperature(temperature: float) -> bool:
    """0 (greedy), or finite and at least MIN_TEMPERATURE."""
    return temperature == 0 or (math.isfinite(temperature) and temperature >= MIN_TEMPERATURE)


def check_sampling(temperature: float, top_k: int | None) -> None:
    if (
        not isinstance(temperature, (int, float))
        or isinstance(temperature, bool)
        or not temperature >= 0
    ):
        raise ValueError(f"temperature must be a number >= 0 (0: greedy), got {temperature!r}")
    if not usable_temperature(temperature):
        raise ValueError(
            f"temperature must be 0 (greedy) or a finite number >= {MIN_TEMPERATURE}, "
            f"got {temperature!r}"
        )
    if top_k is not None and (not isinstance(top_k, int) or isinstance(top_k, bool) or top_k <= 0):
        raise ValueError(f"top_k must be a positive integer or None (all tokens), got {top_k!r}")


def sample(
    logits: torch.Tensor,
    temperature: float,
    top_k: int | None,
    generator: torch.Generator | None = None,
    allowed: torch.Tensor | None = None,
) -> torch.Tensor:
    """logits [B, V] -> next tokens [B, 1]: greedy at temperature 0, else top-k sampling; only ids
    where allowed (bool [V]) is true, when given."""
    check_sampling(temperature, top_k)
    if allowed is not None:
        logits = logits.masked_fill(~allowed.to(logits.device), float("-inf"))
    if temperature <= 0:
        return logits.argmax(dim=-1, keepdim=True)
    logits = logits / temperature
    if top_k is not None:
        kth = torch.topk(logits, min(top_k, logits.shape[-1]), dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    return torch.multinomial(torch.softmax(logits, dim=-1), 1, generator=generator)


@torch.no_grad()
def generate(
    model: nn.Module,
    prompt: torch.Tensor,
    max_new_tokens: int,
    temperature: float = 0.0,
    top_k: int | None = None,
    generator: torch.Generator | None = None,
    eos_token_id: int | None = None,
    allowed: torch.Tensor | None = None,
) -> torch.Tensor:
    """prompt [B, T] -> [B, T + n], n <= max_new_tokens: the prompt and everything `stream`
    yields."""
    return torch.cat(
        [
            prompt,
            *stream(
                model, prompt, max_new_tokens, temperature, top_k, generator, eos_token_id, allowed
            ),
        ],
        dim=1,
    )


@torch.no_grad()
def stream(
    model: nn.Module,
    prompt: torch.Tensor,
    max_new_tokens: int,
    temperature: float = 0.0,
    top_k: int | None = None,
    generator: torch.Generator | None = None,
    eos_token_id: int | None = None,
    allowed: torch.Tensor | None = None,
) -> Iterator[torch.Tensor]:
    """Yield each next token [B, 1] as it is chosen, up to max_new_tokens. A row that has produced
    eos_token_id is finished: from then on it receives eos_token_id again (padding), and the stream
    stops once every row has finished. Any model with `decode_step(input_ids, caches, start)` that
    fills an empty caches dict (Flint, Mistral Large 4).

    temperature 0 is greedy; otherwise sample from softmax(logits / temperature), optionally
    restricted to the top_k tokens. allowed (bool [V]): the only ids that may be chosen, for a
    vocabulary padded beyond what the tokenizer can decode.
    """
    model.check_inputs(prompt, None, None, None)
    limit = model.config.max_position_embeddings
    if (
        not isinstance(max_new_tokens, int)
        or max_new_tokens < 0
        or prompt.shape[1] + max_new_tokens > limit
    ):
        raise ValueError(
            "max_new_tokens must be an integer >= 0 with prompt length + "
            "max_new_tokens <= "
            f"max_position_embeddings ({prompt.shape[1]} + {max_new_tokens!r} > "
            f"{limit})"
        )
    caches: dict = {}
    step_input, start = prompt, 0
    finished = torch.zeros(prompt.shape[0], dtype=torch.bool, device=prompt.device)
    for _ in range(max_new_tokens):
        logits = model.decode_step(step_input, caches, start)  # [B, V] for the last position
        start += step_input.shape[1]
        next_token = sample(logits, temperature, top_k, generator, allowed)  # [B, 1]
        if eos_token_id is not None:
            next_token = next_token.masked_fill(finished[:, None], eos_token_id)
            finished |= next_token[:, 0] == eos_token_id
        yield next_token
        step_input = next_token
        if eos_token_id is not None and bool(finished.all()):
            return
