"""Command line: `python -m clef_engine tiny DIR`, `info SOURCE`, `serve --model SOURCE`."""

from __future__ import annotations

import argparse
import json
import math
import sys
from typing import TYPE_CHECKING

from .errors import ClefError
from .tiny import SIZES

if TYPE_CHECKING:
    from .model.release import Release


def cmd_tiny(args: argparse.Namespace) -> int:
    from .tiny import build_tiny_release

    try:
        path = build_tiny_release(args.directory, seed=args.seed, size=args.size)
    except OSError as exc:  # a file where the folder should be, a folder that cannot be made
        print(f"error: cannot write the release to {args.directory}: {exc.strerror or exc}", file=sys.stderr)
        return 2
    print(f"wrote a tiny Clef-format release (random weights, seed {args.seed}, size {args.size}) to {path}")
    return 0


def cmd_info(args: argparse.Namespace) -> int:
    from .model import release
    from .runner import fast_kernels_available

    checked = release.check(release.resolve(args.source, args.revision), source=args.source, revision=args.revision)
    described = release.describe(checked)
    described["fast_kernels_importable"] = fast_kernels_available()
    if args.load:
        from .engine import load

        engine = load(args.source, device=args.device, dtype=args.dtype, revision=args.revision)
        described["loaded"] = engine.info()
    else:
        described["parameters"] = count_parameters(checked)
    print(json.dumps(described, indent=2, default=str))
    return 0


def count_parameters(checked: Release) -> dict[str, int]:
    """Parameter counts from the safetensors headers alone (no weights read)."""
    from safetensors import safe_open

    from .model.release import HEAD_WEIGHTS

    counts = {"backbone": 0, "vision": 0, "head": 0}
    for file, part in [*((file, "backbone") for file in checked.weight_files), (HEAD_WEIGHTS, "head")]:
        with safe_open(checked.path / file, framework="pt") as handle:
            for name in handle.keys():
                numel = math.prod(handle.get_slice(name).get_shape())
                counts[part] += numel
                if part == "backbone" and (".visual." in name or name.startswith("visual.")):
                    counts["vision"] += numel
    return counts


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m clef_engine", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    tiny = commands.add_parser("tiny", help="write a tiny Clef-format release with random weights")
    tiny.add_argument("directory")
    tiny.add_argument("--seed", type=int, default=0)
    tiny.add_argument("--size", choices=list(SIZES), default="tiny",
                      help="tiny (the demo model) or small (wider, twice the layers: a second model of another size)")
    tiny.set_defaults(run=cmd_tiny)
    info = commands.add_parser("info", help="what a release holds and which fast kernels are importable")
    info.add_argument("source", help="release folder or Hugging Face repo id")
    info.add_argument("--revision")
    info.add_argument("--load", action="store_true", help="also load it and report device, memory, kernels")
    info.add_argument("--device")
    info.add_argument("--dtype")
    info.set_defaults(run=cmd_info)
    from .serve.cli import add_serve_parser

    add_serve_parser(commands)
    args = parser.parse_args(argv)
    try:
        return args.run(args)
    except ClefError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
