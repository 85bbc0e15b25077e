"""How bytes combine and shrink: cpu.py wraps the C++ reduction kernels and
says which build of them runs on this CPU; cuda.py compiles and launches the
CUDA reduce and cast kernels with CuPy; quant.py is the blockwise int8/int4
format of ZeRO++ and its dispatch; cuda_quant.py its CUDA kernels."""
