"""The target on a vLLM engine as the pipeline sees it: a `FeatureSource` per target worker.

`open_engines(settings, endpoints)` starts the engine (`process.EngineProcess`) or reaches each
one already running (`--target-endpoint`), and checks that each serves this run's target (the
same weights digest and hidden size), the layers the drafter needs, a long enough context and a
hand-over bound that holds the run's largest batch: one line each otherwise. `target.source()`
is one target worker's connection, `source(input_ids)` -> (batch, L, K * hidden) features on
the host, in the drafter's layer order, equal to what the `hf` source
(`model.target.TargetFeatureExtractor`) returns for the same rows (fp32 on CPU: max abs
difference ~4e-6). Several sources share one engine and keep it busy: vLLM batches their
concurrent requests. `close()` stops an engine it started. Nothing here needs the trainer: an
offline feature store builds the same object from the same settings.

A source given the dataset's row lengths (`target.source(lengths)`, `features_of(job)`) sends
each row's own tokens only and pads the features back with zeros: features at padded positions
are never read (the drafter's context and the feature store take a row's own positions only),
and a causal target's features at a row's own positions do not depend on what follows. Without
them (`source(input_ids)`) rows are sent whole, padding included.
Features travel through the engine's memory-backed hand-over directory when the engine runs on
this host (the files are read straight into the batch tensor and deleted at once), else inline
in the HTTP answer.
"""

from __future__ import annotations

