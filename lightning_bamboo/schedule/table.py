"""The Step x Rank table of a schedule, with ``<-- ERROR HERE`` on a failing step."""

from __future__ import annotations

from lightning_bamboo.schedule.program import Schedule


def format_table(schedule: Schedule, error_at: int | None = None) -> str:
    """Step x Rank table: one row per DeepSpeed step, one column per rank, a cell lists that step's actions
    in order; a dead rank's column is headed ``(dead)``; row ``error_at`` ends with ``<-- ERROR HERE``."""
    p, steps = schedule.stages, schedule.num_steps
    width = len(str(max(steps - 1, 0)))
    labels = [f"Step {str(t).zfill(width)}" for t in range(steps)]
    heads = [f"Rank {r}" + (" (dead)" if r == schedule.dead else "") for r in range(p)]
    cells = [[" ".join(map(str, prog[t])) if t < len(prog) else "" for prog in schedule.programs]
             for t in range(steps)]
    widths = [max([len(heads[r])] + [len(row[r]) for row in cells]) for r in range(p)]
    lead = len(labels[0]) + 2 if labels else 6
    lines = [(" " * lead + " | ".join(h.ljust(w) for h, w in zip(heads, widths, strict=True))).rstrip()]
    for t, (label, row) in enumerate(zip(labels, cells, strict=True)):
        line = (f"{label}: " + " | ".join(c.ljust(w) for c, w in zip(row, widths, strict=True))).rstrip()
        if error_at == t:
            line += "  <-- ERROR HERE"
        lines.append(line)
    return "\n".join(lines) + "\n"
