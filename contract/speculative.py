"""The speculative decoding configuration (serve ``speculative_config``): validated when a recipe loads and when the
engine starts, so its schema lives here, dependency-free (stdlib and omforge.errors only)."""

from __future__ import annotations

from dataclasses import dataclass

from omforge.errors import OmforgeError

METHODS = ("ngram",)


class SpeculativeConfigError(OmforgeError, ValueError):
    """A speculative_config that cannot run; the message names the key."""


@dataclass(frozen=True)
class SpeculativeConfig:
    """vLLM's spelling: ``method`` (ngram), ``num_speculative_tokens`` k, ``prompt_lookup_min`` /
    ``prompt_lookup_max`` (the n-gram lengths tried, longest first). ``max_batch`` (omforge's): sequences in a
    step above which nobody drafts — big batches are compute-bound and verification would cost; ``min_acceptance``:
    a sequence whose acceptance rate (a moving average) falls below it stops drafting."""

    method: str = "ngram"
    num_speculative_tokens: int = 4
    prompt_lookup_min: int = 2
    prompt_lookup_max: int = 4
    max_batch: int = 8
    min_acceptance: float = 0.2

    @classmethod
    def from_dict(cls, d: dict | None) -> SpeculativeConfig | None:
        if d is None:
            return None
        unknown = sorted(set(d) - {f for f in cls.__dataclass_fields__})
        if unknown:
            raise SpeculativeConfigError(f"speculative_config: unknown key(s) {', '.join(unknown)}")
        cfg = cls(**d)
        if cfg.method not in METHODS:
            raise SpeculativeConfigError(f"speculative_config.method: {cfg.method!r} is not one of {METHODS} "
                                         "(draft models are not built)")
        if not 1 <= cfg.num_speculative_tokens <= 16:
            raise SpeculativeConfigError("speculative_config.num_speculative_tokens must be in [1, 16]")
        if not 1 <= cfg.prompt_lookup_min <= cfg.prompt_lookup_max <= 64:
            raise SpeculativeConfigError("speculative_config: need 1 <= prompt_lookup_min <= prompt_lookup_max <= 64")
        return cfg
