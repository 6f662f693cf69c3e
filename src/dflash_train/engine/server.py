"""The engine process: one vLLM engine computing a target's selected-layer hidden states, served
over HTTP (`protocol.py`) to the trainer's target workers.

    python -m dflash_train.engine.server --target DIR --target-layer-ids 1,9,17,25,33 \
        [--dtype bfloat16] [--tensor-parallel-size 2] [--max-model-len 4096] [--port 8100]

Runs in vLLM's environment and imports only the standard library, vLLM (with its torch) and this
package's stdlib-only modules. Threads:
- main: the engine loop (`jobs.py`), the only thread that touches vLLM: admits jobs (a job =
  one batch's rows, one vLLM request per row: prompt = the row's token ids, one generated
  token), steps the engine while requests are unfinished (vLLM batches the concurrent
  requests of every client), and completes a job once all its rows are finished; every
  finished row names the file the connector (`connector.py`) writes its features to;
- HTTP handlers (one per connection): validate, reserve hand-over bytes, submit, wait with a
  deadline, wait for the files, answer; a job that cannot be answered has its files deleted;
- the reaper: every REAP_EVERY_S, deletes the files nobody collected within --handover-ttl
  (`jobs.HandOverBudget.reap`);
- with --exit-with-parent: a watcher that ends the engine (and everything it started: one
  process group) when the parent's end of stdin closes, however the parent died.

Start-up failures print one line (`protocol.ERROR_PREFIX`) and exit with a code of their own:
bad flags (--engine-args setting what a flag sets), no vLLM here, a model vLLM cannot load (or no
memory for it), a port in use. A failure of the running engine fails every job in flight (500)
and ends the process. /health reports what vLLM actually runs with and the target's weights
digest (`model.digest`, standard library only), which clients check against their own target.
"""

from __future__ import annotations

import argparse
import contextlib
import http.server
import json
import os
import secrets
import shutil
import signal
import socket
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import Any

from dflash_train.engine import protocol
from dflash_train.engine.jobs import EngineLoop, HandOverBudget, Job
from dflash_train.engine.layers import vllm_aux_ids
from dflash_train.model.digest import target_weights_digest

CONNECTOR_CLASS = "DFlashHandOverConnector"
CONNECTOR_MODULE = "dflash_train.engine.connector"
FILE_WAIT_POLL_S = 0.0005  # the connector renames a complete file into place: poll its name
PARENT_GONE_GRACE_S = 30.0  # an orderly stop takes 5-10 s here (vLLM ends its processes)
STRAGGLER_GRACE_S = 5.0  # after vLLM's shutdown returned, for its processes to exit
REAP_EVERY_S = 5.0


def fail(code: int, message: str) -> None:
    """A start-up failure: one line on stderr, then exit with `code`."""
    print(protocol.ERROR_PREFIX + " ".join(message.split()), file=sys.stderr, flush=True)
    raise SystemExit(code)


# ============================================================================ HTTP


