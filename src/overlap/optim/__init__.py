"""Optimizers, below both the data-parallel runtime (whose distributed optimizer reuses the Adam
core on shards) and the trainer that drives them."""
