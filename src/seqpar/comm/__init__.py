"""Layer 1, communication: the device mesh, differentiable collectives (all-to-all, gather/split,
ring send/recv), the one cross-rank agreement path for errors, counting collectives, and starting
local gloo processes. Imports nothing else of seqpar."""
