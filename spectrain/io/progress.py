"""One tqdm bar (with ETA) for the long data commands: prepare-features (tokens, rows) and regenerate (rows).

Only one process draws it (rank 0 under torchrun / accelerate launch), so N ranks do not print N bars.
"""

from __future__ import annotations

from tqdm.auto import tqdm


class Progress:
    def __init__(self, total: int, unit: str, desc: str, enabled: bool = True, initial: int = 0,
                 total_rows: int | None = None):
        self.rows, self.total_rows, self.by_tokens = 0, total_rows, unit == "tok"
        self.bar = tqdm(total=total, initial=initial, unit=unit, unit_scale=unit != "row", desc=desc,
                        disable=not enabled, dynamic_ncols=True, smoothing=0.1)

    def advance(self, rows: int, tokens: int = 0) -> None:
        """`rows` done; the bar counts tokens when it was made with unit 'tok', else rows."""
        self.rows += rows
        self.bar.update(tokens if self.by_tokens else rows)
        if self.total_rows is not None:
            self.bar.set_postfix_str(f"{self.rows}/{self.total_rows} rows", refresh=False)

    def note(self, text: str) -> None:
        if not self.bar.disable:
            self.bar.set_postfix_str(text, refresh=False)

    def close(self) -> None:
        self.bar.close()
