"""The prepared dataset: tokenised conversations with assistant-only loss masks, memory-mapped.

On disk (a directory; no pickle anywhere):
  input_ids.npy   int32, all rows concatenated
  loss_mask.npy   uint8, same length (1 = assistant token, supervised)
  offsets.npy     int64, num_rows + 1 row boundaries
  summary.json    counts, length histogram, the settings that produced it (for caching)

Row i is `input_ids[offsets[i]:offsets[i + 1]]`. Its index i is the sequence's stable id, used by
the pipeline's exactly-once accounting.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np

from dflash_train.objective import valid_anchor_counts

FORMAT_VERSION = 1
FILES = ("input_ids.npy", "loss_mask.npy", "offsets.npy", "summary.json")


def _damaged(file: Path, what: str) -> str:
    return (
        f"prepared dataset file {file} is damaged: {what}; "
        "re-run `dflash-train prepare` with --overwrite"
    )


def _load_array(file: Path, *, mmap: bool) -> np.ndarray:
    """One .npy of a prepared dataset; a damaged file is one line naming it (not numpy's words)."""
    try:
        arr = np.load(file, mmap_mode="r" if mmap else None, allow_pickle=False)
    except PermissionError as e:
        raise ValueError(f"cannot read prepared dataset file {file}: permission denied") from e
    except (ValueError, OSError, EOFError) as e:
        why = str(e).split(". ")[0].rstrip(".")
        what = "not a .npy array" if "pickled" in why else f"not a readable .npy array ({why})"
        raise ValueError(_damaged(file, what)) from e
    if not isinstance(arr, np.ndarray) or arr.ndim != 1:
        raise ValueError(_damaged(file, "not a one-dimensional array"))
    return arr


class PreparedDataset:
    """Read-only view of a prepared dataset directory (memory-mapped arrays)."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        if not self.path.is_dir():
            raise ValueError(
                f"prepared dataset {self.path} does not exist (run `dflash-train prepare` first)"
            )
        missing = [f for f in FILES if not (self.path / f).is_file()]
        if missing:
            raise ValueError(f"{self.path} is not a prepared dataset: missing {missing}")
        summary_file = self.path / "summary.json"
        try:
            summary = json.loads(summary_file.read_text())
        except (ValueError, UnicodeDecodeError) as e:
            raise ValueError(_damaged(summary_file, f"not valid JSON ({e})")) from e
        if not isinstance(summary, dict):
            raise ValueError(_damaged(summary_file, "not a JSON object"))
        self.summary: dict[str, Any] = summary
        self.input_ids = _load_array(self.path / "input_ids.npy", mmap=True)
        self.loss_mask = _load_array(self.path / "loss_mask.npy", mmap=True)
        self.offsets = _load_array(self.path / "offsets.npy", mmap=False)
        offsets = self.offsets
        if (
            offsets.ndim != 1
            or len(offsets) == 0
            or not np.issubdtype(offsets.dtype, np.integer)
            or offsets[0] != 0
            or np.any(np.diff(offsets) < 0)
        ):
            bounds = "its row boundaries do not start at 0 and ascend"
            raise ValueError(_damaged(self.path / "offsets.npy", bounds))
        if len(self.input_ids) != len(self.loss_mask) or offsets[-1] != len(self.input_ids):
            raise ValueError(_damaged(self.path, "its arrays disagree in length"))
        self.lengths = np.diff(self.offsets)
        self._anchor_counts: np.ndarray | None = None

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def anchor_counts(self) -> np.ndarray:
        """Valid anchor positions per row (the objective's rule), computed once."""
        if self._anchor_counts is None:
            self._anchor_counts = valid_anchor_counts(self.loss_mask, self.offsets)
        return self._anchor_counts

    def identity(self) -> str:
        """A digest that changes when the rows do: the prepare fingerprint (inputs, tokenizer,
        settings) when there is one, with the row lengths and token counts."""
        h = hashlib.sha256(np.ascontiguousarray(self.offsets).tobytes())
        for key in ("fingerprint", "num_tokens", "num_supervised_tokens"):
            h.update(f"{key}={self.summary.get(key)};".encode())
        return h.hexdigest()

    def chat_thinking(self) -> str | None:
        """The chat mode `prepare` rendered the rows in: "on" / "off" (enable_thinking passed to
        the template), "default" (the template's own default), None if not recorded."""
        settings = self.summary.get("settings")
        if not isinstance(settings, dict) or "enable_thinking" not in settings:
            return None
        return thinking_mode(settings["enable_thinking"])

    def chat_template_file(self) -> str | None:
        """The `--chat-template FILE` `prepare` rendered the rows with; None for the
        tokenizer's own template (or a dataset that does not record it)."""
        settings = self.summary.get("settings")
        named = settings.get("chat_template") if isinstance(settings, dict) else None
        return None if named in (None, "tokenizer") else str(named)

    def row(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        """(input_ids int32, loss_mask uint8) of row i, as memory-mapped views."""
        lo, hi = self.offsets[i], self.offsets[i + 1]
        return self.input_ids[lo:hi], self.loss_mask[lo:hi]


def thinking_mode(enable_thinking: bool | None) -> str:
    """enable_thinking as passed to a chat template -> "on", "off" or "default" (not passed)."""
    return "default" if enable_thinking is None else ("on" if enable_thinking else "off")


def thinking_flag(mode: str | None) -> bool | None:
    """The inverse: "on" / "off" -> True / False; "default" or unknown -> None (not passed)."""
    return {"on": True, "off": False}.get(mode or "")


def length_histogram(lengths: np.ndarray) -> dict[str, int]:
    """Counts per power-of-two length range, e.g. {"65-128": 10}."""
    hist: dict[str, int] = {}
    for n in np.asarray(lengths):
        hi = 1 << max(0, int(n - 1).bit_length())
        key = f"{hi // 2 + 1}-{hi}"
        hist[key] = hist.get(key, 0) + 1
    return dict(sorted(hist.items(), key=lambda kv: int(kv[0].split("-")[1])))


def write_prepared(
    out_dir: str | Path,
    rows: Iterable[tuple[np.ndarray, np.ndarray]],
    extra_summary: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Write rows atomically (to a temporary sibling, then rename); returns the summary."""
    out = Path(out_dir)
    tmp = out.with_name(out.name + ".tmp")
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    ids_parts, mask_parts, lengths = [], [], []
    for ids, mask in rows:
        ids = np.asarray(ids, dtype=np.int32)
        mask = np.asarray(mask, dtype=np.uint8)
        assert ids.shape == mask.shape and ids.ndim == 1
        ids_parts.append(ids)
        mask_parts.append(mask)
        lengths.append(len(ids))
    lengths_a = np.asarray(lengths, dtype=np.int64)
    offsets = np.zeros(len(lengths) + 1, dtype=np.int64)
    np.cumsum(lengths_a, out=offsets[1:])
    all_ids = np.concatenate(ids_parts) if ids_parts else np.zeros(0, np.int32)
    all_mask = np.concatenate(mask_parts) if mask_parts else np.zeros(0, np.uint8)
    np.save(tmp / "input_ids.npy", all_ids)
    np.save(tmp / "loss_mask.npy", all_mask)
    np.save(tmp / "offsets.npy", offsets)
    summary = {
        "format_version": FORMAT_VERSION,
        "num_rows": len(lengths),
        "num_tokens": int(lengths_a.sum()),
        "num_supervised_tokens": int(all_mask.sum()),
        "max_length": int(lengths_a.max()) if len(lengths_a) else 0,
        "length_histogram": length_histogram(lengths_a),
        **(extra_summary or {}),
    }
    (tmp / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    if out.exists():
        shutil.rmtree(out)
    os.replace(tmp, out)
    return summary
