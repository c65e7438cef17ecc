"""Micro-batch schedules: the pipeline programs and their executor (`schedules`, PP = 1 included), and the merged
forward/backward step of the MoE expert-parallel overlap (`combined_1f1b`)."""
