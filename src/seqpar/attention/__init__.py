"""Layer 2, attention: what attention computes (spec, masks by structure), the local kernels and the
float64 reference, sequence layouts, batch-level shard facts, and the strategies -- Ulysses, ring
(one loop, swappable transport, pure block plans) and hybrid -- behind one dispatch."""
