"""What a ZeRO stage splits across the ranks and how: the stage table and
ring volumes (policy.py), the bucketed parameter group that owns the fp32
masters, gradients and shards (param_group.py) and saves and loads them
(state.py), the buckets filled at set-up (fill.py), stage-3 gathering around each unit (gather.py) and the units,
repeated blocks or modules (units.py), the seam to
ringcomm or torch.distributed (seam.py), the memory accounting
(accounting.py), where the sent bytes go (wire.py), ZeRO++'s quantized and
hierarchical gathers and reductions (zeropp.py) and DeepSpeed's Init /
GatheredParameters (init.py)."""
