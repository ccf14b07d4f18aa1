"""The bench's table: the header, then each registered section's part in registry order,
rendered from the results dict alone (a recorded JSON renders the same, without a GPU)."""
from __future__ import annotations

from .registry import REGISTRY


def render(out: dict) -> str:
    """The table of a results dict (``registry.run``'s, or one loaded from the JSON it wrote)."""
    L = [f"p3send bench on {out['device']} ({out['sm_count']} SMs), {out['date']}"]
    L += [part for part in (s.table(out) for s in REGISTRY) if part]
    for k, v in out.get("extra", {}).items():
        L.append(f"\n{k}: {v}")
    return "\n".join(L)
