"""Tests of the sans-IO scheduling core."""
