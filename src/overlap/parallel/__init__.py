"""Process groups (ParallelState) and the one module that calls collectives (comm)."""
