"""What users call: group.py holds Group (ranks, their transport, the comm
thread), registry.py the registry of groups (new_group, the default group,
resolve_group); collectives.py checks arguments and
runs the public collectives; coalesced.py packs lists of tensors into one
call per bucket; quantized.py is ZeRO++'s quantized all-gather and
reduce-scatter; aliasing.py handles inputs that share memory with outputs;
work.py is the handle of an asynchronous call."""
