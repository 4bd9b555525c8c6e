"""dora."""
