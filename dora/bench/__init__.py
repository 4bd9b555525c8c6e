"""Benchmarks: each prints ratios or rates measured side by side in one run (`dora bench NAME`)."""


def summary(doc: str | None) -> str:
    """A module docstring's first paragraph as one line: a benchmark's `--help` description."""
    return " ".join((doc or "").split("\n\n")[0].split())
