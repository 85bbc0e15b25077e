"""`python -m zero.to_deepspeed`: a zero checkpoint in DeepSpeed's layout (zero/checkpoint/to_deepspeed.py)."""
from .checkpoint.to_deepspeed import convert, main

__all__ = ["convert", "main"]

if __name__ == "__main__":
    main()
