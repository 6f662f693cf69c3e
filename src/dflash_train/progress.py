"""Live progress for long commands: a bar on a terminal, one compact line per interval otherwise."""

from __future__ import annotations

import sys
import time
from typing import Any, TextIO


class Progress:
    """`update(n, **fields)` advances by n and shows fields (loss=..., tok/s=...).

    On a TTY this is a tqdm bar with ETA; when output is not a terminal (CI, log files) it prints
    at most one line every `interval_s` seconds, plus a final line on `close()`.
    """

    def __init__(
        self,
        total: int | None,
        desc: str,
        *,
        stream: TextIO | None = None,
        interval_s: float = 10.0,
        enabled: bool = True,
        unit: str = "it",
    ) -> None:
        self.stream = stream or sys.stderr
        self.total, self.desc, self.unit = total, desc, unit
        self.interval_s, self.enabled = interval_s, enabled
        self.count = 0
        self.fields: dict[str, Any] = {}
        self._start = self._last = time.monotonic()
        self._bar = None
        if enabled and getattr(self.stream, "isatty", lambda: False)():
            from tqdm import tqdm

            self._bar = tqdm(
                total=total, desc=desc, file=self.stream, unit=unit, dynamic_ncols=True
            )

    def update(self, n: int = 1, **fields: Any) -> None:
        self.count += n
        self.fields.update(fields)
        if not self.enabled:
            return
        if self._bar is not None:
            self._bar.update(n)
            if fields:
                self._bar.set_postfix({k: _fmt(v) for k, v in self.fields.items()}, refresh=False)
            return
        now = time.monotonic()
        if now - self._last >= self.interval_s:
            self._last = now
            self._line()

    @property
    def interactive(self) -> bool:
        """True when a live bar is shown (a terminal)."""
        return self._bar is not None

    def set_fields(self, **fields: Any) -> None:
        """Replace the fields shown beside the bar without advancing it."""
        self.fields.update(fields)
        if self._bar is not None:
            self._bar.set_postfix({k: _fmt(v) for k, v in self.fields.items()}, refresh=True)

    def note(self, text: str) -> None:
        """Print a line without breaking the bar."""
        if not self.enabled:
            return
        if self._bar is not None:
            self._bar.write(text, file=self.stream)
        else:
            print(text, file=self.stream, flush=True)

    def _line(self) -> None:
        elapsed = time.monotonic() - self._start
        done = f"{self.count}/{self.total}" if self.total else f"{self.count}"
        eta = ""
        if self.total and self.count:
            eta = f" eta {max(0.0, elapsed / self.count * (self.total - self.count)):.0f}s"
        extra = " ".join(f"{k}={_fmt(v)}" for k, v in self.fields.items())
        print(
            f"[{self.desc}] {done} {self.unit} {elapsed:.0f}s{eta} {extra}".rstrip(),
            file=self.stream,
            flush=True,
        )

    def close(self) -> None:
        if not self.enabled:
            return
        if self._bar is not None:
            self._bar.close()
            self._bar = None
        else:
            self._line()

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    return str(v)
