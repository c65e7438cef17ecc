"""Micro-batch schedules: the pipeline programs (`schedules`) and their executor (`executor`, PP = 1
included), with its p2p transport (`p2p`), output memory policy (`output_memory`) and deferred
output-layer weight gradients (`output_wgrad`); the merged forward/backward step of the MoE
expert-parallel overlap (`combined_1f1b`); and the one interface the trainer runs a step through,
ours or torch's pipelining peer (`runner`, `torch_peer`)."""
