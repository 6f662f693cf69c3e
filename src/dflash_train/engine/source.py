"""The target on a vLLM engine as the pipeline sees it: a `FeatureSource` per target worker.

`VllmTarget.open(settings)` starts the engine (`process.EngineProcess`) or reaches one already
running (`settings.endpoint`), checks that it serves what the drafter needs (the target layers,
the hidden size, a long enough context) and hands out sources: `target.source()` is one target
worker's connection, `source(input_ids)` -> (batch, L, K * hidden) features on the host, in the
drafter's layer order, equal to what the `hf` source (`model.target.TargetFeatureExtractor`)
returns for the same rows (fp32 on CPU: max abs difference ~4e-6). Several sources share one
engine and keep it busy: vLLM batches their concurrent requests. `close()` stops an engine it
started. Nothing here needs the trainer: an offline feature store builds the same object from
the same settings.

Each row is sent whole, padding included, so every position's features match the `hf` source's
(features at padded positions are never read, but equal is simpler to check than "unread").
Features travel through the engine's memory-backed hand-over directory when the engine runs on
this host (the files are read straight into the batch tensor and deleted at once), else inline
in the HTTP answer.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import time
import urllib.parse
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from dflash_train.engine import protocol
from dflash_train.engine.layers import vllm_aux_ids
from dflash_train.engine.process import EngineError, EngineProcess, EngineSpec, EngineStartError

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
HEALTH_TIMEOUT_S = 30.0
NETWORK_ERRORS = (ConnectionError, http.client.HTTPException, OSError)


@dataclass(frozen=True)
class VllmTargetSettings:
    """Everything a vLLM-backed target needs; `from_options` builds it from the CLI's
    `EngineOptions` and the model's facts."""

    target: str
    layer_ids: list[int]
    """DFlash target layer ids, in the drafter's order."""
    dtype: torch.dtype
    max_model_len: int
    """At least the longest row + 1 (the engine generates one token per row)."""
    request_timeout_s: float
    """A batch's features must arrive within this (else the run fails: never dropped)."""
    endpoint: str | None = None
    """URL of an engine already running; None: start one."""
    python: str | None = None
    tensor_parallel_size: int = 1
    cuda_devices: list[int] | None = None
    engine_args: dict[str, Any] = field(default_factory=dict)
    start_timeout_s: float = 900.0

    @classmethod
    def from_options(
        cls,
        options: Any,
        target: str,
        layer_ids: list[int],
        dtype: torch.dtype,
        max_model_len: int,
        devices: list[torch.device],
        request_timeout_s: float,
    ) -> VllmTargetSettings:
        """From `config.EngineOptions` (the engine section of a train config)."""
        import sys

        gpus = sorted({d.index or 0 for d in devices if d.type == "cuda"})
        if gpus and len(gpus) != options.target_tp:
            raise ValueError(
                f"--target-tp {options.target_tp}: the engine splits the target over "
                f"{options.target_tp} GPUs, and --target-devices names {len(gpus)} ({gpus})"
            )
        return cls(
            target=target,
            layer_ids=list(layer_ids),
            dtype=dtype,
            max_model_len=max_model_len,
            request_timeout_s=request_timeout_s,
            endpoint=(options.target_endpoint or [None])[0],
            python=options.vllm_python or sys.executable,
            tensor_parallel_size=options.target_tp,
            cuda_devices=gpus or None,
            engine_args=options.engine_args_dict,
            start_timeout_s=options.engine_start_timeout,
        )

    def engine_spec(self) -> EngineSpec:
        assert self.python is not None
        return EngineSpec(
            target=self.target,
            layer_ids=vllm_aux_dflash_ids(self.layer_ids),
            python=self.python,
            dtype=dtype_name(self.dtype),
            max_model_len=self.max_model_len,
            tensor_parallel_size=self.tensor_parallel_size,
            cuda_devices=self.cuda_devices,
            engine_args=self.engine_args,
            start_timeout_s=self.start_timeout_s,
        )


def vllm_aux_dflash_ids(layer_ids: list[int]) -> list[int]:
    """The distinct DFlash ids the engine is started with (sorted: vLLM's own order)."""
    return [a - 1 for a in vllm_aux_ids(layer_ids)]


def dtype_name(dtype: torch.dtype) -> str:
    names = {v: k for k, v in DTYPES.items()}
    if dtype not in names:
        raise ValueError(f"the vLLM backend computes in {sorted(DTYPES)}, not {dtype}")
    return names[dtype]


