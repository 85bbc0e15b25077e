"""Collectives composed from the transports: ring.py walks the plan's ring
over a link, reducing with the kernels; flat_ring.py is the torch_dist
transport, that ring over a torch.distributed link; hierarchical.py combines
shared memory inside hosts with a ring across them; pipeline.py overlaps the
pieces of a large hierarchical call."""
