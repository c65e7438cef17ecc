"""Micro-batch schedules. `combined_1f1b`: the MoE expert-parallel overlap schedule (no pipelining)."""