class Server(http.server.ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = False  # a port in use is an error, not shared

    def __init__(self, address: tuple[str, int], info: dict[str, Any]) -> None:
        super().__init__(address, Handler)
        self.info = info
        self.loop: EngineLoop | None = None
        self.budget = HandOverBudget(0)  # bounded once the hand-over directory is known
        self._in_flight: set[Job] = set()
        self._lock = threading.Lock()

    def begin(self, job: Job) -> None:
        with self._lock:
            self._in_flight.add(job)

    def end(self, job: Job) -> None:
        with self._lock:
            self._in_flight.discard(job)

    def files_in_flight(self) -> set[str]:
        """The files of the jobs not answered yet (the reaper leaves them alone)."""
        assert self.loop is not None
        with self._lock:
            jobs = list(self._in_flight)
        rids = [r for j in jobs for r in list(j.request_ids)]
        return set(protocol.request_files(self.loop.directory, rids))

    def reap_until(self, stop: threading.Event) -> None:
        """The reaper thread's loop (see the module docstring)."""
        while not stop.wait(REAP_EVERY_S):
            self.budget.reap(self.files_in_flight())


class Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive: one connection per target worker
    server: Server

    def log_message(self, format: str, *args: Any) -> None:
        return None  # one line per batch would drown the engine's own log

    def do_GET(self) -> None:
        if self.path != protocol.HEALTH:
            return self._json(404, {"error": f"no such path {self.path}"})
        loop = self.server.loop
        if loop is not None and loop.dead is not None:
            return self._json(500, {"error": f"the engine died: {loop.dead}"})
        self._json(200, self.server.info)

    def do_POST(self) -> None:
        if self.path != protocol.FEATURES:
            return self._json(404, {"error": f"no such path {self.path}"})
        try:
            length = int(self.headers.get("Content-Length", "0"))
            request = json.loads(self.rfile.read(length))
            rows, inline, timeout_s = self._parse(request)
        except (ValueError, KeyError, TypeError) as e:
            return self._json(400, {"error": f"bad request: {e}"})
        status, payload = self._features(rows, inline, time.monotonic() + timeout_s)
        if isinstance(payload, dict):
            try:
                return self._json(status, payload)
            except OSError:  # the client is gone: nobody will take the files
                self._remove([(p, 0) for p in payload.get("files", [])])
                self.close_connection = True
                return None
        body, num_tokens = payload
        self.send_response(200)
        self.send_header("Content-Type", "application/octet-stream")
        self.send_header("Content-Length", str(len(body)))
        self.send_header(protocol.NUM_TOKENS_HEADER, ",".join(map(str, num_tokens)))
        self.end_headers()
        self.wfile.write(body)

    def _parse(self, request: dict[str, Any]) -> tuple[list[list[int]], bool, float]:
        rows = request["rows"]
        limit = int(self.server.info["max_model_len"])
        if not isinstance(rows, list) or not rows:
            raise ValueError("rows must be a non-empty list of token id lists")
        for i, row in enumerate(rows):
            if not isinstance(row, list) or not row or not all(isinstance(t, int) for t in row):
                raise ValueError(f"row {i} is not a non-empty list of token ids")
            if len(row) >= limit:
                raise ValueError(f"row {i} has {len(row)} tokens; the engine's max_model_len "
                                 f"is {limit} (one more is generated)")  # fmt: skip
        handover = request.get("handover", "shm")
        if handover not in ("shm", "inline"):
            raise ValueError(f"handover must be shm or inline, not {handover!r}")
        return rows, handover == "inline", float(request.get("timeout_s", 600.0))

    def _features(self, rows: list[list[int]], inline: bool, deadline: float):
        info, budget, loop = self.server.info, self.server.budget, self.server.loop
        assert loop is not None
        layers, hidden = len(info["aux_layer_ids"]), int(info["hidden_size"])
        nbytes = sum(protocol.feature_bytes(len(r), layers, hidden, info["dtype"]) for r in rows)
        if nbytes > budget.bound:
            return 413, {"error": f"a batch of {nbytes} feature bytes exceeds "
                         f"{protocol.describe_bound(info)}"}  # fmt: skip
        if not budget.reserve(nbytes, deadline):
            return 503, {"error": f"the hand-over directory {info['handover_dir']} still held "
                         f"{budget.in_use()} bytes not collected at the deadline (bound "
                         f"{budget.bound}; a client that died? they are deleted after "
                         f"{budget.ttl_s:.0f} s, --handover-ttl)"}  # fmt: skip
        job = Job(rows)
        self.server.begin(job)
        try:
            return self._run(job, nbytes, inline, deadline)
        finally:
            self.server.end(job)

    def _run(self, job: Job, nbytes: int, inline: bool, deadline: float):
        budget, loop = self.server.budget, self.server.loop
        assert loop is not None
        t0 = time.monotonic()
        loop.submit(job)
        if not job.done.wait(timeout=max(0.0, deadline - time.monotonic())):
            loop.abandon(job)  # its rows aborted, its files deleted
            budget.release(nbytes)
            return 504, {"error": "no features by the request's deadline"}
        files = [f for f in job.files if f is not None]
        if job.error is not None or not self._wait_for_files(files, deadline):
            self._remove(files)
            budget.release(nbytes)
            status, message = job.error or (504, "the features' files did not appear in time")
            return status, {"error": message}
        paths, num_tokens = [p for p, _ in files], [n for _, n in files]
        engine_s = time.monotonic() - t0  # queued, computed and written by the connector
        if not inline:
            budget.hand(paths, nbytes)
            return 200, {"files": paths, "num_tokens": num_tokens, "engine_s": engine_s}
        try:
            body = b"".join(Path(p).read_bytes() for p in paths)
        finally:
            self._remove(files)
            budget.release(nbytes)
        return 200, (body, num_tokens)

    @staticmethod
    def _wait_for_files(files: list[tuple[str, int]], deadline: float) -> bool:
        for path, _ in files:
            while not os.path.exists(path):
                if time.monotonic() > deadline:
                    return False
                time.sleep(FILE_WAIT_POLL_S)
        return True

    @staticmethod
    def _remove(files: list[tuple[str, int]]) -> None:
        for path, _ in files:
            for p in (path, path + ".part"):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(p)

    def _json(self, status: int, payload: dict[str, Any]) -> None:
        body = json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


# ============================================================================ start-up


def build_parser() -> argparse.ArgumentParser:
    """The server's flags (also what the docs' reference lists)."""
    p = argparse.ArgumentParser(prog="python -m dflash_train.engine.server", description=__doc__)
    p.add_argument("--target", required=True, help="the target model directory (or HF id)")
    p.add_argument(
        "--target-layer-ids",
        required=True,
        help="DFlash target layer ids the drafter reads, comma separated (the drafter's "
        "target_layer_ids; the engine asks vLLM for aux ids i + 1)",
    )
    p.add_argument("--dtype", default="bfloat16", choices=sorted(protocol.ITEMSIZE))
    p.add_argument("--tensor-parallel-size", type=int, default=1)
    p.add_argument("--max-model-len", type=int, default=4096)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8100, help="0: any free port")
    p.add_argument(
        "--handover-dir",
        default=None,
        help="memory-backed directory for the hand-over (default: a new one under /dev/shm)",
    )
    p.add_argument(
        "--handover-bytes",
        type=int,
        default=8 << 30,
        help="bound of the feature bytes in that directory (at most 90%% of its free space)",
    )
    p.add_argument(
        "--handover-ttl",
        type=float,
        default=60.0,
        help="seconds after which files in that directory nobody collected are deleted (a "
        "client that died, rows of aborted batches)",
    )
    p.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs / compilation")
    p.add_argument(
        "--engine-args", default=None, help="more vLLM EngineArgs as a JSON object"
    )  # fmt: skip
    p.add_argument("--ready-file", default=None, help="write the health JSON here once ready")
    p.add_argument(
        "--exit-with-parent",
        action="store_true",
        help="end the engine when stdin closes (the launcher keeps it open while it lives)",
    )
    return p


