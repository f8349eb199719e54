"""What ``step.describe(state)`` shows of a training step's plan: one row per parameter (its recipe, the rule that
decided it, its sharding and padding), the table and its one-line summary. Also what checkpoints record of it."""

import numpy as np


def plan_row(rule) -> dict:
    """One parameter's line of :meth:`LayerwiseTrainStep.describe`."""
    recipe = rule.recipe if rule.quantized else ("bf16 copy" if rule.recipe == "bf16" else "kept")
    return {"path": rule.path or rule.name, "shape": tuple(rule.shape),
            "recipe": recipe, "why": rule.why, "sharding": str(rule.spec), "padding": rule.pad_rows,
            "stacked": rule.stacked}


def plan_summary(rows) -> str:
    """One line: how many leaves and what share of the parameters' elements get each kind of compute weight."""
    total = sum(int(np.prod(r["shape"])) for r in rows) or 1
    parts = []
    for recipe in ("nvfp4", "fp8", "bf16", "bf16 copy", "kept"):
        chosen = [r for r in rows if r["recipe"] == recipe]
        if chosen:
            share = 100.0 * sum(int(np.prod(r["shape"])) for r in chosen) / total
            parts.append(f"{recipe} {len(chosen)} of {len(rows)} leaves ({share:.0f}% of parameter elements)")
    return "plan: " + "; ".join(parts)


def format_plan(rows) -> str:
    """:meth:`LayerwiseTrainStep.describe`'s table."""
    head = ("path", "shape", "recipe", "sharding", "padding", "why")
    cells = [head] + [(r["path"], "x".join(map(str, r["shape"])) + (" (stacked)" if r["stacked"] else ""),
                       r["recipe"], r["sharding"], str(r["padding"] or ""), r["why"]) for r in rows]
    widths = [max(len(c[i]) for c in cells) for i in range(len(head) - 1)]
    lines = ["  ".join(c[i].ljust(widths[i]) for i in range(len(head) - 1)) + "  " + c[-1] for c in cells]
    return "\n".join(lines + [plan_summary(rows)])
