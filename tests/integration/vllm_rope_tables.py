"""Run by vLLM's own python (tests/integration/test_served_rope.py): each exported drafter's
rotary embedding as vLLM's DFlash Qwen3 model builds it (`get_rope` on the config vLLM loads
from the export's config.json: its head_dim, max_position_embeddings and rope_parameters,
neox style) and as a reader that ignores some YaRN fields builds it (the same parameters less
`ignored_fields`).

argv: JOB.json OUT.pt. JOB: {"ignored_fields": [...], "exports": {name: {"dir": ..., "positions":
[...], "query": QUERY.pt}}}, QUERY (tokens, heads * head_dim) fp32. OUT: for each name and
reading ("vllm", "ignoring"), "{name}/{reading}/cos_sin" (tokens, head_dim): vLLM's cache rows
at the positions (cos of each rotated pair, then sin), and "{name}/{reading}/query": the query
rotated by the module as the engine calls it; or "{name}/error", what building them raised.
"""

from __future__ import annotations

import json
import sys

import torch


def tables(config, params: dict, positions: torch.Tensor, query: torch.Tensor) -> dict:
    """The cache rows at `positions` and the rotated `query` of `get_rope(..., params)`."""
    from vllm.model_executor.layers.rotary_embedding import get_rope

    rope = get_rope(
        config.head_dim,
        max_position=config.max_position_embeddings,
        is_neox_style=getattr(config, "is_neox_style", True),
        rope_parameters=params,
        dtype=torch.float32,
    )
    rotated, _ = rope(positions, query.clone(), None)
    return {"cos_sin": rope.cos_sin_cache[positions].clone(), "query": rotated}


def main() -> None:
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.transformers_utils.config import get_config

    with open(sys.argv[1]) as handle:
        job = json.load(handle)
    out = {}
    with set_current_vllm_config(VllmConfig()), torch.no_grad():
        for name, spec in job["exports"].items():
            try:
                out.update(export_tables(name, spec, job["ignored_fields"], get_config))
            except Exception as exc:  # one export's failure is that export's result
                out[f"{name}/error"] = f"{type(exc).__name__}: {exc}"
    torch.save(out, sys.argv[2])


def export_tables(name: str, spec: dict, ignored: list[str], get_config) -> dict:
    """Both readings' tables of one export."""
    config = get_config(spec["dir"], trust_remote_code=False)
    params = dict(config.rope_parameters)
    ignoring = {k: v for k, v in params.items() if k not in ignored}
    positions = torch.tensor(spec["positions"], dtype=torch.long)
    query = torch.load(spec["query"])
    out = {}
    for reading, rope_params in (("vllm", params), ("ignoring", ignoring)):
        for key, value in tables(config, rope_params, positions, query).items():
            out[f"{name}/{reading}/{key}"] = value
    return out


if __name__ == "__main__":
    main()
