"""What the engine server and its clients agree on: paths, fields, exit codes, sizes.

HTTP/1.1 with JSON bodies (keep-alive; one connection per target worker):
- `GET /health` -> the engine's description (`HEALTH_FIELDS`): the DFlash target layer ids it
  serves and vLLM's aux ids for them, hidden size, dtype, max_model_len, tensor parallel size,
  vLLM version, pid, and its hand-over directory with a token file in it (a client that can read
  the token is on the same host and may take features from the directory).
- `POST /features` {"rows": [[token id, ...], ...], "handover": "shm" | "inline",
  "timeout_s": S} -> every row's features, (n_i, K, hidden) in the engine's dtype, C order:
  - "shm": JSON {"files": [path, ...], "num_tokens": [n_i, ...], "engine_s": seconds from
    admission to the last file written}; the files are complete when
    the answer comes; the client reads them and deletes them (the server counts the bytes it
    handed over against its bound until they are gone);
  - "inline": the bytes themselves, rows one after the other (`application/octet-stream`, the
    row lengths in the `X-Num-Tokens` header, comma separated): for clients on another host.
  Errors: JSON {"error": one line}; 400 bad request, 413 a batch larger than the hand-over
  bound, 503 the bound still full at the deadline, 504 no result by the deadline, 500 the
  engine failed (the server then exits).
Standard library only: the engine process imports it too.
"""

from __future__ import annotations

HEALTH = "/health"
FEATURES = "/features"
HEALTH_FIELDS = (
    "target",
    "target_layer_ids",
    "aux_layer_ids",
    "hidden_size",
    "dtype",
    "max_model_len",
    "tensor_parallel_size",
    "vllm_version",
    "pid",
    "handover_dir",
    "handover_token",
    "handover_bytes",
)
TOKEN_FILE = "token"
NUM_TOKENS_HEADER = "X-Num-Tokens"

ERROR_PREFIX = "dflash-engine error: "
"""The one line the engine prints before exiting on a start-up failure (the launcher quotes it)."""
READY_PREFIX = "dflash-engine ready: "
"""Printed once the engine serves, followed by the health JSON."""

EXIT_BAD_ARGS = 2
EXIT_NO_VLLM = 3
EXIT_CANNOT_LOAD = 4
EXIT_PORT_IN_USE = 5
EXIT_ENGINE_DIED = 6

ITEMSIZE = {"float32": 4, "bfloat16": 2, "float16": 2}
"""Bytes per value of the dtypes the engine may compute in."""


def feature_bytes(num_tokens: int, num_layers: int, hidden_size: int, dtype: str) -> int:
    """Bytes of one request's hand-over: (num_tokens, num_layers, hidden_size) values."""
    return num_tokens * num_layers * hidden_size * ITEMSIZE[dtype]
