"""Tests of the modes benchmark's arithmetic and of the run report, on recorded run directories."""
