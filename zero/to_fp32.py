"""`python -m zero.to_fp32`: one fp32 state_dict from a zero checkpoint (zero/checkpoint/to_fp32.py)."""
from .checkpoint.to_fp32 import convert, main

__all__ = ["convert", "main"]

if __name__ == "__main__":
    main()
