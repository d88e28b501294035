"""Sampling arithmetic shared by the engines: a next-token distribution that is a
valid probability vector for every accepted parameter.

Contract: :func:`distribution` takes float logits (any finite or non-finite values)
and returns float64 probabilities that are finite, non-negative and sum to 1, or
None when the request is greedy. The temperature is vLLM's rule, in one place
(:func:`safe_temperature`): below :data:`GREEDY_BELOW` it is greedy, below
:data:`MIN_TEMPERATURE` it is raised to it (dividing by less overflows float32
logits to inf, then NaN). The softmax is taken after subtracting the maximum, in
float64, so no finite logit overflows.
"""

from __future__ import annotations

import numpy as np

GREEDY_BELOW = 1e-5  # vLLM's _SAMPLING_EPS: a smaller temperature is greedy
MIN_TEMPERATURE = 0.01  # vLLM's _MAX_TEMP: a smaller positive temperature is raised to it


def safe_temperature(t: float) -> float:
    """The temperature sampled with: 0.0 (greedy) below ``GREEDY_BELOW`` or NaN,
    else at least ``MIN_TEMPERATURE``."""
    if not t >= GREEDY_BELOW:  # NaN too: never a division by it
        return 0.0
    return max(t, MIN_TEMPERATURE)


def clean(logits: np.ndarray) -> np.ndarray:
    """float64 logits with NaN as -inf (a NaN is never chosen); all -inf or NaN
    becomes uniform zeros so argmax and softmax stay defined."""
    x = np.asarray(logits, dtype=np.float64).copy()
    x[np.isnan(x)] = -np.inf
    if not np.isfinite(x.max()):
        top = x.max()
        x = np.where(x == top, 0.0, -np.inf) if top == np.inf else np.zeros_like(x)
    return x


def greedy(logits: np.ndarray) -> int:
    i = int(np.argmax(logits))  # argmax lands on a NaN when there is one
    return i if not np.isnan(logits[i]) else int(np.argmax(clean(logits)))


def distribution(logits: np.ndarray, temperature: float, top_p: float) -> np.ndarray | None:
    """Probabilities to sample from, or None for greedy decoding."""
    temperature = safe_temperature(temperature)
    if not temperature:
        return None
    x = clean(logits)
    with np.errstate(over="ignore", under="ignore", invalid="ignore"):
        z = (x - x.max()) / temperature  # <= 0 everywhere, 0 at the maximum
    z[np.isnan(z)] = -np.inf
    p = np.exp(z)
    p /= p.sum()  # >= 1: the maximum contributes exp(0)
    if top_p < 1.0:
        order = np.argsort(-p, kind="stable")
        keep = np.cumsum(p[order]) - p[order] < top_p
        keep[0] = True  # the most likely token always survives, whatever top_p is
        mask = np.zeros_like(p)
        mask[order[keep]] = p[order[keep]]
        p = mask / mask.sum()
    return p


__all__ = [
    "GREEDY_BELOW",
    "MIN_TEMPERATURE",
    "clean",
    "distribution",
    "greedy",
    "safe_temperature",
]
