"""Layer 5, testing: the parity engines (attention against the float64 reference, whole models against
themselves without SP) that the test suite and ``seqpar verify`` share. Nothing below imports it."""
