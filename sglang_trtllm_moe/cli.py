"""Command line: `sglang-trtllm-moe doctor | ...` (also `python -m sglang_trtllm_moe`)."""

from __future__ import annotations

import argparse
import json
import sys


def _cmd_doctor(args) -> int:
    from . import doctor

    r = doctor.report(load=True)
    print(json.dumps(r, indent=2) if args.json else doctor.format_text(r))
    missing = [t for t in r["targets"] if t["state"] == "missing"]
    return 1 if missing else 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="sglang-trtllm-moe", description=__doc__)
    sub = p.add_subparsers(dest="command", required=True)
    d = sub.add_parser("doctor", help="versions, device, plugin state, and whether every hook landed in SGLang")
    d.add_argument("--json", action="store_true", help="machine-readable output (stable keys, see doctor.py)")
    d.set_defaults(func=_cmd_doctor)
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
