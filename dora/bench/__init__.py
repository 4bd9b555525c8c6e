"""Benchmarks: each prints ratios or rates measured side by side in one run (`dora bench NAME`)."""
