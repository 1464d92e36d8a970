"""Batch jobs: each is `python -m deploy.jobs.<name>`, runnable as is, as an `llmaas` subcommand, or on
a cluster with `ray job submit -- python -m deploy.jobs.<name> ...`."""
