"""The table and the PNG of `specchat bench gpu`, made from its JSON report alone (so a report
that came back from another machine prints and plots the same way).

What this module does not do: measure anything (bench_gpu, bench_gpu_passes).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from engine.cli.bench_gpu_lean import lean_lines
from engine.units import GB, GIB

STREAM_GOAL, PLANNER_GOAL = 0.85, 0.20


def _s(value: float | None, width: int = 8, digits: int = 3) -> str:
    return f"{value:>{width}.{digits}f}" if isinstance(value, (int, float)) else f"{'-':>{width}}"


def _result(data: dict[str, Any], name: str) -> dict[str, Any]:
    return data.get("sections", {}).get(name, {}).get("result") or {}


def cap_sections(data: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    return [(name, entry) for name, entry in data.get("sections", {}).items() if name.startswith("cap ")]


def planner_check(rows: list[dict[str, Any]]) -> tuple[int, int, float | None]:
    """(rows within 20 % of the planner's target pass time, rows compared, worst ratio)."""
    ratios = [r["target_ratio"] for r in rows if isinstance(r.get("target_ratio"), (int, float))]
    within = sum(1 for x in ratios if abs(x - 1.0) <= PLANNER_GOAL)
    worst = max(ratios, key=lambda x: abs(x - 1.0)) if ratios else None
    return within, len(ratios), worst


def format_summary(data: dict[str, Any]) -> str:
    env = _result(data, "environment")
    dry = data.get("mode") != "gpu"
    lines = []
    if dry:
        lines.append("SpecChat GPU proof: CPU DRY RUN on tiny shapes. It checks the code paths only; GPU figures "
                     "need a GPU (`specchat bench gpu` on a CUDA machine).")
    else:
        lines.append(f"SpecChat GPU proof: {env.get('device', '?')} ({(env.get('memory_total') or 0) / GIB:.1f} GiB), "
                     f"torch {env.get('packages', {}).get('torch')} (CUDA {env.get('torch_cuda')}), "
                     f"{data.get('started', '')}")
    states = [f"{name} {e['status']}" + (f" {e['seconds']:.0f} s" if "seconds" in e else "")
              for name, e in data.get("sections", {}).items()]
    lines.append("sections: " + " | ".join(states))
    for name, e in data.get("sections", {}).items():
        if e["status"] != "ok":
            lines.append(f"  {name}: {e['status']}: {e.get('error', '')}")
    if env.get("missing"):
        lines.append(f"missing packages: {', '.join(env['missing'])}")
    tests = _result(data, "tests")
    if tests:
        counts = tests.get("counts", {})
        lines.append(f"gpu-marked tests: {tests.get('summary') or tests.get('outcome', '?')}"
                     + (f" (log: {tests['log']})" if tests.get("log") else ""))
        lines += [f"  {t}" for t in tests.get("tests", []) if not t.startswith("PASSED")][:20]
        if counts.get("failed"):
            lines.append(f"  {counts['failed']} gpu test(s) FAILED")
    installer = _result(data, "installer")
    if installer:
        lines.append(f"installer check: {installer.get('torch_build') or installer.get('note', '?')}")
    profile = _result(data, "profile")
    if profile:
        lines += [f"profile: {line}" for line in profile.get("summary", [])[4:]]
    build = _result(data, "build")
    if build:
        lines.append(f"target: {build['layers_built']} of {build['layers_full']} layers of {build['target']} in NF4, "
                     f"{build['layer_bytes'] / 1e6:.1f} MB each, {build['host_bytes'] / GB:.1f} GB in RAM "
                     f"(pinned: {'yes' if build['pinned'] else 'NO'}); embeddings and head {build['embeddings']}; "
                     f"draft {build['draft']}, {build['draft_params'] / 1e6:,.1f} M parameters, resident; {build['dtype']}")
    lines += lean_lines(_result(data, "lean"))
    lines += _streaming_lines(_result(data, "streaming"), dry)
    measured = [(name, entry["result"]) for name, entry in cap_sections(data) if entry.get("result")]
    for name, cap in measured:
        lines += _cap_lines(name, cap, dry, build.get("layers_full", 0))
    if measured:
        lines.append("tok/pass: tokens per target pass measured on this repository's CPU benchmark (README "
                     "'Measured': SmolLM2-135M + FP4 proxy draft, greedy), not on these random models; "
                     "tok/s = tok/pass / step s")
    return "\n".join(lines)


def _streaming_lines(st: dict[str, Any], dry: bool) -> list[str]:
    if not st:
        return []
    lines = ["", f"streaming {st['layers']} layers from RAM, {st['bytes_per_pass'] / GB:.2f} GB per pass; plain pinned "
             f"copy of the same bytes {st['plain_copy_gbps']:.1f} GB/s",
             f"{'tokens':>6} {'pass s':>8} {'GB/s':>7} {'of copy':>8} {'alone GB/s':>11} {'compute s':>10} {'overlap':>8}"]
    for r in st.get("rows", []):
        if "pass_s" not in r:
            lines.append(f"{r['tokens']:>6} {r.get('skipped', r.get('error', ''))}")
            continue
        lines.append(f"{r['tokens']:>6} {_s(r['pass_s'])} {r['pass_gbps']:>7.1f} {100 * r['of_plain']:>7.0f}% "
                     f"{r['streamer_alone_gbps']:>11.1f} {_s(r['compute_only_s'], 10)} {100 * r['overlap']:>7.0f}%")
    if dry:
        lines.append("(dry run: a CPU \"copy\" is a RAM copy and tiny layers cost more to run than to move; no goal)")
    elif "goal_met" in st:
        lines.append(f"goal: >= {100 * STREAM_GOAL:.0f} % of the pinned copy while layers compute: "
                     f"{'met' if st['goal_met'] else 'NOT met'} ({100 * st['goal_of_plain']:.0f} %)")
    return lines


def _cap_lines(name: str, cap: dict[str, Any], dry: bool, full: int) -> list[str]:
    head = f"{name}: {cap.get('placement', '?')}"
    if cap.get("planner_choice"):
        head += f"; planner: {cap['planner_choice']}"
    lines = ["", head] + ([f"  {cap['note']}"] if cap.get("note") else [])
    scaled = any("scaled_step_s" in r for r in cap.get("rows", []))
    title = (f"{'mode':<15}{'budget':>7}{'draft s':>9}{'pred':>8}{'target s':>9}{'pred':>8}{'ratio':>7}"
             f"{'other s':>8}{'step s':>8}{'tok/pass':>9}{'tok/s':>8}{'pred':>8}"
             + (f"{f'{full}L tok/s':>10}" if scaled else ""))
    lines += [title, "-" * len(title)]
    for r in cap.get("rows", []):
        budget = r["budget"] or "-"
        if "step_s" not in r:
            lines.append(f"{r['mode']:<15}{budget:>7}  {r.get('error') or r.get('skipped', '')}")
            continue
        mark = "" if r["tokens_per_pass_source"] in ("CPU bench", "autoregressive") else \
            "~" if "interpolated" in r["tokens_per_pass_source"] else ">"
        ratio = f"{r['target_ratio']:>7.2f}" if isinstance(r.get("target_ratio"), float) else f"{'-':>7}"
        lines.append(f"{r['mode']:<15}{budget:>7}{_s(r['draft_s'], 9)}{_s(r.get('pred_draft_s'))}"
                     f"{_s(r['target_s'], 9)}{_s(r.get('pred_target_s'))}{ratio}{_s(r['other_s'], 8)}"
                     f"{_s(r['step_s'], 8)}{mark + format(r['tokens_per_pass'], '.2f'):>9}{_s(r['tok_s'], 8, 2)}"
                     f"{_s(r.get('pred_tok_s'), 8, 2)}" + (_s(r.get("scaled_tok_s"), 10, 2) if scaled else ""))
    if scaled:
        lines.append(f"  {full}L: scaled to all {full} layers: the layers not built added as streamed ones at the "
                     "measured time per streamed layer")
    within, compared, worst = planner_check(cap.get("rows", []))
    if compared and not dry:
        lines.append(f"goal: target pass within {100 * PLANNER_GOAL:.0f} % of the planner: {within} of {compared} "
                     f"(worst {worst:.2f}x)")
    layer_rows = [r for r in cap.get("rows", []) if r.get("streamed_layer_s") or r.get("resident_layer_s")]
    for r in layer_rows[:1] + layer_rows[-1:] if len(layer_rows) > 1 else layer_rows:
        lines.append(f"  per layer at budget {r['budget'] or 1}: resident {_ms(r.get('resident_layer_s'))} "
                     f"(pred {_ms(r.get('pred_resident_layer_s'))}), streamed {_ms(r.get('streamed_layer_s'))} "
                     f"(pred {_ms(r.get('pred_streamed_layer_s'))})")
    return lines


def _ms(value: float | None) -> str:
    return f"{1e3 * value:.2f} ms" if isinstance(value, (int, float)) else "-"


def write_plot(data: dict[str, Any], path: Path) -> Path | None:
    """Three panels: host-to-device GB/s of the streamed pass vs the pinned copy; target pass
    time per budget, measured and predicted, per cap; tok/s per budget per cap. None (with a
    note) without matplotlib."""
    from engine.cli.bench import pyplot

    plt = pyplot()
    if plt is None:
        return None
    fig, (ax_rate, ax_pass, ax_tps) = plt.subplots(1, 3, figsize=(14, 4))
    st = _result(data, "streaming")
    rows = [r for r in st.get("rows", []) if "pass_s" in r]
    if rows:
        xs = range(len(rows))
        ax_rate.bar([x - 0.2 for x in xs], [r["pass_gbps"] for r in rows], 0.4, label="streamed pass (layers compute)")
        ax_rate.bar([x + 0.2 for x in xs], [r["streamer_alone_gbps"] for r in rows], 0.4, label="streamer alone")
        ax_rate.axhline(st["plain_copy_gbps"], color="k", linestyle="--", label="plain pinned copy")
        ax_rate.axhline(STREAM_GOAL * st["plain_copy_gbps"], color="grey", linestyle=":", label="goal (85 %)")
        ax_rate.set_xticks(list(xs), [str(r["tokens"]) for r in rows])
        ax_rate.legend(fontsize=7)
    ax_rate.set(xlabel="tokens per pass", ylabel="host -> device GB/s", title="streaming")
    for name, entry in cap_sections(data):
        spec = [r for r in (entry.get("result") or {}).get("rows", []) if "step_s" in r and r["budget"]]
        if not spec:
            continue
        b = [r["budget"] for r in spec]
        line = ax_pass.plot(b, [r["target_s"] for r in spec], "o-", label=f"{name} measured")[0]
        if all("pred_target_s" in r for r in spec):
            ax_pass.plot(b, [r["pred_target_s"] for r in spec], "--", color=line.get_color(), label=f"{name} planner")
        ax_tps.plot(b, [r["tok_s"] for r in spec], "o-", color=line.get_color(), label=name)
        ar = next((r for r in (entry.get("result") or {}).get("rows", []) if r["budget"] == 0 and "tok_s" in r), None)
        if ar:
            ax_tps.axhline(ar["tok_s"], color=line.get_color(), linestyle=":")
    for ax, label, title in ((ax_pass, "target pass s", "pass time"),
                             (ax_tps, "tok/s (CPU-bench tokens per pass)", "speed (dotted: autoregressive)")):
        ax.set_xscale("log", base=2)
        budgets = sorted({r["budget"] for _, e in cap_sections(data) for r in (e.get("result") or {}).get("rows", [])
                          if r.get("budget")})
        if budgets:
            ax.set_xticks(budgets, [str(b) for b in budgets])
        ax.set(xlabel="tree budget", ylabel=label, title=title)
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7)
    env = _result(data, "environment")
    fig.suptitle("CPU dry run (tiny shapes): no GPU figures" if data.get("mode") != "gpu"
                 else f"{env.get('device', '')}: 70B-shaped NF4 target streamed, 1B draft", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path