class VllmTarget:
    """One engine (started here or reached at an endpoint) and the sources that use it."""

    def __init__(
        self,
        settings: VllmTargetSettings,
        url: str,
        info: dict[str, Any],
        process: EngineProcess | None,
    ) -> None:
        self.settings, self.url, self.info, self.process = settings, url, info, process
        self.order = engine_order(settings.layer_ids, info)
        self.shared_memory = can_read_handover(info)

    @classmethod
    def open(cls, settings: VllmTargetSettings, say: Callable[[str], None] = print) -> VllmTarget:
        process = None
        if settings.endpoint is None:
            process = EngineProcess.start(settings.engine_spec(), say)
            url, info = process.url, process.info
        else:
            url = settings.endpoint.rstrip("/")
            try:
                info = fetch_health(url)
            except EngineError as e:  # at start-up a setting to fix: one line, exit 2
                raise EngineStartError(f"--target-endpoint: {e}") from None
        try:
            target = cls(settings, url, info, process)
            target.check(settings)
        except BaseException:
            if process is not None:
                process.stop()
            raise
        return target

    def check(self, settings: VllmTargetSettings) -> None:
        """Refuse an engine that cannot serve this drafter (one line each)."""
        info = self.info
        if int(info["max_model_len"]) < settings.max_model_len:
            raise EngineStartError(
                f"the engine at {self.url} serves rows of up to {info['max_model_len']} tokens; "
                f"this run needs {settings.max_model_len} (start it with --max-model-len "
                f"{settings.max_model_len})"
            )
        if info["dtype"] not in DTYPES:
            raise EngineStartError(f"the engine at {self.url} computes in {info['dtype']}")

    def source(self) -> VllmFeatureSource:
        """A new feature source (one per target worker: each holds its own connection)."""
        return VllmFeatureSource(self)

    def describe(self) -> str:
        how = "shared memory" if self.shared_memory else "inline over HTTP"
        who = "started here" if self.process is not None else "already running"
        return (
            f"vLLM engine {self.info.get('vllm_version', '?')} at {self.url} ({who}, TP "
            f"{self.info.get('tensor_parallel_size', 1)}, {self.info['dtype']}, aux layers "
            f"{self.info['aux_layer_ids']}); features handed over by {how}"
        )

    def describe_failure(self) -> str:
        if self.process is not None:
            return self.process.describe_failure()
        try:
            fetch_health(self.url)
            return f"the engine at {self.url} still answers /health"
        except EngineError as e:
            return str(e)

    def close(self, keep_log: Path | None = None) -> None:
        """Stop the engine if this process started it (an endpoint's engine keeps running)."""
        if self.process is not None:
            self.process.stop(keep_log=keep_log)


def engine_order(layer_ids: list[int], info: dict[str, Any]) -> list[int]:
    """For each DFlash id of the drafter, its index on the engine's layer axis."""
    served = [int(i) for i in info["target_layer_ids"]]
    missing = [i for i in layer_ids if i not in served]
    if missing:
        raise EngineStartError(
            f"the engine serves target layers {served}; the drafter also needs {missing} "
            f"(start it with --target-layer-ids {','.join(map(str, sorted(set(layer_ids))))})"
        )
    engine_axis = [a - 1 for a in info["aux_layer_ids"]]  # the engine's layer axis, in order
    return [engine_axis.index(i) for i in layer_ids]


def can_read_handover(info: dict[str, Any]) -> bool:
    """Whether this process sees the engine's hand-over directory (same host, same user)."""
    try:
        token = (Path(info["handover_dir"]) / protocol.TOKEN_FILE).read_text()
    except OSError:
        return False
    return token == info["handover_token"]


def fetch_health(url: str, timeout_s: float = HEALTH_TIMEOUT_S) -> dict[str, Any]:
    parts = urllib.parse.urlsplit(url)
    conn = http.client.HTTPConnection(parts.hostname, parts.port or 80, timeout=timeout_s)
    try:
        conn.request("GET", protocol.HEALTH)
        resp = conn.getresponse()
        body = resp.read()
    except NETWORK_ERRORS as e:
        raise EngineError(f"no engine answers at {url} ({type(e).__name__}: {e})") from e
    finally:
        conn.close()
    if resp.status != 200:
        raise EngineError(f"the engine at {url} is not healthy: {_error_of(body)}")
    info = json.loads(body)
    missing = [f for f in protocol.HEALTH_FIELDS if f not in info]
    if missing:
        raise EngineError(f"{url} is not a dflash-train engine (its /health lacks {missing})")
    return info


def _error_of(body: bytes) -> str:
    try:
        return str(json.loads(body)["error"])
    except (ValueError, KeyError, TypeError):
        return body[:300].decode(errors="replace")


@dataclass
class SourceStats:
    """What one source measured (host clock), for benchmarks: batches, seconds in calls, of
    which reading the hand-over (shared memory: files into the batch tensor, then deleted), the
    engine's own seconds per batch (shared memory only), and the feature bytes received."""

    batches: int = 0
    call_s: float = 0.0
    read_s: float = 0.0
    engine_s: float = 0.0
    nbytes: int = 0


