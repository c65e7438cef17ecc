"""Launching worker processes: launch-time environment rules, local start-up and Slurm scripts."""