def parse_args(argv: list[str]) -> argparse.Namespace:
    args = build_parser().parse_args(argv)
    try:
        args.layer_ids = [int(x) for x in args.target_layer_ids.split(",") if x.strip()]
        args.more = json.loads(args.engine_args) if args.engine_args else {}
    except ValueError as e:
        fail(protocol.EXIT_BAD_ARGS, f"bad --target-layer-ids or --engine-args: {e}")
    if not args.layer_ids or min(args.layer_ids) < 0:
        fail(protocol.EXIT_BAD_ARGS, f"bad --target-layer-ids {args.target_layer_ids!r}")
    if not isinstance(args.more, dict):
        fail(protocol.EXIT_BAD_ARGS, "--engine-args must be a JSON object")
    if (problem := protocol.engine_args_problem(args.more)) is not None:
        fail(protocol.EXIT_BAD_ARGS, problem)
    if args.handover_ttl <= 0:
        fail(protocol.EXIT_BAD_ARGS, f"--handover-ttl must be > 0, got {args.handover_ttl}")
    return args


def bind(host: str, port: int, info: dict[str, Any]) -> Server:
    try:
        return Server((host, port), info)
    except OSError as e:
        fail(protocol.EXIT_PORT_IN_USE, f"cannot listen on {host}:{port} ({e.strerror}): "
             "the port is in use or not allowed; pick another --port")  # fmt: skip
    raise AssertionError  # unreachable: fail() raises


def handover_dir(given: str | None) -> tuple[Path, int, bool]:
    """The hand-over directory, this process's hold on it (`protocol.hold_handover_dir`) and
    whether this process made it (and so removes it)."""
    if given:
        path = Path(given)
        path.mkdir(parents=True, exist_ok=True)
        return path, protocol.hold_handover_dir(path), False
    path, fd = protocol.new_handover_dir()
    return path, fd, True


