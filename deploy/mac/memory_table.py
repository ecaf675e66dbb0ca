"""The memory tables of docs/deploy.md, from `kakeya memory`'s own code (a test keeps them equal).

.venv/bin/python deploy/mac/memory_table.py
"""

from __future__ import annotations

from kakeya.verifier.memory import PRESETS, KVShape, policy_table

MODELS = ("gemma-4-26b-a4b", "gemma-4-31b")
CONTEXTS = (8192, 32768, 131072)


def table(preset: str) -> str:
    """Markdown: KV GiB of one session per cache policy (rows) and context (columns)."""
    shape = KVShape.from_config(PRESETS[preset])
    cols = {c: policy_table(shape, c) for c in CONTEXTS}
    head = "| cache policy | " + " | ".join(f"{c // 1024}K context" for c in CONTEXTS) + " |"
    lines = [head, "|---|" + "---:|" * len(CONTEXTS)]
    for policy in cols[CONTEXTS[0]]:
        lines.append(
            f"| {policy} | " + " | ".join(f"{cols[c][policy]['total_bytes'] / 2**30:.2f} GiB" for c in CONTEXTS) + " |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    for m in MODELS:
        print(f"<!-- memory-table:{m} -->\n{table(m)}\n<!-- /memory-table -->\n")