class VllmFeatureSource:
    """One target worker's `FeatureSource` on the engine: features arrive in host memory."""

    def __init__(self, target: VllmTarget) -> None:
        self.target = target
        self.device = torch.device("cpu")
        self.dtype = target.settings.dtype
        self.hidden_size = int(target.info["hidden_size"])
        self.layer_ids = list(target.settings.layer_ids)
        self._engine_dtype = DTYPES[target.info["dtype"]]
        self._engine_layers = len(target.info["aux_layer_ids"])
        self._identity = target.order == list(range(self._engine_layers))
        self._conn: http.client.HTTPConnection | None = None
        self.stats = SourceStats()

    def __call__(self, input_ids: torch.Tensor) -> torch.Tensor:
        t0 = time.perf_counter()
        rows, length = input_ids.shape
        answer, body = self._request(input_ids.tolist())
        t1 = time.perf_counter()
        num_tokens = answer["num_tokens"]
        if num_tokens != [length] * rows:
            raise EngineError(
                f"the engine returned rows of {num_tokens} tokens for {rows} x {length}"
            )
        k, h = len(self.layer_ids), self.hidden_size
        out = torch.empty(rows, length, k * h, dtype=self._engine_dtype)  # (batch, L, K * hidden)
        if body is None:
            self._read_files(answer["files"], out)
        else:
            self._read_inline(body, out)
        st, t2 = self.stats, time.perf_counter()
        st.batches, st.call_s, st.read_s = st.batches + 1, st.call_s + t2 - t0, st.read_s + t2 - t1
        st.engine_s += float(answer.get("engine_s", 0.0))
        st.nbytes += out.numel() * out.element_size()
        return out if out.dtype == self.dtype else out.to(self.dtype)

    def _read_files(self, files: list[str], out: torch.Tensor) -> None:
        """Each row's file read straight into its row of `out` (one copy), then deleted."""
        try:
            for i, path in enumerate(files):
                if self._identity:
                    read_into(path, out[i])
                else:  # (L, engine layers, hidden) -> the drafter's layers, (L, K * hidden)
                    length = out.shape[1]
                    tmp = torch.empty(
                        length, self._engine_layers, self.hidden_size, dtype=out.dtype
                    )
                    read_into(path, tmp)
                    out[i] = tmp[:, self.target.order].reshape(length, -1)
        finally:
            for path in files:
                _unlink(path)

    def _read_inline(self, body: bytes, out: torch.Tensor) -> None:
        rows, length = out.shape[:2]
        flat = torch.frombuffer(bytearray(body), dtype=out.dtype)
        states = flat.view(rows, length, self._engine_layers, self.hidden_size)
        out.copy_(states[:, :, self.target.order].reshape(rows, length, -1))

    def _request(self, rows: list[list[int]]) -> tuple[dict[str, Any], bytes | None]:
        """POST the rows; one retry on a dropped keep-alive connection, never on a time-out."""
        timeout = self.target.settings.request_timeout_s
        handover = "shm" if self.target.shared_memory else "inline"
        payload = json.dumps({"rows": rows, "handover": handover, "timeout_s": timeout}).encode()
        for attempt in (1, 2):
            try:
                return self._post(payload, timeout)
            except (ConnectionError, http.client.RemoteDisconnected) as e:
                self._close()
                if attempt == 2:
                    raise self._failure(f"dropped the connection ({type(e).__name__}: {e})") from e
            except TimeoutError as e:
                self._close()
                raise self._failure(f"sent no features within {timeout:.0f}s") from e
            except NETWORK_ERRORS as e:
                self._close()
                raise self._failure(f"failed ({type(e).__name__}: {e})") from e
        raise AssertionError("unreachable")

    def _post(self, payload: bytes, timeout: float) -> tuple[dict[str, Any], bytes | None]:
        if self._conn is None:
            parts = urllib.parse.urlsplit(self.target.url)
            # the server's own deadline is `timeout`; the socket's leaves it time to answer
            self._conn = http.client.HTTPConnection(
                parts.hostname, parts.port, timeout=timeout + 30
            )
        self._conn.request("POST", protocol.FEATURES, payload, {"Content-Type": "application/json"})
        resp = self._conn.getresponse()
        body = resp.read()
        if resp.status == 413:
            raise ValueError(f"vLLM engine: {_error_of(body)}")
        if resp.status != 200:
            raise self._failure(f"answered {resp.status}: {_error_of(body)}")
        if resp.getheader("Content-Type") == "application/octet-stream":
            counts = resp.getheader(protocol.NUM_TOKENS_HEADER) or ""
            return {"num_tokens": [int(x) for x in counts.split(",") if x]}, body
        return json.loads(body), None

    def _failure(self, what: str) -> EngineError:
        return EngineError(
            f"the vLLM engine at {self.target.url} {what}; {self.target.describe_failure()}"
        )

    def _close(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None


def read_into(path: str, out: torch.Tensor) -> None:
    """The raw bytes of the file at `path` into the contiguous tensor `out` (sizes must match)."""
    view = memoryview(out.view(torch.uint8).numpy()).cast("B")
    size = os.path.getsize(path)
    if size != len(view):
        raise EngineError(f"hand-over file {path} holds {size} bytes, expected {len(view)}")
    with open(path, "rb", buffering=0) as f:
        got = 0
        while got < len(view):
            n = f.readinto(view[got:])
            if not n:
                raise EngineError(f"hand-over file {path} ended after {got} bytes")
            got += n


def _unlink(path: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
