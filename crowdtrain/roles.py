"""What a node does for its run: the roles, by name (they travel as these strings in status records and JSON)."""

from __future__ import annotations

import enum


class Role(enum.StrEnum):
    """A node's role. A StrEnum: equal to its string, which is what records, flags and `status --json` carry."""

    TRAINER = "trainer"
    """Computes gradients on data."""
    AGGREGATOR = "aggregator"
    """Reduces a share of each all-reduce (the DeDLOC plan's share)."""
    EXPERT_HOST = "expert-host"
    """Serves DMoE experts."""
    CLIENT = "client"
    """Cannot accept connections: trains, never aggregates or serves."""


AUTO = "auto"
"""`--role auto`: not a role, the choice to let measurement and the plan decide."""
