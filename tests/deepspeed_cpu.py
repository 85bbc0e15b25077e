"""DeepSpeed as the tests run it: the CPU accelerator, without the JIT build of
its shared-memory comm op. That op serves only DeepSpeed's inference all-reduce
(training never calls it) and costs ~45 s of compiling on 2 cores; a build
killed by a test's timeout leaves torch's build lock behind, and every later
DeepSpeed start waits on it forever."""
from __future__ import annotations

import os
import sys


def import_deepspeed():
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import deepspeed
    import deepspeed.comm.torch  # noqa: F401  (deepspeed.comm.torch as a name is the torch package)

    sys.modules["deepspeed.comm.torch"].build_shm_op = lambda: None
    return deepspeed
