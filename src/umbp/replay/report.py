"""Summaries, the printed table, the JSON and the PNG plots of `umbp replay`.

Works on plain dicts (what :func:`summarize` returns), so results computed in worker processes and
results read back from JSON print and plot the same way. No vLLM import; matplotlib only when plotting.
"""

from __future__ import annotations

import json
import statistics
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

TARGET = 0.99  # the target: >= 99% of the oracle's restorable tokens restored with the page on


def _pct(values: Sequence[float], q: float) -> float:
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def summarize(result, max_examples: int = 20) -> dict[str, Any]:
    """One setting's numbers (``result``: a driver.ReplayResult)."""
    recs = result.records
    layout, totals = result.layout, result.totals
    restorable = sum(r.restorable for r in recs)
    restored = sum(r.restored for r in recs)
    of_oracle = sum(r.restored_of_oracle for r in recs)
    short = [r for r in recs if r.restored_of_oracle < r.restorable]
    # umbp counts every rank vLLM is configured with (TP = dcp here); the layout's other ranks hold the same
    stored_bytes = totals.get("stored_bytes", 0) * (layout.ranks // layout.dcp)
    prompt = sum(r.prompt_tokens for r in recs)
    local = sum(r.local for r in recs)
    ttft = [r.finished_s - r.submitted_s for r in recs if r.finished_s is not None]
    wanted = [r for r in recs if r.restorable > 0]
    return {
        "layout": layout.name,
        "connector": result.setting.connector,
        "boundary_page": result.setting.boundary_page,
        "retention": result.setting.retention,
        "label": result.setting.label,
        "concurrency": result.concurrency,
        "requests": len(recs),
        "sessions": len({r.session for r in recs}),
        "prompt_tokens": prompt,
        "oracle_tokens": sum(r.oracle for r in recs),
        "local_tokens": local,
        "restorable_tokens": restorable,
        "restored_tokens": restored,
        "restored_of_oracle_tokens": of_oracle,
        "restored_beyond_oracle_tokens": restored - of_oracle,
        "restored_fraction_of_restorable": of_oracle / restorable if restorable else 1.0,
        # requests with something restorable that got any of it; prompt tokens not computed (local + restored)
        "request_hit_rate": sum(1 for r in wanted if r.restored_of_oracle > 0) / len(wanted)
        if wanted
        else 1.0,
        "token_hit_rate": (local + restored) / prompt if prompt else 0.0,
        "recomputed_tokens": prompt - local - restored,
        "recomputed_tokens_saved": restored,
        "stopped_early_requests": len(short),
        "stopped_early_tokens_lost": sum(r.restorable - r.restored_of_oracle for r in short),
        "stopped_early_reasons": dict(Counter(r.reason or "unclassified" for r in short).most_common()),
        "stopped_early_examples": [r.to_json() for r in short if r.explain][:max_examples],
        "stored_bytes_all_ranks": stored_bytes,
        "bytes_stored_per_restored_token": stored_bytes / restored if restored else None,
        "stored_objects_by_group": {
            k: v for k, v in sorted(totals.items()) if k.startswith("stored_objects_g")
        },
        "umbp_totals": dict(sorted(totals.items())),
        "preempted_requests": sum(1 for r in recs if r.preemptions),
        "modelled_s": round(result.sim_s, 3),
        "modelled_ttft_s": {
            "p50": round(_pct(ttft, 0.5), 4),
            "p99": round(_pct(ttft, 0.99), 4),
            "mean": round(statistics.fmean(ttft), 4) if ttft else 0.0,
        },
        "modelled_load_s": {
            "p50": round(_pct(result.load_seconds, 0.5), 5),
            "p99": round(_pct(result.load_seconds, 0.99), 5),
            "jobs": len(result.load_seconds),
        },
        "link_bytes_per_rank": result.link_bytes,
        "engine_steps": result.steps,
        "wall_s": round(result.wall_s, 1),
        "timeline": timeline(recs),
    }


def timeline(recs, points: int = 60) -> dict[str, list[float]]:
    """Cumulative restorable and restored-of-oracle tokens over modelled time (for the plot)."""
    done = sorted((r for r in recs if r.finished_s is not None), key=lambda r: r.finished_s)
    if not done:
        return {"t": [], "restorable": [], "restored": []}
    stride = max(1, len(done) // points)
    t, a, b, ra, rb = [], [], [], 0, 0
    for i, r in enumerate(done):
        ra += r.restorable
        rb += r.restored_of_oracle
        if i % stride == 0 or i == len(done) - 1:
            t.append(round(r.finished_s, 2))
            a.append(ra)
            b.append(rb)
    return {"t": t, "restorable": a, "restored": b}


# ------------------------------------------------------------------------------------------ table


def _m(tokens: int) -> str:
    return f"{tokens / 1e6:.2f}M"


def table(summaries: list[dict[str, Any]], header: str) -> str:
    cols = (
        "setting",
        "oracle",
        "GPU local",
        "restorable",
        "restored",
        "% restorable",
        "beyond",
        "stopped early",
        "tokens lost",
        "B stored/restored tok",
    )
    rows = [cols]
    for s in summaries:
        bpt = s["bytes_stored_per_restored_token"]
        rows.append(
            (
                s["label"],
                _m(s["oracle_tokens"]),
                _m(s["local_tokens"]),
                _m(s["restorable_tokens"]),
                _m(s["restored_tokens"]),
                f"{100 * s['restored_fraction_of_restorable']:.2f}%",
                _m(s["restored_beyond_oracle_tokens"]),
                str(s["stopped_early_requests"]),
                _m(s["stopped_early_tokens_lost"]),
                f"{bpt / 1e3:,.1f} KB" if bpt else "-",
            )
        )
    lines = [header, *_aligned(rows)]
    for s in summaries:
        if s["stopped_early_reasons"]:
            reasons = ", ".join(f"{k}: {v}" for k, v in s["stopped_early_reasons"].items())
            lines.append(f"  why stopped early ({s['label']}): {reasons}")
    lines += page_cost(summaries)
    return "\n".join(lines)


def page_cost(summaries: list[dict[str, Any]]) -> list[str]:
    """Per retention value: what the boundary page costs in bytes and buys in restored tokens."""
    out = []
    pairs: dict[int, dict[bool, dict[str, Any]]] = {}
    for s in summaries:
        if s.get("connector", "umbp") != "umbp":
            continue
        pairs.setdefault(s["retention"], {})[s["boundary_page"]] = s
    for ret, pair in pairs.items():
        if len(pair) < 2:
            continue
        on, off = pair[True], pair[False]
        db = (
            on["stored_bytes_all_ranks"] / off["stored_bytes_all_ranks"] - 1
            if off["stored_bytes_all_ranks"]
            else 0
        )
        dr = on["restored_tokens"] / off["restored_tokens"] - 1 if off["restored_tokens"] else 0
        out.append(
            f"  boundary page at retention {ret}: {100 * db:+.1f}% bytes stored "
            f"({on['stored_bytes_all_ranks'] / 1e9:,.1f} vs {off['stored_bytes_all_ranks'] / 1e9:,.1f} GB), "
            f"{100 * dr:+.1f}% tokens restored ({_m(on['restored_tokens'] - off['restored_tokens'])} "
            f"more); old behaviour: "
            f"{100 * off['restored_fraction_of_restorable']:.2f}% of restorable"
        )
    return out


def header_line(layout_summary: str, s: dict[str, Any]) -> str:
    return (
        f"{layout_summary}; concurrency {s['concurrency']}, {s['sessions']} sessions, "
        f"{s['requests']:,} requests, {s['prompt_tokens'] / 1e6:.1f}M prompt tokens"
    )


def verdict(summaries: list[dict[str, Any]], target: float = TARGET) -> list[str]:
    out = []
    for s in summaries:
        if s["boundary_page"] and s.get("connector", "umbp") == "umbp":
            frac = s["restored_fraction_of_restorable"]
            ok = "meets" if frac >= target else "MISSES"
            out.append(
                f"{s['layout']} {s['label']}: {100 * frac:.2f}% of the oracle's restorable tokens "
                f"restored, {ok} the {100 * target:.0f}% target"
            )
    return out


# ------------------------------------------------------------------------------------------ files


def write_json(path: Path, payload: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload, indent=2, default=str))


def plot(summaries: list[dict[str, Any]], title: str, path: Path) -> Path | None:
    """Three panels: % of restorable restored, where prompt tokens came from, restores over time."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    labels = [
        s["label"].replace("vLLM OffloadingConnector", "vLLM Offl.").replace(", ", "\n") for s in summaries
    ]
    fig, axes = plt.subplots(1, 3, figsize=(17, 5.2))
    _bars_fraction(axes[0], summaries, labels)
    _bars_sources(axes[1], summaries, labels)
    _timeline(axes[2], summaries)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _bars_fraction(ax, summaries, labels) -> None:
    vals = [100 * s["restored_fraction_of_restorable"] for s in summaries]
    colors = [_color(s) for s in summaries]
    ax.bar(range(len(vals)), vals, color=colors)
    ax.axhline(100 * TARGET, color="k", linestyle="--", linewidth=1, label=f"target {100 * TARGET:.0f}%")
    for i, v in enumerate(vals):
        ax.text(i, v + 0.3, f"{v:.2f}%", ha="center", fontsize=8)
    ax.set_xticks(range(len(vals)), labels, fontsize=8)
    ax.set_ylim(max(0, min(vals) - 10), 101.5)
    ax.set_ylabel("% of the oracle's restorable tokens restored")
    ax.legend(fontsize=8, loc="lower right")


def _color(s: dict[str, Any]) -> str:
    """umbp with the page green, without it red, a peer connector purple."""
    if s.get("connector", "umbp") != "umbp":
        return "tab:purple"
    return "tab:green" if s["boundary_page"] else "tab:red"


def _bars_sources(ax, summaries, labels) -> None:
    local = [s["local_tokens"] / 1e6 for s in summaries]
    restored = [s["restored_tokens"] / 1e6 for s in summaries]
    recomputed = [s["recomputed_tokens"] / 1e6 for s in summaries]
    x = range(len(summaries))
    ax.bar(x, local, label="GPU prefix cache (local)", color="tab:blue")
    ax.bar(x, restored, bottom=local, label="restored by the connector", color="tab:green")
    ax.bar(
        x, recomputed, bottom=[a + b for a, b in zip(local, restored)], label="recomputed", color="tab:gray"
    )
    ax.set_xticks(list(x), labels, fontsize=8)
    ax.set_ylabel("prompt tokens (millions)")
    ax.legend(fontsize=8)


def _timeline(ax, summaries) -> None:
    for s in summaries:
        tl = s["timeline"]
        style = "-" if s["boundary_page"] else "--"
        ax.plot(tl["t"], [v / 1e6 for v in tl["restored"]], style, label=f"restored ({s['label']})")
    base = summaries[0]["timeline"]
    ax.plot(base["t"], [v / 1e6 for v in base["restorable"]], ":", color="k", label="oracle restorable")
    ax.set_xlabel("modelled time (s)")
    ax.set_ylabel("cumulative tokens (millions)")
    ax.legend(fontsize=7)


# ------------------------------------------------------------------------------------------ peers


def refused_summary(layout_name: str, setting, message: str) -> dict[str, Any]:
    """The row of a connector that refused the layout: its error, verbatim, and no figures."""
    return {
        "layout": layout_name,
        "connector": setting.connector,
        "boundary_page": setting.boundary_page,
        "retention": setting.retention,
        "label": setting.label,
        "refused": message,
    }


SIMULATED_COPY = (
    "vLLM OffloadingConnector: its scheduler side is vLLM's own; its worker copy step is SIMULATED (benchmark "
    "harness only): each job is acknowledged after the delay umbp's simulated workers get"
)


def peer_table(summaries: list[dict[str, Any]], header: str) -> str:
    """umbp (page on / off) beside the peer connector(s): restored vs the oracle's restorable tokens."""
    cols = (
        "row",
        "oracle",
        "restorable",
        "restored",
        "of oracle",
        "ratio",
        "req hit",
        "token hit",
        "DRAM taken",
        "evicted",
    )
    rows = [cols]
    notes = []
    for s in summaries:
        name = s["label"] if s.get("connector") != "umbp" else f"umbp {s['label']}"
        if "refused" in s:
            rows.append((name,) + ("refused",) + ("-",) * (len(cols) - 2))
            notes.append(f"  {name}: refused: {s['refused']}")
            continue
        totals = s["umbp_totals"]
        evicted = totals.get("evicted_objects", totals.get("evictions", 0))
        rows.append(
            (
                name,
                _m(s["oracle_tokens"]),
                _m(s["restorable_tokens"]),
                _m(s["restored_tokens"]),
                _m(s["restored_of_oracle_tokens"]),
                f"{100 * s['restored_fraction_of_restorable']:.2f}%",
                f"{100 * s['request_hit_rate']:.1f}%",
                f"{100 * s['token_hit_rate']:.1f}%",
                f"{s['stored_bytes_all_ranks'] / 1e9:,.1f} GB",
                str(evicted),
            )
        )
        if s["stopped_early_reasons"]:
            top = list(s["stopped_early_reasons"].items())[:3]
            notes.append(f"  why short ({name}): " + ", ".join(f"{k}: {v}" for k, v in top))
    lines = [header, *_aligned(rows)]
    if any(s.get("connector") == "offloading" for s in summaries):
        notes.append(f"  {SIMULATED_COPY}")
    return "\n".join(lines + notes)


PEER_FIELDS = (
    "connector",
    "label",
    "retention",
    "requests",
    "prompt_tokens",
    "oracle_tokens",
    "local_tokens",
    "restorable_tokens",
    "restored_tokens",
    "restored_of_oracle_tokens",
    "restored_fraction_of_restorable",
    "request_hit_rate",
    "token_hit_rate",
    "stored_bytes_all_ranks",
    "stopped_early_requests",
    "stopped_early_reasons",
    "modelled_s",
    "wall_s",
    "refused",
)


def peer_payload(payload: dict[str, Any]) -> dict[str, Any]:
    """The peer rows of a run's ``replay.json``, without timelines and explain texts (``peers.json``)."""
    layouts = {}
    for name, entry in payload["layouts"].items():
        rows = []
        for s in entry["settings"]:
            row = {k: s[k] for k in PEER_FIELDS if k in s}
            if s.get("connector") == "offloading" and "umbp_totals" in s:
                row["offloading_totals"] = s["umbp_totals"]
            elif "umbp_totals" in s:
                row["evictions"] = s["umbp_totals"].get("evictions", 0)
            rows.append(row)
        layouts[name] = {"layout": entry["layout"], "rows": rows}
    return {
        "concurrency": payload["concurrency"],
        "trace": payload["trace"],
        "note": SIMULATED_COPY,
        "layouts": layouts,
    }


def _aligned(rows: list[tuple[str, ...]]) -> list[str]:
    """Rows as text columns (the first left-aligned, the rest right-aligned), a rule under the first row."""
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = []
    for n, row in enumerate(rows):
        lines.append(
            "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths)))
        )
        if n == 0:
            lines.append("-" * len(lines[-1]))
    return lines
