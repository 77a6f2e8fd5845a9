"""``python -m zerofx.checkpoint consolidate CKPT_DIR OUT.pt``: a sharded checkpoint's model as one state dict."""

import argparse
import sys

from zerofx.checkpoint.consolidate import consolidate
from zerofx.errors import CheckpointError


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m zerofx.checkpoint")
    commands = parser.add_subparsers(dest="command", required=True)
    merge = commands.add_parser("consolidate", help="write the model's full state dict (torch.save) to OUT")
    merge.add_argument("checkpoint_dir")
    merge.add_argument("out")
    args = parser.parse_args(argv)
    try:
        model = consolidate(args.checkpoint_dir, args.out)
    except CheckpointError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    numel = sum(t.numel() for t in model.values())
    print(f"wrote {args.out}: {len(model)} tensors, {numel} elements")
    return 0


if __name__ == "__main__":
    sys.exit(main())
