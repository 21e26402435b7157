"""What ``benchmarks.opus_size`` measured, and its tables: the points (our server and CTranslate2
at each precision and beam), single-request latency, start-up, memory, the weights' sizes and the
step profile (``Report``), written as Markdown (``markdown``)."""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from typing import Any


@dataclass
class Point:
    precision: str
    beam: int
    run: int
    server: float | None  # sentences/s (200 answers); None: not run at this precision
    errors: int
    latency_ms: dict[str, float]
    ct2: dict[str, float]  # thread layout -> sentences/s, measured just before
    other_load: dict[str, float | None]  # share of the CPUs other processes took: in CT2's runs, wrk's

    @property
    def ratio(self) -> float | None:
        return None if self.server is None else self.server / max(self.ct2.values())


@dataclass
class Report:
    points: list[Point] = field(default_factory=list)
    startup: dict[str, Any] = field(default_factory=dict)
    memory: dict[str, Any] = field(default_factory=dict)
    profile: dict[str, Any] = field(default_factory=dict)
    sizes: dict[str, Any] = field(default_factory=dict)
    # (precision, beam) -> single-request p50 ms: ours (one wrk connection) and CTranslate2's best
    # layout translating each sentence alone
    latency: dict[str, dict[str, Any]] = field(default_factory=dict)


def markdown(report: Report, length: int) -> str:
    lines = [
        "| precision | search | CT2 best sentences/s (tokens/s) | ours sentences/s (tokens/s) "
        "| ours / CT2 per run | median |",
        "|---|---|---:|---:|---|---:|",
    ]
    for precision, beam in dict.fromkeys((p.precision, p.beam) for p in report.points):
        ps = [p for p in report.points if (p.precision, p.beam) == (precision, beam)]
        best = statistics.median(max(p.ct2.values()) for p in ps)
        measured = [p for p in ps if p.server is not None and p.ratio is not None]
        estimate = (
            report.profile.get(precision, {}).get("estimated_server_sentences_per_s", {}).get(str(beam))
        )
        if measured:
            ours = statistics.median(p.server for p in measured if p.server is not None)
            cells = (
                f"{ours:.1f} ({ours * length:,.0f})",
                ", ".join(f"{p.ratio:.2f}" for p in measured if p.ratio is not None),
                f"**{statistics.median(p.ratio for p in measured if p.ratio is not None):.2f}×**",
            )
        elif estimate:
            cells = (f"~{estimate:.1f} (estimated from the step)", "—", f"~{estimate / best:.2f}× (estimate)")
        else:
            cells = ("—", "—", "—")
        lines.append(
            f"| {precision} | {'greedy' if beam == 1 else f'beam {beam}'} "
            f"| {best:.1f} ({best * length:,.0f}) | " + " | ".join(cells) + " |"
        )
    if report.latency:
        lines += [
            "",
            "| precision / beam | ours p50 ms (one request at a time) | CT2 p50 ms (batch of one) | ratio |",
            "|---|---:|---:|---:|",
        ]
        for key, lat in report.latency.items():
            lines.append(
                f"| {key} | {lat['ours_p50_ms']:.1f} | {lat['ct2_p50_ms']:.1f} ({lat['ct2_threads']}) "
                f"| {lat['ours_p50_ms'] / lat['ct2_p50_ms']:.2f}× |"
            )
    if report.memory:
        lines += ["", memory_table(report.memory)]
    return "\n".join(lines)


def memory_table(memory: dict[str, Any]) -> str:
    """Resident MiB: CTranslate2's process in each layout (loaded, after the runs, its peak) and our
    server's processes summed (under the warm-up's load, right after the runs, idle 3 s later,
    each process's peak summed, and PSS idle: shared pages counted once)."""
    lines = [
        "| precision | CT2 2x1 / 1x2: loaded, after runs, peak | ours: under load, after runs, idle, "
        "peaks summed, PSS idle | ours idle / CT2 2x1 after runs |",
        "|---|---|---|---:|",
    ]
    for precision, m in memory.items():
        ct2 = m.get("ct2", {})
        ct2_cells = " / ".join(
            f"{c['rss_after_load_mib']:.0f}, {c['rss_mib']:.0f}, {c['hwm_mib']:.0f}" for c in ct2.values()
        )
        ours = [m.get(k) for k in ("server", "server_after", "server_idle")]
        if any(x is None for x in ours):
            continue
        idle = m["server_idle"]
        ours_cells = (
            ", ".join(f"{x['rss_mib_total']:.0f}" for x in ours)
            + f", {idle.get('hwm_mib_total', float('nan')):.0f}, {idle['pss_mib_total']:.0f}"
        )
        ratio = idle["rss_mib_total"] / ct2["2x1"]["rss_mib"] if "2x1" in ct2 else float("nan")
        lines.append(f"| {precision} | {ct2_cells} | {ours_cells} | {ratio:.2f}× |")
    return "\n".join(lines)
