"""The pretraining loop: mock data, micro-batches, gradient reduction, optimizer step, timing and
metrics."""
