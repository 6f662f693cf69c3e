"""The one place target layer ids are translated between DFlash and vLLM (both sides use it).

DFlash's target layer id i is the OUTPUT of decoder layer i (transformers' `hidden_states[i +
1]`). vLLM's auxiliary hidden-state id L (`eagle_aux_hidden_state_layer_ids`) is the INPUT of
decoder layer L (transformers' `hidden_states[L]`, 0 the embeddings; measured: max abs
difference 3e-6 in fp32 on a tiny Qwen3). So DFlash id i is vLLM aux id i + 1.

vLLM collects auxiliary states in layer order whatever order they are asked in, so the engine
is asked for the sorted distinct ids, and `feature_order` puts its layer axis back in the
drafter's order (the `hf` source concatenates the layers in the order the drafter names them).
Standard library only: the engine process imports it too.
"""

from __future__ import annotations

from collections.abc import Sequence

DFLASH_TO_VLLM_OFFSET = 1
"""vLLM aux id = DFlash target layer id + this."""


def vllm_aux_ids(dflash_ids: Sequence[int]) -> list[int]:
    """The aux hidden-state ids to ask vLLM for: sorted, distinct."""
    return sorted({int(i) + DFLASH_TO_VLLM_OFFSET for i in dflash_ids})


def dflash_ids_of(aux_ids: Sequence[int]) -> list[int]:
    """The DFlash target layer ids of vLLM aux ids (the inverse of `vllm_aux_ids`'s map)."""
    return [int(a) - DFLASH_TO_VLLM_OFFSET for a in aux_ids]


def feature_order(dflash_ids: Sequence[int]) -> list[int]:
    """For each DFlash id in the drafter's order, its index on the engine's layer axis."""
    aux = vllm_aux_ids(dflash_ids)
    return [aux.index(int(i) + DFLASH_TO_VLLM_OFFSET) for i in dflash_ids]
