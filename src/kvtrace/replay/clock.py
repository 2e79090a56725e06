"""The step-time model of `kvtrace replay --clock timed`, fitted on the recording's own steps.

A step's duration (schedule() entered -> update_from_output() returned) is fitted as intercept +
prefill cost x prefill tokens + decode cost x decode tokens, by least squares over the recording's
steps that scheduled tokens, leaving out the engine's first step (it pays one-off costs), as the
canned query `step_time_fit` does for its one-slope model (a prompt token and a decode token cost very
differently: one slope underestimates prefill steps). A cost the fit makes negative is dropped and the
rest fitted again; steps far slower than the fit (the first passes of new shapes, which compile or
warm caches, took 10-17x a later step of the same size on the CPU build; stalls) are left out and the
rest fitted again. Only slow ones: a minority of cheap steps (a few prefills among many decodes) is what
the per-token costs are fitted from. The gap between one step's end and the next one's start, while the
engine had work, is the median of the recording's gaps between consecutive steps.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass

# A gap longer than this between consecutive steps is the engine waiting for requests, not its
# per-step overhead (ns).
IDLE_GAP_NS = 50_000_000
# Steps slower than the fit by more than this many (robust) standard deviations are left out of it.
OUTLIER_MADS = 4.0


@dataclass(frozen=True)
class StepTime:
    intercept_ns: float
    prefill_token_ns: float
    decode_token_ns: float
    gap_ns: float  # between steps while the engine has work
    steps: int  # fitted on (outliers left out)
    r2: float

    def step_ns(self, prefill_tokens: int, decode_tokens: int) -> float:
        """Predicted duration of a step (schedule() entered -> update_from_output() returned)."""
        return self.intercept_ns + self.prefill_token_ns * prefill_tokens + self.decode_token_ns * decode_tokens


def fit_step_time(rows: list[dict]) -> StepTime | None:
    """The model, from `steps` rows (step, scheduled_tokens, prefill_tokens, t_start_ns, t_end_ns); None
    with fewer than three usable steps."""
    import numpy as np

    done = sorted((r for r in rows if r.get("t_end_ns") is not None and r.get("t_start_ns") is not None),
                  key=lambda r: r["step"])
    busy = [r for r in done[1:] if (r.get("scheduled_tokens") or 0) > 0]
    if len(busy) < 3:
        return None
    prefill = np.array([float(r.get("prefill_tokens") or 0) for r in busy])
    x = np.column_stack([np.ones(len(busy)), prefill, np.array([float(r["scheduled_tokens"]) for r in busy]) - prefill])
    y = np.array([float(r["t_end_ns"] - r["t_start_ns"]) for r in busy])
    rows_in = np.ones(len(busy), dtype=bool)
    for _ in range(5):  # fit; leave out steps far slower than it (a new shape's first pass, a stall); again
        coef = _nonnegative_lstsq(x[rows_in], y[rows_in])
        res = y - x @ coef
        mad = float(np.median(np.abs(res[rows_in] - np.median(res[rows_in]))))
        if mad <= 0:
            break
        keep = res - np.median(res[rows_in]) <= OUTLIER_MADS * 1.4826 * mad
        if keep.sum() < 3 or (keep == rows_in).all():
            break
        rows_in = keep
    yi = y[rows_in]
    ss_tot = float(np.sum((yi - yi.mean()) ** 2))
    ss_res = float(np.sum((yi - x[rows_in] @ coef) ** 2))
    gaps = [b["t_start_ns"] - a["t_end_ns"] for a, b in zip(done, done[1:])
            if b["step"] == a["step"] + 1 and 0 <= b["t_start_ns"] - a["t_end_ns"] < IDLE_GAP_NS]
    return StepTime(float(coef[0]), float(coef[1]), float(coef[2]), statistics.median(gaps) if gaps else 0.0,
                    int(rows_in.sum()), 1.0 - ss_res / ss_tot if ss_tot > 0 else 0.0)


def _nonnegative_lstsq(x, y):
    """Least squares with every coefficient >= 0: a negative one is dropped (set to 0) and the rest
    fitted again."""
    import numpy as np

    keep = list(range(x.shape[1]))
    while keep:
        coef = np.zeros(x.shape[1])
        coef[keep] = np.linalg.lstsq(x[:, keep], y, rcond=None)[0]
        negative = [k for k in keep if coef[k] < 0]
        if not negative:
            return coef
        keep.remove(min(negative, key=lambda k: coef[k]))
    return np.zeros(x.shape[1])
