"""The plans, standard library only (no torch): schedule.py says which chunk
each rank sends, receives and reduces at each step of a ring, and how a chunk
splits into segments; layout.py says where each parameter lives in a flat
buffer, which bucket it belongs to and each bucket's owner-aligned chunks;
gathers.py says which gathered buckets a ZeRO stage-3 forward keeps for
backward (the reuse distance)."""
