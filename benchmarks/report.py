"""One run's results as tables: printed on the terminal, and as Markdown for
docs/benchmarks.md (the part between the ``results`` markers; the rest is prose)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import msgspec

BEGIN = "<!-- results:begin (written by python -m benchmarks; do not edit by hand) -->"
END = "<!-- results:end -->"


Row = tuple[str, ...]


class Table(msgspec.Struct):
    title: str
    header: tuple[str, ...]
    rows: list[Row]
    note: str = ""


def _f(v: Any, digits: int = 1) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:,.{digits}f}"
    if isinstance(v, int):
        return f"{v:,}"
    return str(v)


def _lat(s: dict[str, Any]) -> str:
    return f"{_f(s['p50_ms'], 2)} / {_f(s['p99_ms'], 2)} / {_f(s['max_ms'], 1)}"


def _errors(s: dict[str, Any]) -> str:
    """Errors, and requests still unanswered at the window's end when one had waited 1 s+
    (a few requests are always in flight when a window closes)."""
    text = _f(s["errors"], 0)
    waited = s.get("unfinished_max_ms") or 0
    if s.get("unfinished") and waited >= 1000:
        text += f" (+{s['unfinished']} unanswered, up to {waited / 1000:.1f} s)"
    return text


def _paths(per_hour: dict[str, int]) -> str:
    return ", ".join(f"{p} {n:,}" for p, n in sorted(per_hour.items(), key=lambda x: -x[1]))


def replay_table(title: str, doc: dict[str, Any], note: str) -> Table:
    rows: list[Row] = []
    for n, w in sorted(doc["by_clients"].items(), key=lambda x: int(x[0])):
        for h in ("slow", "fast"):
            r = w[h]
            lat = r["latency"]
            backlog = r.get("backlog")
            rows.append((str(n), {"slow": "1 s", "fast": "1 ms"}[h], _lat(lat["models"]),
                         _lat(lat["status_all"]),
                         _errors(lat["models"]) + " / " + _errors(lat["status_all"]),
                         _f(r["engine_requests_per_hour_total"], 0),
                         _paths(r["engine_requests_per_hour"]),
                         _f(r["manager_cpu_pct"]), _f(r["manager_rss_mb"]))
                        + ((_f(backlog["waiting_for_lock"], 0),) if backlog else ()))
        if "floor" in w:
            lat = w["floor"]["latency"]
            rows.append((str(n), "floor", _lat(lat["models"]), _lat(lat["status_all"]),
                         _errors(lat["models"]) + " / " + _errors(lat["status_all"]), "", "",
                         _f(w["floor"]["manager_cpu_pct"]), ""))
        ratio = w["ratio_slow_fast"]
        rows.append((str(n), "ratio", f"{_f(ratio['models_p50_ms'], 2)} / "
                     f"{_f(ratio['models_p99_ms'], 2)} / {_f(ratio['models_max_ms'], 2)}",
                     f"{_f(ratio['status_all_p50_ms'], 2)} / "
                     f"{_f(ratio['status_all_p99_ms'], 2)} / "
                     f"{_f(ratio['status_all_max_ms'], 2)}", "", "", "",
                     f"load gen. {_f(w.get('clients_cpu_pct'))}", "")
                    + (("",) if "backlog" in w["slow"] else ()))
    header: tuple[str, ...] = (
        "N", "/health", "/v1/models p50 / p99 / max ms", "status p50 / p99 / max ms",
        "errors models / status", "engine req/h", "by path (per hour)", "CPU %", "RSS MB")
    if any("backlog" in w["slow"] for w in doc["by_clients"].values()):
        header += ("status calls queued at the end",)
    return Table(title, header, rows, note)


SIDE_BY_SIDE = ("/v1/models nvpair p50 / p99 / max ms", "floor p50 / p99 / max ms",
                "p99 vs floor", "/healthz max ms nvpair / floor",
                "loop lag max ms start / load / idle / floor under load")
_SIDE_NOTE = ("Under load: 8 back-to-back clients going round nvpair and the floor (hypercorn "
              "answering the bytes nvpair answered, nothing behind it) in the same window, "
              "/healthz every 50 ms on each from another process; loop lag: the longest "
              "gap between ticks of a 5 ms timer in nvpair (start: until everything was "
              "listed) and in the floor "
              "(the machine's share: the floor does nothing but answer).")


def _side_by_side(r: dict[str, Any]) -> Row:
    lag = r["loop_lag"]
    start = r["first_listing"].get("loop_lag", {}).get("max_ms")
    return (_lat(r["load"]["models"]), _lat(r["floor"]["models"]),
            _f(r["models_over_floor"]["p99_ms"], 2),
            f"{_f(r['load']['healthz']['max_ms'], 1)} / {_f(r['floor']['healthz']['max_ms'], 1)}",
            f"{_f(start, 1)} / {_f(lag['load']['max_ms'], 1)} / {_f(lag['idle']['max_ms'], 1)}"
            f" / {_f(lag.get('floor_load', {}).get('max_ms'), 1)}")


def tables(results: dict[str, Any]) -> list[Table]:
    out: list[Table] = []
    sc = results.get("scenarios", {})
    if "replay" in sc and "by_clients" in sc["replay"]:
        out.append(replay_table(
            "1. The report replayed: nvpair", sc["replay"],
            "Pollers: two at 5 s, one at 10 s, one at 1 s (on the status), plus N back-to-back "
            "clients alternating /v1/models and the status. The slow (/health 1 s) and fast "
            "(1 ms) stacks ran in the same window, each client going round both in turn; 'ratio' "
            "rows are slow / fast. 'floor' rows: a control in the same round, hypercorn's trio "
            "worker answering nvpair's bytes with nothing behind it (the machine's and the "
            "server's share of the latency). CPU and RSS are the manager process's; 'load gen.' "
            "is the CPU of the poller process (all clients, all targets)."))
    if "baseline" in sc and "by_clients" in sc["baseline"]:
        out.append(replay_table(
            "2. The design that failed (benchmarks/baseline.py), same pollers", sc["baseline"],
            "Status re-runs GET /health (readiness) and GET /get_model_info (identity) under "
            "the engine's lock on every call; /v1/models calls status first. One poller process "
            "per stack. 'unanswered': still waiting when the window closed."))
    scale = sc.get("scale")
    rows: list[Row]
    if scale and "by_k" in scale:
        rows = []
        for r in scale["by_k"]:
            fl = r["first_listing"]
            b = r["behaviours"]
            rows.append((str(r["k"]), f"{b['quick']}/{b['hung']}/{b['slow']}",
                         str(r["sim_processes"]), _f(fl["api_answered_s"], 2),
                         _f(fl["all_quick_listed_s"], 2), _f(fl["all_slow_listed_s"], 2),
                         *_side_by_side(r), _f(r["idle_cpu_pct"], 2),
                         _f(r["idle_cpu_pct"] / r["k"], 4), _f(r["rss_mb"]), str(r["fds"])))
        g = scale["growth"]
        slopes = ", ".join(f"{s['from_k']}->{s['to_k']}: {_f(s['slope'], 2)}"
                           for s in g["idle_cpu_slopes"])
        out.append(Table(
            "3. Scale: K engines, a quarter hung or slow",
            ("K", "quick/hung/slow", "sim procs", "API up s", "all quick listed s",
             "all slow listed s", *SIDE_BY_SIDE, "idle CPU %", "idle CPU % per engine",
             "RSS MB", "fds"),
            rows,
            f"Times are from nvpair's process start. {_SIDE_NOTE} Idle CPU log-log slopes: "
            f"{slopes}; RSS per added engine: {_f(g.get('rss_per_engine_kb'), 0)} KB."))
    many = sc.get("models")
    if many and "load" in many:
        fl = many["first_listing"]
        out.append(Table(
            f"3b. Many models: {many['engines']} Ollama-like engines x "
            f"{many['models_per_engine']:,} models",
            ("models", "API up s", "all listed s", *SIDE_BY_SIDE, "idle CPU %",
             "idle CPU % per engine", "RSS MB", "fds"),
            [(f"{many['models']:,}", _f(fl["api_answered_s"], 2), _f(fl["all_listed_s"], 2),
              *_side_by_side(many), _f(many["idle_cpu_pct"], 2),
              _f(many["idle_cpu_pct"] / many["engines"], 4), _f(many["rss_mb"]),
              str(many["fds"]))],
            f"Times are from nvpair's process start. {_SIDE_NOTE} /v1/models body: "
            f"{many['load']['body_bytes']:,} B."))
    cost = sc.get("probe_cost")
    if cost and "cpu_us_per_probe" in cost:
        us = cost["cpu_us_per_probe"]
        out.append(Table(
            "3c. CPU per probe, each way a probe goes",
            ("way", "CPU µs per probe (best run)", "runs"),
            [(way, _f(us[way], 0), " / ".join(_f(x, 0) for x in cost["runs_us"][way]))
             for way in us],
            f"GET /health of a vLLM simulator, {cost['probes_per_run']:,} probes a run, "
            f"{cost['rounds']} interleaved rounds. pooled_kept: httpcore2's pool reusing a "
            "kept-alive connection (probes within 4 s); pooled_closed: the pool asking the "
            "engine to close after each answer (probes further apart, before "
            "nvpair.probing.oneshot); "
            "one_shot: a connection of its own (those probes now). one_shot / pooled_closed: "
            f"{_f(cost['one_shot_over_pooled_closed'], 2)}."))
    tp = sc.get("throughput")
    if tp and "servers" in tp:
        rows = []
        for name, by_path in tp["servers"].items():
            for path, v in by_path.items():
                ratio = tp["ratios"][path]
                rel = {"nvpair": ratio.get("nvpair_over_floor"),
                       "floor_quart": ratio.get("quart_over_floor"),
                       "floor_asgi": 1.0}.get(name)
                rel_cpu = {"nvpair": ratio.get("nvpair_over_floor_by_cpu"),
                           "floor_quart": ratio.get("quart_over_floor_by_cpu"),
                           "floor_asgi": 1.0}.get(name)
                rows.append((str(name), str(path), _f(v["rps"], 0),
                             " / ".join(_f(x, 0) for x in v["rps_runs"]),
                             f"{_f(v['p50_ms'], 1)} / {_f(v['p99_ms'], 1)}",
                             _f(v["server_cpu_us_per_request"], 0), _f(v["errors"], 0),
                             _f(rel, 2), _f(rel_cpu, 2)))
        out.append(Table(
            "4. Throughput, 16 connections",
            ("server", "path", "req/s (median)", "runs", "p50 / p99 ms", "server CPU µs/req",
             "errors", "vs floor (req/s)", "vs floor (CPU/req)"), rows,
            f"Load generator: {tp['load_generator']}; {tp['repetitions']} interleaved runs of "
            f"{tp['window_s']:g} s each. {tp['engines']} engines; bodies "
            + ", ".join(f"{p} {n:,} B" for p, n in tp["body_bytes"].items())
            + f". {tp['quart']}."))
    soak = sc.get("soak")
    if soak and "before" in soak:
        b, a = soak["before"], soak["after"]
        mid = soak.get("after_status_calls", {})
        rows = [(k, _f(b[k]), _f(mid.get(k)), _f(a[k]))
                for k in ("rss_mb", "fds", "fds_not_sockets", "sockets", "probe_sockets",
                          "api_connections", "close_wait", "sim_fds", "sim_close_wait")]
        out.append(Table(
            "5. Soak", ("", "before", "after the status calls and timeouts",
                        "after the connection churn too"), rows,
            f"{soak['status_calls']:,} status calls ({soak['status_rps']:,.0f} req/s, "
            f"{soak['status_errors']} errors) and {soak['probe_timeouts']:,} probe timeouts "
            f"({soak['engines']} engines on one hung simulator, probe interval and timeout "
            f"{soak['probe_interval_and_timeout_s']:g} s). RSS growth "
            f"{soak['rss_growth_mb']:+.2f} MB, peak RSS {soak['peak_rss_mb']} MB. "
            + _churn(soak)))
    errors: list[Row] = [(str(name), str(doc["error"]).splitlines()[-1][:200])
              for name, doc in sc.items() if isinstance(doc, dict) and "error" in doc]
    if errors:
        out.append(Table("Scenarios that failed", ("scenario", "error"), errors))
    targets = results.get("targets", [])
    if targets:
        out.append(Table("Targets", ("", "target", "figure", "result"), [
            (t["name"], t["target"], t["figure"],
             ("met" if t["met"] else "NOT MET") if t["kind"] == "target"
             else ("reproduced" if t["met"] else "not reproduced") if t["kind"] == "check"
             else "-")
            for t in targets]))
    return out


def _churn(soak: dict[str, Any]) -> str:
    c = soak.get("connection_churn")
    if not c:
        return ""
    return (f"Connection churn: {c['requests']:,} status calls on a new connection each "
            f"({c['rate_per_s']:,.0f}/s, {c['errors']} errors) peaked at {c['peak_fds']} fds "
            f"and {c['peak_close_wait']} API sockets in CLOSE-WAIT; CLOSE-WAIT was gone "
            f"{c['close_wait_cleared_after_s']:g} s after the last request.")


def render_text(ts: list[Table]) -> str:
    lines = []
    for t in ts:
        lines += ["", t.title, "-" * len(t.title)]
        widths = [max(len(str(x)) for x in col) for col in zip(t.header, *t.rows, strict=False)]
        widths = [min(w, 60) for w in widths]
        lines.append("  ".join(h.ljust(w) for h, w in zip(t.header, widths, strict=False)))
        for r in t.rows:
            lines.append("  ".join(str(c).ljust(w) for c, w in zip(r, widths, strict=False)))
        if t.note:
            lines.append(t.note)
    return "\n".join(lines) + "\n"


def render_markdown(ts: list[Table], meta: dict[str, Any]) -> str:
    m = meta["machine"]
    lines = [
        f"Run of {meta['date']} ({'quick' if meta['quick'] else 'full'}, "
        f"{meta['elapsed_s']:.0f} s): {m['nproc']} cores, {m['cpu_model']}, {m['memory']}, "
        f"Python {m['python']}; load average {m['loadavg_at_start']} at the start, "
        f"{meta.get('loadavg_at_end')} at the end. nvpair at commit "
        f"{meta.get('nvpair_commit', 'unknown')}. Command: `{meta['command']}`. "
        f"JSON: `{meta['json']}`.",
    ]
    for t in ts:
        lines += ["", f"### {t.title}", ""]
        lines.append("| " + " | ".join(t.header) + " |")
        lines.append("|" + "|".join("---" for _ in t.header) + "|")
        for r in t.rows:
            lines.append("| " + " | ".join(str(c).replace("|", "\\|") for c in r) + " |")
        if t.note:
            lines += ["", t.note]
    return "\n".join(lines) + "\n"


def update_doc(path: Path, section: str) -> None:
    """Replace the results section of ``path`` (between the markers), or append one."""
    text = path.read_text() if path.exists() else "# Benchmarks\n\n## Results\n\n"
    block = f"{BEGIN}\n{section}{END}"
    if BEGIN in text and END in text:
        text = re.sub(re.escape(BEGIN) + r".*?" + re.escape(END), lambda _: block, text,
                      flags=re.S)
    else:
        text = text.rstrip("\n") + "\n\n" + block + "\n"
    path.write_text(text)
