"""A real SLURM cluster on localhost for end-to-end tests (cluster.py)."""
