"""The vLLM side of `dflash-train bench engine`: run in vLLM's OWN environment, never imported.

    VLLM_PYTHON vllm_runner.py JOB.json OUT.json

It imports only the standard library and vLLM (the project is not installed there). JOB.json:
  target                 the target model directory
  drafters               [{"name": ..., "path": EXPORTED_DIR}, ...], served one after another
  prompts                [[token id, ...], ...] (the project encodes them: both sides decode the
                         very same ids, so no tokenizer or chat template can differ)
  max_tokens             new tokens per request
  stop_token_ids         ids that end a response (included in the output, as in the project)
  num_speculative_tokens block size - 1
  max_model_len          context length to reserve
OUT.json: per drafter, per prompt, the output token ids and vLLM's per-request speculative
decoding metrics (`per_request_spec_decode_metrics="detailed"`: accepted and drafted counts per
verify step), with the seconds each engine took to start and to generate.

Greedy (temperature 0), fp32, eager mode: the configuration in which vLLM's CPU build must
reproduce plain greedy decoding of the target exactly.
"""

from __future__ import annotations

import gc
import json
import sys
import time
from pathlib import Path


def serve(job: dict, drafter: dict) -> dict:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    t0 = time.monotonic()
    llm = LLM(
        model=job["target"],
        skip_tokenizer_init=True,
        dtype="float32",
        enforce_eager=True,
        max_model_len=job["max_model_len"],
        seed=0,
        speculative_config={
            "method": "dflash",
            "model": drafter["path"],
            "num_speculative_tokens": job["num_speculative_tokens"],
        },
        per_request_spec_decode_metrics="detailed",
    )
    t1 = time.monotonic()
    params = SamplingParams(
        temperature=0.0,
        max_tokens=job["max_tokens"],
        stop_token_ids=job["stop_token_ids"],
        detokenize=False,
    )
    prompts = [TokensPrompt(prompt_token_ids=ids) for ids in job["prompts"]]
    outputs = llm.generate(prompts, params, use_tqdm=False)
    t2 = time.monotonic()
    responses = []
    for out in outputs:
        completion = out.outputs[0]
        metrics = completion.spec_decode_metrics
        responses.append(
            {
                "tokens": list(completion.token_ids),
                "finish_reason": completion.finish_reason,
                "spec_decode_metrics": None if metrics is None else metrics.to_dict(),
            }
        )
    llm.llm_engine.engine_core.shutdown()
    del llm
    gc.collect()
    return {
        "name": drafter["name"],
        "path": drafter["path"],
        "startup_s": t1 - t0,
        "generate_s": t2 - t1,
        "responses": responses,
    }


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print("usage: vllm_runner.py JOB.json OUT.json", file=sys.stderr)
        return 2
    job = json.loads(Path(argv[0]).read_text())
    import vllm

    results = [serve(job, d) for d in job["drafters"]]
    out = {"vllm_version": vllm.__version__, "drafters": results}
    Path(argv[1]).write_text(json.dumps(out) + "\n")
    return 0


if __name__ == "__main__":  # vLLM spawns its engine process: the guard is required
    raise SystemExit(main(sys.argv[1:]))
