"""Command line: `sglang-trtllm-moe doctor | explain | ...` (also `python -m sglang_trtllm_moe`); extensions add
their own commands (`hookspecs.register_commands`)."""

from __future__ import annotations

import argparse
import json
import sys


def _capability_lines(rows: list[dict]) -> list[str]:
    """`explain`'s capability lines: the groups this model's path needs, and for a stepped-aside one why and what
    that leaves (doctor lists every group)."""
    aside = [c for c in rows if c.get("status") == "stepped_aside"]
    if not rows:
        return []
    if not aside:
        return [f"plugin capabilities for this model: all active ({', '.join(c['capability'] for c in rows)})"]
    return [
        f"plugin stepped aside for {c['capability']}: {'; '.join(c['why'])}. {c.get('consequence', '')}" for c in aside
    ]


def _cmd_doctor(args) -> int:
    from . import doctor

    r = doctor.report(load=True)
    print(json.dumps(r, indent=2) if args.json else doctor.format_text(r))
    missing = [t for t in r["targets"] if t["state"] == "missing"]
    return 1 if missing else 0


def _cmd_explain(args) -> int:
    from .explain import explain_model
    from .explain_checks import ExplainInputError
    from .selection import Eligibility, Resolution, format_report

    try:
        r = explain_model(
            args.model,
            sm=args.sm,
            tp_size=args.tp,
            ep_size=args.ep,
            quantization=args.quantization,
            a2a_backend=args.a2a,
            enable_eplb=args.eplb,
            moe_runner_backend=args.moe_runner_backend,
            run_sglang=not args.no_sglang,
            return_routed_experts=args.return_routed_experts,
            weight_cache_mode=args.weight_cache_mode,
            speculative_algorithm=args.speculative_algorithm,
        )
    except ExplainInputError as e:  # an argument SGLang would refuse, a model directory it cannot read: one line each
        for line in str(e).splitlines():
            print(f"sglang-trtllm-moe explain: {line}", file=sys.stderr)
        return 2
    if args.json:
        if args.writer_contract:
            from .explain import writer_contract

            r["writer_contract"] = writer_contract((r.get("plugin_prepares") or {}).get("format"))
        print(json.dumps(r, indent=2, default=str))
        return 0
    if r["problem"] is None:
        print(f"winner: {r['winner']}  [{r['code']}]\n  {r['reason']}")
    else:
        cands = [Eligibility(**c) for c in r["candidates"]]
        res = Resolution(r["winner"], cands, r["fingerprint"], r["code"], r["reason"], r["requested"], r["upstream"])
        p = r["problem"]
        print(
            f"model: {p['architecture']} {p['quantization'] or 'bf16'} H {p['hidden_size']} "
            f"I {p['intermediate_size']} experts {p['num_experts']} top-k {p['top_k']} "
            f"{'gated' if p['gated'] else 'non-gated'} {p['activation']}, "
            f"tp {p['tp_size']} ep {p['ep_size']} a2a {p['a2a_backend']}"
        )
        print(format_report(res))
        prep = r.get("plugin_prepares") or {}
        if prep:
            print(f"plugin preparation: {prep['reason']}")
        r3 = r.get("routed_experts") or {}
        if r3:
            print(f"routed experts (R3{'' if p['return_routed_experts'] else ', if asked for'}): {r3['reason']}")
    if r.get("first_forward"):
        print(f"warning: fails at the first forward ({r['first_forward']['error']}): {r['first_forward']['reason']}")
    if args.writer_contract:
        from .explain import writer_contract

        wc = writer_contract((r.get("plugin_prepares") or {}).get("format"))
        r["writer_contract"] = wc
        print(f"writer contract (loader-free sessions) for {wc['format']}: {wc['note']}")
        for row in wc["params"]:
            checked = "values checked at the end" if row["values_checked"] else "values not checked"
            print(f"  {row['param']} ({row['group']}, {row['kind']}; {checked}): {row['at_end']}")
    if r.get("draft_updates"):
        print(f"speculative draft under RL updates: {r['draft_updates']['reason']}")
    for line in _capability_lines(r.get("capabilities") or []):
        print(line)
    if r.get("note"):
        print(f"note: {r['note']}")
    sg = r.get("sglang") or {}
    if "error" in sg:
        print(f"SGLang resolution not run: {sg['error']}")
    elif sg:
        print(
            f"SGLang resolution (device=cpu, platform faked): upstream alone -> {sg.get('upstream_alone')}, "
            f"with the plugin ({sg.get('plugin_status')}) -> {sg.get('with_plugin')}"
        )
        for k in ("upstream_alone_error", "with_plugin_error"):
            if k in sg:
                print(f"  {k}: {sg[k]}")
    return 0