import contextlib
import dataclasses
import http.client
import json
import os
import time
import urllib.parse
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from dflash_train.engine import protocol
from dflash_train.engine.layers import vllm_aux_ids
from dflash_train.engine.process import EngineError, EngineProcess, EngineSpec, EngineStartError
from dflash_train.model.digest import target_weights_digest

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
    """URL of an engine already running; None: start one (`open_engines` sets it per URL)."""
    hidden_size: int | None = None
    """The target's hidden size (checked against the engine's; None: the digest covers it)."""
    largest_batch_tokens: int | None = None
    """Padded tokens of the run's largest batch: the engine's hand-over bound must hold their
    features at once (None: not checked)."""
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
        hidden_size: int | None = None,
        largest_batch_tokens: int | None = None,
    ) -> VllmTargetSettings:
        """From `config.EngineOptions` (the engine section of a train config); its endpoints
        are `open_engines`' to reach."""
        import sys

        gpus = sorted({d.index or 0 for d in devices if d.type == "cuda"})
        if gpus and len(gpus) != options.target_tp:
            raise ValueError(
                f"--target-tp {options.target_tp}: the engine splits the target over "
                f"{options.target_tp} GPUs, and --target-devices names {len(gpus)} ({gpus})"
            )
        if (problem := protocol.engine_args_problem(options.engine_args_dict)) is not None:
            raise ValueError(problem)
        return cls(
            target=target,
            layer_ids=list(layer_ids),
            dtype=dtype,
            max_model_len=max_model_len,
            request_timeout_s=request_timeout_s,
            hidden_size=hidden_size,
            largest_batch_tokens=largest_batch_tokens,
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


def largest_batch_tokens(batch_size: int, batch_tokens: int | None, longest: int) -> int:
    """A bound on the padded tokens of any batch the pipeline's batching cuts: `batch_size` rows
    of the longest bucket, or with a token budget, that budget (at least one longest row)."""
    return max(longest, batch_tokens or batch_size * longest)


def open_engines(
    settings: VllmTargetSettings,
    endpoints: Sequence[str] | None,
    say: Callable[[str], None] = print,
) -> list[VllmTarget]:
    """Each engine at `endpoints` (--target-endpoint), or one started here when there is none,
    each checked (`VllmTarget.check`); on a failure those opened already are closed."""
    engines: list[VllmTarget] = []
    try:
        for url in endpoints or [None]:
            engine = VllmTarget.open(dataclasses.replace(settings, endpoint=url), say)
            engines.append(engine)
            say(engine.describe())
    except BaseException:
        for engine in engines:
            engine.close()
        raise
    return engines


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
        self._check_target(settings)
        if int(info["max_model_len"]) < settings.max_model_len:
            raise EngineStartError(
                f"the engine at {self.url} serves rows of up to {info['max_model_len']} tokens; "
                f"this run needs {settings.max_model_len} (start it with --max-model-len "
                f"{settings.max_model_len})"
            )
        if info["dtype"] not in DTYPES:
            raise EngineStartError(f"the engine at {self.url} computes in {info['dtype']}")
        self._check_bound(settings)

    def _check_target(self, settings: VllmTargetSettings) -> None:
        """The engine computes this run's target: the same hidden size and weights digest."""
        info, url = self.info, self.url
        hidden = int(info["hidden_size"])
        if settings.hidden_size is not None and hidden != settings.hidden_size:
            raise EngineStartError(
                f"the engine at {url} serves {info['target']} of hidden size {hidden}; this run's "
                f"--target {settings.target} has hidden size {settings.hidden_size}"
            )
        served = info["weights_digest"]
        if served is None:
            raise EngineStartError(
                f"the engine at {url} cannot tell which weights it serves "
                f"({info.get('weights_digest_error', 'no digest')}): start it with --target "
                f"a local directory of this run's target, {settings.target}"
            )
        mine = target_weights_digest(settings.target)
        if served != mine:
            raise EngineStartError(
                f"the engine at {url} serves other weights than this run's --target "
                f"{settings.target} (it serves {info['target']}, weights digest {served[:12]}; "
                f"this target's is {mine[:12]}): start the engine on this run's target"
            )

    def _check_bound(self, settings: VllmTargetSettings) -> None:
        """The engine's hand-over bound holds the run's largest batch (a container's 64 MB
        /dev/shm does not): else every batch would be refused."""
        if settings.largest_batch_tokens is None:
            return
        info = self.info
        need = protocol.feature_bytes(
            settings.largest_batch_tokens,
            len(info["aux_layer_ids"]),
            int(info["hidden_size"]),
            info["dtype"],
        )
        if need > int(info["handover_bytes"]):
            raise EngineStartError(
                f"this run's largest batch ({settings.largest_batch_tokens} tokens) needs {need} "
                f"bytes of features at once, more than {protocol.describe_bound(info)}; or "
                "smaller batches (--batch-size, --batch-tokens)"
            )

    def source(self, lengths: np.ndarray | None = None) -> VllmFeatureSource:
        """A new feature source (one per target worker: each holds its own connection);
        `lengths`: the dataset's row lengths by row id (then it sends only a row's own
        tokens)."""
        return VllmFeatureSource(self, lengths)

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

    def __init__(self, target: VllmTarget, lengths: np.ndarray | None = None) -> None:
        self.target = target
        self.device = torch.device("cpu")
        self.dtype = target.settings.dtype
        self.hidden_size = int(target.info["hidden_size"])
        self.layer_ids = list(target.settings.layer_ids)
        self.lengths = lengths
        """The dataset's row lengths by row id (`features_of`), or None."""
        self._engine_dtype = DTYPES[target.info["dtype"]]
        self._engine_layers = len(target.info["aux_layer_ids"])
        self._identity = target.order == list(range(self._engine_layers))
        self._conn: http.client.HTTPConnection | None = None
        self.stats = SourceStats()

    def features_of(self, job: Any) -> torch.Tensor:
        """A pipeline job's features (`job.input_ids`, (batch, L)), computed on each row's own
        tokens only when this source knows the rows' lengths (`job.seq_ids` index them)."""
        if self.lengths is None:
            return self(job.input_ids)
        length = job.input_ids.shape[1]
        own = [min(int(self.lengths[sid]), length) for sid in job.seq_ids]
        return self(job.input_ids, own)

    def __call__(self, input_ids: torch.Tensor, lengths: list[int] | None = None) -> torch.Tensor:
        """(batch, L) token ids -> (batch, L, K * hidden) features; with `lengths`, row i's
        first lengths[i] tokens are sent and its features past them are zeros."""
        t0 = time.perf_counter()
        rows, length = input_ids.shape
        own = lengths or [length] * rows
        answer, body = self._request([r[:n] for r, n in zip(input_ids.tolist(), own, strict=True)])
        t1 = time.perf_counter()
        if answer["num_tokens"] != own:
            raise EngineError(
                f"the engine returned rows of {answer['num_tokens']} tokens, not {own}"
            )
        k, h = len(self.layer_ids), self.hidden_size
        out = torch.empty(rows, length, k * h, dtype=self._engine_dtype)  # (batch, L, K * hidden)
        for i, n in enumerate(own):
            out[i, n:] = 0  # padded positions: never read
        if body is None:
            self._read_files(answer["files"], own, out)
        else:
            self._read_inline(body, own, out)
        st, t2 = self.stats, time.perf_counter()
        st.batches, st.call_s, st.read_s = st.batches + 1, st.call_s + t2 - t0, st.read_s + t2 - t1
        st.engine_s += float(answer.get("engine_s", 0.0))
        st.nbytes += sum(own) * k * h * out.element_size()
        return out if out.dtype == self.dtype else out.to(self.dtype)

    def _read_files(self, files: list[str], own: list[int], out: torch.Tensor) -> None:
        """Each row's file read straight into its row of `out` (one copy), then deleted."""
        try:
            for i, (path, n) in enumerate(zip(files, own, strict=True)):
                if self._identity:
                    self._read_file(path, out[i, :n])
                else:  # (n, engine layers, hidden) -> the drafter's layers, (n, K * hidden)
                    tmp = torch.empty(n, self._engine_layers, self.hidden_size, dtype=out.dtype)
                    self._read_file(path, tmp)
                    out[i, :n] = tmp[:, self.target.order].reshape(n, -1)
        finally:
            for path in files:
                _unlink(path)

    def _read_file(self, path: str, into: torch.Tensor) -> None:
        try:
            read_into(path, into)
        except FileNotFoundError:
            raise EngineError(
                f"hand-over file {path} is gone: the engine at {self.target.url} deletes files "
                f"not collected within {self.target.info['handover_ttl_s']} s (--handover-ttl)"
            ) from None

    def _read_inline(self, body: bytes, own: list[int], out: torch.Tensor) -> None:
        flat = torch.frombuffer(bytearray(body), dtype=out.dtype)
        per_token = self._engine_layers * self.hidden_size
        start = 0
        for i, n in enumerate(own):  # rows one after the other, (n, engine layers, hidden)
            states = flat[start : start + n * per_token].view(n, self._engine_layers, -1)
            out[i, :n] = states[:, self.target.order].reshape(n, -1)
            start += n * per_token

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
