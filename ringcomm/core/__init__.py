"""What every room below the collectives shares: ops.py holds the codes Python
and C++ agree on (reduction ops, dtypes, call kinds); arguments.py checks
caller arguments and RINGCOMM_* variables before C++ sees them; host.py says
which cores this process may use and what a peer process is doing; compat.py
is the one place that calls torch's private APIs; attempt.py scopes keys
in a store that outlives torchrun's restarts; on_import.py runs a
callback once a module is imported, without importing it."""