def _extension_commands(sub) -> None:
    """The commands extensions add (`register_commands`), from the plugin's entry-point group as `register()` loads
    them: each isolated, a failing one is skipped with one line on stderr."""
    import pluggy

    from . import PROJECT_NAME, hookspecs
    from .plugin import load_extensions

    pm = pluggy.PluginManager(PROJECT_NAME)
    pm.add_hookspecs(hookspecs)
    load_extensions(pm)
    for impl in pm.hook.register_commands.get_hookimpls():
        try:
            impl.function(subparsers=sub)
        except Exception as e:  # noqa: BLE001 - one extension's commands must not take the command line down
            name = impl.plugin_name.removeprefix("ext:")
            print(f"sglang-trtllm-moe: extension {name!r} added no commands: {type(e).__name__}: {e}", file=sys.stderr)


def version_line() -> str:
    """`--version`: the plugin's version and those of what it runs with (package metadata only: nothing imported)."""
    import importlib.metadata

    from . import __version__

    def of(dist: str) -> str:
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            return "not installed"

    others = ", ".join(f"{d} {of(d)}" for d in ("sglang", "flashinfer-python", "torch"))
    return f"sglang-trtllm-moe {__version__} ({others})"


def build_parser() -> argparse.ArgumentParser:
    # raw: `--version` prints its line unwrapped
    p = argparse.ArgumentParser(
        prog="sglang-trtllm-moe", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--version", action="version", version=version_line())
    sub = p.add_subparsers(dest="command", required=True)
    d = sub.add_parser("doctor", help="versions, device, plugin state, and whether every hook landed in SGLang")
    d.add_argument("--json", action="store_true", help="machine-readable output (stable keys, see doctor.py)")
    d.set_defaults(func=_cmd_doctor)
    e = sub.add_parser(
        "explain", help="which MoE runner backend a model gets on SM100, and why every other one was not"
    )
    e.add_argument("--model", required=True, help="model directory (only config.json is read)")
    e.add_argument(
        "--sm",
        type=int,
        default=None,
        help="compute capability as SM number (100, 103, 120, 90); default: this machine's GPU",
    )
    e.add_argument("--tp", type=int, default=1)
    e.add_argument("--ep", type=int, default=1)
    e.add_argument("--quantization", default=None, help="as --quantization (default: from config.json)")
    e.add_argument("--a2a", default="none", help="as --moe-a2a-backend")
    e.add_argument("--eplb", action="store_true", help="as --enable-eplb")
    e.add_argument("--moe-runner-backend", default="auto", help="as --moe-runner-backend (explicit is kept)")
    e.add_argument(
        "--return-routed-experts", action="store_true", help="as --enable-return-routed-experts (routing replay)"
    )
    e.add_argument(
        "--weight-cache-mode",
        default="off",
        choices=("off", "daemon", "client"),
        help="as --weight-cache-mode (SGLang 0.5.17+; weights from the weight-cache daemon: the plugin stands down)",
    )
    e.add_argument(
        "--speculative-algorithm",
        default=None,
        help="as --speculative-algorithm: also say which RL update entry points leave the draft stale",
    )
    e.add_argument(
        "--writer-contract",
        action="store_true",
        help="also print what a loader-free (P2P / RDMA) writer writes into each parameter inside a weight-update "
        "session, and what the plugin lays out and recomputes at its end",
    )
    e.add_argument("--no-sglang", action="store_true", help="skip SGLang's own resolution (rules only)")
    e.add_argument("--json", action="store_true", help="machine-readable: winner, code, reason, candidates, ...")
    e.set_defaults(func=_cmd_explain)
    _extension_commands(sub)
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
