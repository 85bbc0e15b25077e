import os
import sys

sys.path.insert(0, os.path.dirname(__file__))


# The longest test files, longest first (measured with --durations): they start at once.
LONGEST = ("test_zero_zeropp", "test_zero_infinity", "test_wheel", "test_zero_deepspeed_interop", "test_cluster",
           "test_collectives", "test_zero_dropin", "test_torch_suite", "test_faults", "test_zero_parity",
           "test_zero_checkpoint_kill")


def pytest_collection_modifyitems(config, items) -> None:
    """The longest files first, then the other files with slow tests, then the rest: with
    pytest-xdist (`-n 2 --dist loadfile`) the long files start at once and the short ones fill
    in after them, instead of a long one starting last and running alone."""
    slow_modules = {item.module.__name__ for item in items if item.get_closest_marker("slow")}

    def rank(item) -> tuple[int, bool]:
        name = item.module.__name__
        return (LONGEST.index(name) if name in LONGEST else len(LONGEST), name not in slow_modules)

    items.sort(key=rank)
