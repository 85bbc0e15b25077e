"""Moving bytes between ranks: base.py declares what every transport offers;
shm.py is the shared-memory transport of one host, shm_p2p.py its
point-to-point channels and shm_names.py its segments' names and sweep;
link.py is a point-to-point link over a torch.distributed group; agreement.py
is what ranks compare before a call; rendezvous.py bounds every set-up wait;
lifecycle.py is how a Python transport stops; placement.py says which host
each rank is on and which transport that calls for."""
