"""Payload masking for the console: the rules live in `outbox.masking`, shared with
`outbox trace` and logs (one `OUTBOX_UI_MASK` for all three), and importable without
the console's web dependencies."""

from __future__ import annotations

from outbox.masking import DEFAULT_RULES, MASKED, Mask

__all__ = ["DEFAULT_RULES", "MASKED", "Mask"]
