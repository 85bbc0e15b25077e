"""The command line of zero.estimate (`python -m zero.estimate --help`)."""
from __future__ import annotations

import argparse
import json
import sys

from . import __doc__ as DOC
from .report import estimate, shape_from_hf
from . import memory_model as mm


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m zero.estimate", description=DOC.splitlines()[0])
    parser.add_argument("--params", help="parameter count: 7.5e9, 350M")
    parser.add_argument("--model", help="pkg.module:build_fn, counted on the meta device")
    parser.add_argument("--ranks", type=int, default=1)
    parser.add_argument("--ranks-per-node", type=int)
    parser.add_argument("--hf-config", help="a Hugging Face config.json for the transformer shapes")
    for key in ("seq", "hidden", "layers", "heads", "vocab"):
        parser.add_argument(f"--{key}", type=int)
    parser.add_argument("--micro-batch", type=int, default=1)
    parser.add_argument("--activation", choices=("gelu", "relu"), default="gelu")
    parser.add_argument("--dropout", action="store_true")
    parser.add_argument("--fp32", action="store_true", help="the model trains in fp32 (default fp16/bf16)")
    parser.add_argument("--device-memory", help="per rank, e.g. 80GB: walk the out-of-memory ladder")
    parser.add_argument("--host-memory", help="per node")
    parser.add_argument("--nvme", help="per node")
    parser.add_argument("--reduce-bucket-size", type=float, default=5e8)
    parser.add_argument("--stage3-prefetch-bucket-size", type=float, default=5e7)
    parser.add_argument("--stage3-max-live-parameters", type=float, default=1e9)
    parser.add_argument("--stage3-max-reuse-distance", type=float, default=1e9)
    parser.add_argument("--stage3-param-persistence-threshold", type=int, default=100_000)
    parser.add_argument("--write", help="write the first configuration that fits as a DeepSpeed JSON config")
    args = parser.parse_args(argv)
    shape = None
    if args.hf_config:
        shape = shape_from_hf(args.hf_config, micro_batch=args.micro_batch, seq=args.seq,
                              dropout=args.dropout or None)
    elif any(getattr(args, k) is not None for k in ("seq", "hidden", "layers", "heads")):
        missing = [k for k in ("seq", "hidden", "layers", "heads") if getattr(args, k) is None]
        if missing:
            parser.error(f"transformer shapes need --{' --'.join(missing)} as well")
        shape = mm.TransformerShape(args.seq, args.micro_batch, args.hidden, args.layers, args.heads,
                                    args.vocab or 0, activation=args.activation, dropout=args.dropout)
    if args.write and not args.device_memory:
        parser.error("--write needs --device-memory (it writes the ladder's choice)")
    try:
        result = estimate(args.params, args.ranks, model=args.model, shape=shape, mixed_precision=not args.fp32,
                          device_memory=args.device_memory, host_memory=args.host_memory, nvme=args.nvme,
                          ranks_per_node=args.ranks_per_node, reduce_bucket_size=args.reduce_bucket_size,
                          prefetch_bucket_size=args.stage3_prefetch_bucket_size,
                          max_live_parameters=args.stage3_max_live_parameters,
                          persistence_threshold=args.stage3_param_persistence_threshold,
                          max_reuse_distance=args.stage3_max_reuse_distance)
    except (ValueError, TypeError) as error:
        parser.error(str(error))
    print(result.report())
    if args.write:
        if result.choice is None:
            print("nothing fits: no config written", file=sys.stderr)
            return 1
        with open(args.write, "w") as f:
            json.dump(result.config(), f, indent=2)
        print(f"wrote {args.write}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
