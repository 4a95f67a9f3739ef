"""What happened to each shard of a job (:class:`ShardReport`), and summaries over reports."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

__all__ = ["DONE", "FAILED", "SKIPPED", "ShardReport", "format_summary", "summarize"]

DONE, SKIPPED, FAILED = "done", "skipped", "failed"


@dataclass
class ShardReport:
    """What happened to one shard: ``status`` is ``"done"``, ``"skipped"`` (the output existed)
    or ``"failed"`` (``error`` says why). ``messages`` holds the first errors a handler skipped."""

    input: str
    output: str
    status: str = DONE
    samples_in: int = 0
    samples_out: int = 0
    samples_skipped: int = 0
    seconds: float = 0.0
    error: str | None = None
    attempts: int = 0
    messages: list = field(default_factory=list)
    index: bytes | None = field(default=None, repr=False)  # the output's index (manifest=)
    info: dict | None = field(default=None, repr=False)  # what the job found (indexing: values)

    def as_dict(self) -> dict:
        out = asdict(self)
        out.pop("index", None)
        out.pop("info", None)
        return out


def summarize(reports: list[ShardReport]) -> dict:
    """Counts over reports: shards done/skipped/failed, samples in/out/skipped, seconds."""
    out = {
        "shards": len(reports),
        DONE: 0,
        SKIPPED: 0,
        FAILED: 0,
        "samples_in": 0,
        "samples_out": 0,
        "samples_skipped": 0,
        "seconds": 0.0,
    }
    for r in reports:
        out[r.status] += 1
        out["samples_in"] += r.samples_in
        out["samples_out"] += r.samples_out
        out["samples_skipped"] += r.samples_skipped
        out["seconds"] += r.seconds
    return out


def format_summary(reports: list[ShardReport], wall_seconds: float | None = None) -> str:
    """A small table: shards and samples per status, and the time taken."""
    rows = [("", "shards", "samples in", "samples out", "errors", "seconds")]
    for status in (DONE, SKIPPED, FAILED):
        rs = [r for r in reports if r.status == status]
        s = summarize(rs)
        rows.append(
            (
                status,
                str(len(rs)),
                str(s["samples_in"]),
                str(s["samples_out"]),
                str(s["samples_skipped"]),
                f"{s['seconds']:.1f}",
            )
        )
    s = summarize(reports)
    total_secs = f"{wall_seconds:.1f}" if wall_seconds is not None else f"{s['seconds']:.1f}"
    rows.append(
        (
            "total",
            str(len(reports)),
            str(s["samples_in"]),
            str(s["samples_out"]),
            str(s["samples_skipped"]),
            total_secs,
        )
    )
    widths = [max(len(r[c]) for r in rows) for c in range(len(rows[0]))]
    lines = []
    for r in rows:
        cells = [r[0].ljust(widths[0])] + [r[c].rjust(widths[c]) for c in range(1, len(r))]
        lines.append("  ".join(cells).rstrip())
    if wall_seconds is not None:
        lines.append(
            "(errors: samples skipped by the error handler; seconds: per-shard sums, "
            "total: wall clock)"
        )
    return "\n".join(lines)
