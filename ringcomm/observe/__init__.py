"""What a user sees of the collectives after the fact: profiling.py records
torch.profiler events per call; recorder.py is the flight recorder (the last
collectives of each group, dumped on failure); trace_dumps.py reads a folder
of dumps and trace.py analyzes them (`python -m ringcomm.observe.trace`)."""