def build_engine(args: argparse.Namespace, directory: Path) -> tuple[Any, str]:
    """vLLM's engine with hidden-state extraction and this package's connector."""
    try:
        import vllm
        from vllm.engine.arg_utils import EngineArgs
        from vllm.v1.engine.llm_engine import LLMEngine
    except ImportError as e:
        fail(protocol.EXIT_NO_VLLM, f"no working vLLM in {sys.executable}'s environment: {e}")
    aux = vllm_aux_ids(args.layer_ids)
    settings: dict[str, Any] = dict(
        model=args.target,
        dtype=args.dtype,
        tensor_parallel_size=args.tensor_parallel_size,
        max_model_len=args.max_model_len,
        skip_tokenizer_init=True,
        enable_prefix_caching=False,  # every row computed, never read back from a cache
        enforce_eager=args.enforce_eager,
        seed=0,
        speculative_config={
            "method": "extract_hidden_states",
            "num_speculative_tokens": 1,
            "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": aux}},
        },
    )
    settings.update(args.more)
    from vllm.config import KVTransferConfig

    settings["kv_transfer_config"] = KVTransferConfig(
        kv_connector=CONNECTOR_CLASS,
        kv_connector_module_path=CONNECTOR_MODULE,
        kv_role="kv_producer",
        kv_connector_extra_config={"handover_dir": str(directory)},
    )
    try:
        engine = LLMEngine.from_engine_args(EngineArgs(**settings))
    except Exception as e:  # vLLM raises many kinds here; the user needs the last line
        traceback.print_exc()
        fail(protocol.EXIT_CANNOT_LOAD, f"vLLM cannot start on {args.target}: {_last_line(e)}")
    return engine, vllm.__version__


def _last_line(e: BaseException) -> str:
    """The line of an exception that says what went wrong (pydantic ends with a web link)."""
    while e.__cause__ is not None:
        e = e.__cause__
    text = [x.strip() for x in str(e).strip().splitlines()]
    text = [x for x in text if x and not x.startswith("For further information")]
    return f"{type(e).__name__}: {text[-1] if text else ''}"[:400]


def running_config(engine: Any) -> dict[str, Any]:
    """What vLLM actually runs with, as /health reports it."""
    model, parallel = engine.vllm_config.model_config, engine.vllm_config.parallel_config
    return {
        "hidden_size": int(model.get_hidden_size()),
        "dtype": str(model.dtype).removeprefix("torch."),
        "max_model_len": int(model.max_model_len),
        "tensor_parallel_size": int(parallel.tensor_parallel_size),
    }


def weights_digest(target: str) -> tuple[str | None, str | None]:
    """(the digest of `target`'s weights, None) or (None, why it cannot be read): a local
    directory, or a hub id's snapshot in the local cache (vLLM downloaded it there)."""
    path = target
    if not os.path.isdir(path):
        try:
            from huggingface_hub import snapshot_download

            path = snapshot_download(target, local_files_only=True)
        except Exception as e:  # not a hub id, not cached, no hub library: say which
            return None, f"{target} is not a local directory ({type(e).__name__}: {e})"[:300]
    try:
        return target_weights_digest(path), None
    except (OSError, ValueError) as e:
        return None, str(e)[:300]


def write_ready(path: str | None, info: dict[str, Any]) -> None:
    print(protocol.READY_PREFIX + json.dumps(info), flush=True)
    if path:
        tmp = f"{path}.tmp"
        Path(tmp).write_text(json.dumps(info) + "\n")
        os.replace(tmp, path)  # the launcher never reads half a file


PARENT_GONE = threading.Event()
"""Set by `watch_parent` when the launcher is gone: nobody else will remove what it owned."""


def watch_parent(directory: Path) -> None:
    """Until stdin closes (the launcher died or let go): then stop as on SIGTERM (`main` then
    removes the hand-over directory, the launcher that owns it being gone), and if that has not
    ended the process group in time, remove the directory and kill the whole group."""

    def watch() -> None:
        # os.read on the raw descriptor: a daemon thread blocked in sys.stdin's buffered reader
        # holds its lock and aborts the interpreter's shutdown.
        try:
            while os.read(sys.stdin.fileno(), 4096):
                pass
        except OSError:
            pass
        print("dflash-engine: the trainer is gone; stopping", file=sys.stderr, flush=True)
        PARENT_GONE.set()
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(PARENT_GONE_GRACE_S)
        shutil.rmtree(directory, ignore_errors=True)
        os.killpg(os.getpgrp(), signal.SIGKILL)  # vLLM's engine core and workers with us

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    # SIGTERM leaves any wait (a hung step included) as SystemExit, so the engine is shut down
    # in order below: vLLM then removes its own shared memory and stops its processes.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    directory, hold, owned = handover_dir(args.handover_dir)
    try:
        info: dict[str, Any] = {"pid": os.getpid(), "handover_dir": str(directory)}
        server = bind(args.host, args.port, info)
        if args.exit_with_parent:
            watch_parent(directory)
        return serve(args, server, directory, info)
    finally:
        if owned or PARENT_GONE.is_set():  # a launcher that died removes nothing
            protocol.remove_handover_dir(directory, hold)
        else:  # the launcher's (or the user's): it removes it after us
            os.close(hold)
        if PARENT_GONE.is_set():
            end_stragglers()


