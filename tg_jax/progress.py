"""Progress display for training loops: a tqdm bar on a terminal, periodic lines in CI logs.

On a TTY the bar shows ETA and a few chosen metrics; when the stream is not a TTY (CI, log
files) a plain line is printed every ``log_every`` steps and at the end instead; ``enabled=False``
prints nothing::

    with ProgressBar(num_steps, initial=start, keys=("loss", "pass_rate")) as bar:
        for step in range(start, num_steps):
            ...
            bar.update(step + 1, host_metrics)   # host metrics, e.g. from LaggedMetrics.push
"""

from __future__ import annotations

import sys
import time
from collections.abc import Mapping, Sequence
from typing import Any, TextIO


def format_duration(seconds: float) -> str:
    """Compact duration: ``45s``, ``3m05s``, ``2h07m``."""
    seconds = max(0, int(round(seconds)))
    if seconds < 60:
        return f"{seconds}s"
    if seconds < 3600:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds // 3600}h{(seconds % 3600) // 60:02d}m"


def format_value(value: Any) -> str:
    """Short form of a metric value for one log line."""
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


class ProgressBar:
    """Step progress with ETA and key metrics; tqdm on a TTY, plain lines otherwise."""

    def __init__(
        self,
        total: int,
        *,
        initial: int = 0,
        keys: Sequence[str] = (),
        desc: str = "train",
        enabled: bool = True,
        log_every: int = 100,
        stream: TextIO | None = None,
        use_tqdm: bool | None = None,
    ):
        """Args:
        total: last step number.
        initial: step the loop starts from (after a resume); ETA counts only new steps.
        keys: metric names shown next to the bar / in each line.
        desc: label (e.g. the stage).
        enabled: False prints nothing at all.
        log_every: in line mode, print every this many steps.
        stream: where to write (default stderr).
        use_tqdm: force the bar on or off; default: only if ``stream`` is a TTY.
        """
        self.total = total
        self.keys = tuple(keys)
        self.desc = desc
        self.enabled = enabled
        self.log_every = max(1, log_every)
        self.stream = stream if stream is not None else sys.stderr
        self._initial = self._step = initial
        self._start = time.monotonic()
        self._metrics: dict[str, Any] = {}
        self._last_printed: int | None = None
        if use_tqdm is None:
            use_tqdm = bool(getattr(self.stream, "isatty", lambda: False)())
        self._bar = None
        if enabled and use_tqdm:
            from tqdm import tqdm

            self._bar = tqdm(
                total=total, initial=initial, desc=desc, file=self.stream, dynamic_ncols=True
            )

    def update(self, step: int, metrics: Mapping[str, Any] | None = None) -> None:
        """Moves to ``step`` (completed steps) and shows ``metrics``' key values if given."""
        if metrics:
            self._metrics.update({k: metrics[k] for k in self.keys if k in metrics})
        previous, self._step = self._step, step
        if not self.enabled:
            return
        if self._bar is not None:
            if metrics:
                shown = {k: format_value(v) for k, v in self._metrics.items()}
                self._bar.set_postfix(shown, refresh=False)
            self._bar.update(step - previous)
        elif step % self.log_every == 0 or step >= self.total:
            self._print_line()

    def set_total(self, total: int) -> None:
        """A new last step number (a stage that grew, e.g. an extended SFT)."""
        self.total = total
        if self._bar is not None:
            self._bar.total = total
            self._bar.refresh()

    def write(self, line: str) -> None:
        """Prints a message line without breaking the bar (e.g. an evaluation's result)."""
        if not self.enabled:
            return
        if self._bar is not None:
            self._bar.write(line, file=self.stream)
        else:
            print(line, file=self.stream, flush=True)

    def _print_line(self) -> None:
        if self._last_printed == self._step:
            return
        self._last_printed = self._step
        elapsed = time.monotonic() - self._start
        done = self._step - self._initial
        rate = done / elapsed if elapsed > 0 and done > 0 else 0.0
        eta = (self.total - self._step) / rate if rate > 0 else float("nan")
        parts = [
            f"{self.desc} step {self._step}/{self.total} ({100 * self._step / self.total:.0f}%)",
            f"{rate:.3g} steps/s",
            f"elapsed {format_duration(elapsed)}",
            f"eta {format_duration(eta) if eta == eta else '?'}",
        ]
        parts += [f"{k}={format_value(v)}" for k, v in self._metrics.items()]
        print(" ".join(parts), file=self.stream, flush=True)

    def close(self) -> None:
        """Ends the bar (or prints the final line if the last step was not printed)."""
        if not self.enabled:
            return
        if self._bar is not None:
            self._bar.close()
            self._bar = None
        elif self._step != self._initial:
            self._print_line()

    def __enter__(self) -> ProgressBar:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
