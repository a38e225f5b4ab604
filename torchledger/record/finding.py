"""A finding (one verdict: rule, severity, message, where, what to do) and the helpers every
reader of a record's findings shares."""
from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Optional

__all__ = ["Finding", "SEVERITIES", "EMPTY_SENTENCE", "is_empty", "as_findings"]

SEVERITIES = ("error", "warning", "info")


EMPTY_SENTENCE = "Empty record: no ops were traced (did the traced block run a step?)."


def is_empty(record) -> bool:
    """True when the record saw no step: no modules, no FLOPs and no ops."""
    flops = (record.totals.get("flops") or {}).get("total", 0)
    return not record.modules and not flops and not record.ops


def as_findings(record, findings) -> list:
    """``findings`` as :class:`Finding` objects; ``None`` means the record's own findings."""
    items = record.findings if findings is None else findings
    return [f if isinstance(f, Finding) else Finding.from_dict(f) for f in items]


@dataclass
class Finding:
    """One verdict: what rule fired, how bad, where, and what to do about it."""

    rule: str
    """Stable rule id (documented in docs/findings.md), e.g. ``TL-COPY-001``."""
    severity: str
    """'error', 'warning' or 'info'."""
    message: str
    module: Optional[str] = None
    """``named_modules()`` name of the module concerned ("" for the root), if any."""
    location: Optional[str] = None
    """``path:line`` in the user's source, if known."""
    measured: Any = None
    expected: Any = None
    hint: Optional[str] = None

    def __post_init__(self):
        if self.severity not in SEVERITIES:
            raise ValueError(f"severity must be one of {', '.join(SEVERITIES)}, got {self.severity!r}")

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "Finding":
        return cls(rule=d["rule"], severity=d["severity"], message=d["message"],
                   module=d.get("module"), location=d.get("location"), measured=d.get("measured"),
                   expected=d.get("expected"), hint=d.get("hint"))