def end_stragglers(grace_s: float = STRAGGLER_GRACE_S) -> None:
    """With the launcher gone, after vLLM was shut down in order: what is left of this
    process's group (an engine core or worker that did not exit) is killed and the shared
    memory it mapped removed, as the launcher's `EngineProcess.stop` would have done. Only
    when this process leads its group (the launcher starts it so): never another's group."""
    me = os.getpid()
    if os.getpgrp() != me:
        return
    deadline = time.monotonic() + grace_s
    while left := [p for p in protocol.live_group_members(me) if p != me]:
        if time.monotonic() > deadline:
            break
        time.sleep(0.1)
    if not left:
        return
    held = protocol.mapped_shared_memory(left)
    print(f"dflash-engine: killing engine processes {left} that did not stop", file=sys.stderr)
    for pid in left:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    for path in held:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)


def serve(args: argparse.Namespace, server: Server, directory: Path, info: dict[str, Any]) -> int:
    token = secrets.token_hex(16)
    (directory / protocol.TOKEN_FILE).write_text(token)
    engine, version = build_engine(args, directory)
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    host, port = server.server_address[:2]
    digest, unreadable = weights_digest(args.target)
    info.update(
        target=args.target,
        weights_digest=digest,
        target_layer_ids=args.layer_ids,
        aux_layer_ids=vllm_aux_ids(args.layer_ids),
        **running_config(engine),
        vllm_version=version,
        handover_token=token,
        handover_bytes=handover_bound(args, directory),
        handover_ttl_s=args.handover_ttl,
        url=f"http://{socket.getfqdn() if host == '0.0.0.0' else host}:{port}",
    )
    if unreadable:
        info["weights_digest_error"] = unreadable
    server.budget = HandOverBudget(info["handover_bytes"], str(directory), args.handover_ttl)
    sampling = SamplingParams(max_tokens=1, temperature=0.0, detokenize=False)
    server.loop = EngineLoop(engine, sampling, TokensPrompt, str(directory))
    stop = threading.Event()
    threading.Thread(target=server.serve_forever, name="http", daemon=True).start()
    threading.Thread(target=server.reap_until, args=(stop,), name="reaper", daemon=True).start()
    write_ready(args.ready_file, info)
    try:
        server.loop.run(stop)
    except Exception:
        traceback.print_exc()
        print(f"dflash-engine: the engine died: {server.loop.dead}", file=sys.stderr, flush=True)
        time.sleep(0.5)  # let the handlers answer their jobs' failures
        return protocol.EXIT_ENGINE_DIED
    finally:
        stop.set()
        server.shutdown()
        engine.engine_core.shutdown()
    return 0


def handover_bound(args: argparse.Namespace, directory: Path) -> int:
    """--handover-bytes, at most `protocol.FREE_SPACE_SHARE` of the directory's free space
    (said in one line when that is less: a container's /dev/shm is 64 MB unless given more)."""
    free = shutil.disk_usage(directory).free
    bound = min(args.handover_bytes, int(free * protocol.FREE_SPACE_SHARE))
    if bound < args.handover_bytes:
        print(
            f"dflash-engine: warning: the hand-over directory {directory} has {free} bytes free, "
            f"so the hand-over bound is {bound} bytes, not --handover-bytes "
            f"{args.handover_bytes} (a larger /dev/shm: docker run --shm-size; or --handover-dir "
            "on another memory-backed filesystem)",
            file=sys.stderr,
            flush=True,
        )
    return bound


if __name__ == "__main__":  # vLLM spawns its engine process: the guard is required
    raise SystemExit(main(sys.argv[1:]))
