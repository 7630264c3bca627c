"""`umbp explain`: why did a hybrid restore stop at T? (backed by umbp.hybrid.explain)

    umbp explain --groups full:400,state:400 --unit 16 --max-tokens 839 \\
                 --present 0=400,800,832 --present 1=832

Groups: `full:B` (full attention), `swa:B:W` (sliding window W), `state:B` (Mamba/GDN/KDA recurrent state).
`--present G=t1,t2,...` lists the token ends at which group G has a stored object. With `--dcp N`, block
sizes are per rank (as in vLLM's specs) and attention blocks span B x N tokens:

    umbp explain --groups full:128,state:128 --unit 128 --dcp 8 --max-tokens 9999 --present 0=1024 --present 1=1152
"""

from __future__ import annotations

import argparse
import sys


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--groups", required=True, help="comma list: full:B, swa:B:W, state:B")
    parser.add_argument("--unit", type=int, required=True, help="prefix_match_unit (hash block size)")
    parser.add_argument("--max-tokens", type=int, required=True, help="most tokens that may be restored")
    parser.add_argument(
        "--present",
        action="append",
        default=[],
        metavar="G=t1,t2",
        help="token ends stored for group G (repeatable)",
    )
    parser.add_argument("--hashed-tokens", type=int, default=None, help="where the request's keys end")
    parser.add_argument("--eagle", action="store_true", help="EAGLE block drop on every group")
    parser.add_argument("--eagle-groups", default="", help="comma list of groups that take EAGLE's drop")
    parser.add_argument(
        "--dcp", type=int, default=1, help="decode_context_parallel_size (block sizes per rank)"
    )


def parse_groups(text: str) -> list:
    from umbp.hybrid import FullAttention, RecurrentState, SlidingWindow

    groups = []
    for item in text.split(","):
        kind, *nums = item.strip().split(":")
        try:
            values = [int(n) for n in nums]
            if kind in ("full", "fa") and len(values) == 1:
                groups.append(FullAttention(block_size=values[0]))
            elif kind in ("swa", "sliding") and len(values) == 2:
                groups.append(SlidingWindow(block_size=values[0], window=values[1]))
            elif kind in ("state", "mamba") and len(values) == 1:
                groups.append(RecurrentState(block_size=values[0]))
            else:
                raise ValueError
        except ValueError:
            raise SystemExit(f"umbp explain: bad group {item!r}; use full:B, swa:B:W or state:B") from None
    return groups


def parse_present(items: list[str], num_groups: int) -> list[set[int]]:
    present: list[set[int]] = [set() for _ in range(num_groups)]
    for item in items:
        group, _, ends = item.partition("=")
        try:
            g = int(group)
            present[g].update(int(t) for t in ends.split(",") if t.strip())
        except (ValueError, IndexError):
            raise SystemExit(
                f"umbp explain: bad --present {item!r}; use G=t1,t2 with G < {num_groups}"
            ) from None
    return present


def run(args: argparse.Namespace) -> int:
    from umbp.hybrid import explain

    groups = parse_groups(args.groups)
    present = parse_present(args.present, len(groups))
    eagle_groups = {int(g) for g in args.eagle_groups.split(",") if g.strip()} or None
    try:
        text = explain(
            groups,
            args.unit,
            present,
            args.max_tokens,
            eagle=args.eagle,
            eagle_groups=eagle_groups,
            hashed_tokens=args.hashed_tokens,
            dcp_world_size=args.dcp,
        )
    except ValueError as exc:
        raise SystemExit(f"umbp explain: {exc}") from None
    print(text)
    sys.stdout.flush()
    return 0
