"""The ``seqpar`` command line: train, verify, bench, plan."""
