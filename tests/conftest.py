import os
import sys

sys.path.insert(0, os.path.dirname(__file__))


def pytest_collection_modifyitems(config, items) -> None:
    """Modules with slow tests first, in their order: with pytest-xdist (`-n 4 --dist loadfile`)
    the long modules start at once and the short ones fill in after them, instead of a long one
    starting last and running alone."""
    slow_modules = {item.module.__name__ for item in items if item.get_closest_marker("slow")}
    items.sort(key=lambda item: item.module.__name__ not in slow_modules)
