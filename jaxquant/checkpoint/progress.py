"""A byte-counting progress bar (tqdm on stderr) that is a no-op when disabled."""

from __future__ import annotations

import sys


class Progress:
    def __init__(self, total_bytes: int, desc: str, enabled: bool = True):
        self._bar = None
        if enabled:
            from tqdm import tqdm

            self._bar = tqdm(total=total_bytes, desc=desc, unit="B", unit_scale=True, unit_divisor=1024,
                             file=sys.stderr, mininterval=0.2, dynamic_ncols=True)

    def update(self, n: int) -> None:
        if self._bar is not None:
            self._bar.update(n)

    def __enter__(self):
        return self

    def __exit__(self, exc_type, *exc):
        if self._bar is not None:
            if exc_type is not None:
                self._bar.leave = False  # an error or interrupt: its one-line message is all that stays
            self._bar.close()
        return False
