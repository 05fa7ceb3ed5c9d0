"""What every part of the scaling analysis shares: :class:`BenchError` and the constants of the
report (part labels, predicted worker counts, thresholds)."""

from __future__ import annotations

PART_LABELS = {
    "data_s": "data wait",
    "compute_s": "compute (forward + backward)",
    "comm_exposed_s": "communication (exposed)",
    "optimizer_s": "optimizer",
    "other_s": "other",
}
#: Worker counts the alpha-beta model predicts efficiency for (besides the measured ones).
DEFAULT_PREDICT_WORKERS = (4, 8, 16, 32, 64)
#: A part of the step at least this large (fraction of the step) is worth a sentence.
NOTABLE_SHARE = 0.10
#: Reference amount of work for T_W (samples).
REFERENCE_SAMPLES = 10_000


class BenchError(ValueError):
    """Measurements that cannot give the requested number; the message says why and what to do."""


def fmt_bytes(n: float) -> str:
    """``n`` bytes with a decimal unit (``"1.50 MB"``)."""
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if n >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n:.0f} B"
