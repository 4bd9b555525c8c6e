"""docs/reliability.md names the test that proves each claim: every one it names must exist, so a
renamed or deleted proof fails here instead of leaving the document pointing at nothing."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_every_proof_named_in_reliability_md_exists() -> None:
    text = (ROOT / "docs" / "reliability.md").read_text()
    proofs = re.findall(r"(tests/[\w/]+\.py)::(\w+)", text)
    assert len(proofs) >= 40
    missing = []
    for path, name in proofs:
        source = ROOT / path
        if not source.is_file() or not re.search(
            rf"^(async )?def {name}\(", source.read_text(), re.M
        ):
            missing.append(f"{path}::{name}")
    assert not missing, f"docs/reliability.md names tests that do not exist: {missing}"
