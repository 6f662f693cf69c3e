"""The target's cache through draft-and-verify: every cache kind the target families use.

After each verify forward of a block at positions start .. start + size - 1, only the first
`produced` positions (the anchor and the accepted drafts) may stay in the cache. How a layer's
cache goes back depends on what it holds:

- keys and values (full attention, MLA's compressed latents, DSA's indexer keys): cropped;
- a sliding window (Gemma 3, gpt-oss): cropped too, because past recording is on
  (`activate_past_recording`), so the window keeps the entries a rejected block pushed out
  until the crop trims it back;
- a recurrent state (the linear attention of Qwen3.5 / Qwen3.6 / Qwen3-Next): it cannot be
  cropped, since after the block it has folded in every token of it. Its state is snapshotted
  before each verify; when part of the block is rejected the whole block is cropped, the
  snapshot restored, and the accepted tokens run through the target once more (one extra
  forward of at most B tokens per cycle with a rejection; the verify's own logits and features
  are kept, the replay only advances the states). Exact, and the same for any model whose
  cache layers hold `recurrent_states`. From transformers 5.25 the cache does it itself: past
  recording with `recurrent_states_to_keep` = B keeps the state after each of a verify's last B
  tokens, and the crop puts back the one of the kept prefix (no snapshot, no replay); its
  recording cannot be had without it there (a layer recording no such count fails its forward).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from dflash_train.model.compat import cache_kwargs, crop_cache


class VerifyCache:
    """One generation's target cache (`cache`, a transformers `DynamicCache`) with the rollback
    above. Call `before_verify(block, start)` before each verify forward and `keep(length)`
    after it; the prefill needs neither."""

    def __init__(self, target: nn.Module, block_size: int) -> None:
        from transformers import DynamicCache

        self.target = target
        self.cache = DynamicCache(config=target.config)
        self.native_rollback = records_recurrent_states(self.cache)
        """Whether the cache rolls recurrent states back itself (transformers >= 5.25)."""
        # Sliding-window layers must keep enough past to roll back the rejected part of a block.
        # (transformers < 5.14 has no past recording: families with sliding windows need a
        # newer release, `model.compat.FAMILY_MIN_TRANSFORMERS`.)
        if self.native_rollback:
            self.cache.activate_past_recording(recurrent_states_to_keep=block_size)
        elif hasattr(self.cache, "activate_past_recording"):
            self.cache.activate_past_recording()
        self._saved: dict[tuple[int, int], torch.Tensor] | None = None
        self._block: torch.Tensor | None = None
        self._start = 0
        self.replays = 0
        """Verifies after which the accepted prefix was run again (recurrent states only)."""

    def seq_length(self) -> int:
        return self.cache.get_seq_length()

    def before_verify(self, block: torch.Tensor, start: int) -> None:
        """Remember what the verify of `block` (1, size) at positions `start` .. changes."""
        self._block, self._start = block, start
        # The prefill is followed by no crop: trim recorded sliding windows back to their
        # working size now (transformers < 5.24 hands the next forward the whole record).
        _crop(self.cache, self.seq_length())
        states = {} if self.native_rollback else _recurrent_states(self.cache)
        self._saved = {key: t.clone() for key, t in states.items()} if states else None

    def keep(self, length: int) -> None:
        """Keep the first `length` positions (length >= the verified block's start)."""
        removed = self.seq_length() - length
        if removed == 0 or self._saved is None or self._block is None:
            _crop(self.cache, length)
            return
        # Recurrent states: back to before the block, then through the accepted part again.
        _crop(self.cache, self._start)
        for (layer, idx), saved in _recurrent_states_ref(self.cache, self._saved):
            layer.recurrent_states[idx].copy_(saved)
        accepted = self._block[:, : length - self._start]
        if accepted.shape[1]:
            positions = torch.arange(self._start, length, device=accepted.device)[None]
            self.target(
                accepted,
                position_ids=positions,
                use_cache=True,
                logits_to_keep=1,
                **cache_kwargs(self.target, self.cache),
            )
        _crop(self.cache, length)  # trims the recorded conv states back to their kernel
        self.replays += 1


def records_recurrent_states(cache: Any) -> bool:
    """Whether `cache` keeps a verify's intermediate recurrent states for its crop to restore
    (transformers >= 5.25: `recurrent_states_to_keep`)."""
    return hasattr(cache, "get_recurrent_states_to_keep")


def _recurrent_states(cache: Any) -> dict[tuple[int, int], torch.Tensor]:
    """(layer index, state index) -> each initialised recurrent state of the cache."""
    found = {}
    for i, layer in enumerate(getattr(cache, "layers", ())):
        states = getattr(layer, "recurrent_states", None)
        if not isinstance(states, dict):
            continue
        for j, t in states.items():
            if t is not None and layer.is_recurrent_states_initialized.get(j):
                found[(i, j)] = t
    return found


def _recurrent_states_ref(cache: Any, saved: dict[tuple[int, int], torch.Tensor]):
    """(layer, state index) and the saved tensor for every snapshotted state."""
    for (i, j), t in saved.items():
        yield (cache.layers[i], j), t


def _crop(cache: Any, length: int) -> None:
    """Keep the first `length` positions of a transformers cache (at the current length, the
    recorded windows and conv states are trimmed back to their working size)."""
    crop_cache(cache, length)
