"""Speculative decoding: draft proposers.

A proposer guesses the next tokens of a request; the engine verifies the guess with one
forward of the target model over the last token and the draft, and keeps the longest prefix
the target agrees with (exactly the target's own output: see `Sampler.verify`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from moeserve.config import SpeculativeConfig
    from moeserve.spec.base import Proposer


def make_proposer(cfg: SpeculativeConfig) -> Proposer:
    """The host-side proposer `cfg` names."""
    from moeserve.config import ConfigError

    if cfg.method == "ngram":
        from moeserve.spec.ngram import NgramProposer

        return NgramProposer.from_config(cfg)
    if cfg.method == "suffix":
        from moeserve.spec.suffix import SuffixProposer

        return SuffixProposer.from_config(cfg)
    raise ConfigError(
        f"--speculative-config: method {cfg.method!r} (a draft model) is not available yet; "
        "use ngram, suffix or mtp"
    )
