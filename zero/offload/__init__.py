"""Model states kept off the device: optimizer states and masters in host
memory (host.py, with CUDA staging in cuda.py; the C++ Adam step is
zero/optim's), or on NVMe (nvme_states.py for optimizer states, nvme_params.py
for stage-3 parameters), through aligned swap files and an I/O pool (swap.py),
as the offload sections and aio say (config.py)."""
