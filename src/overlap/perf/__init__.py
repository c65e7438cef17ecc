"""Performance measurement: the A/B benchmark harness (`overlap bench`)."""
