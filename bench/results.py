"""Results: every measured run, the medians, the ratios; a table, JSON and PNG plots.

Ratios are the point (machines are noisy and small): for each pair (A, B) the ratio
A/B of the primary figure is taken *per repetition* - A and B ran next to each other
in the interleaved order - and the median of those per-repetition ratios is reported
with their range. Absolute figures are printed for context only.
"""
from __future__ import annotations

import json
import statistics
from dataclasses import dataclass, field
from pathlib import Path

from .system import ROLE_THREADS, role_key


@dataclass
class Run:
    workload: str
    case: str
    target: str
    rep: int
    primary: str
    figures: dict
    kspeedfs: dict | None = None       # daemon counters, delta over the run


@dataclass
class Results:
    meta: dict
    runs: list[Run] = field(default_factory=list)
    ratio_pairs: dict[str, list[tuple[str, str]]] = field(default_factory=dict)   # per workload
    errors: list[dict] = field(default_factory=list)

    # -- summaries -------------------------------------------------------------------------

    def cases(self) -> list[tuple[str, str]]:
        seen: list[tuple[str, str]] = []
        for r in self.runs:
            if (r.workload, r.case) not in seen:
                seen.append((r.workload, r.case))
        return seen

    def targets(self, workload: str) -> list[str]:
        seen: list[str] = []
        for r in self.runs:
            if r.workload == workload and r.target not in seen:
                seen.append(r.target)
        return seen

    def _values(self, wl: str, case: str, target: str) -> dict[int, float]:
        return {r.rep: r.figures[r.primary] for r in self.runs
                if r.workload == wl and r.case == case and r.target == target}

    def _cpu_without_nic(self, wl: str, case: str, target: str) -> dict[int, float]:
        """Per rep: the daemon's CPU-s per GB less its emulated NIC's threads (the soft
        provider's, when it reports them; else all of it)."""
        return {r.rep: r.figures["daemon_cpu_s_per_GB"] - r.figures.get("daemon_nic_cpu_s_per_GB", 0.0)
                for r in self.runs if r.workload == wl and r.case == case and r.target == target
                and "daemon_cpu_s_per_GB" in r.figures}

    @staticmethod
    def _spread(per_rep: list[float]) -> dict:
        return {"median": statistics.median(per_rep), "min": min(per_rep), "max": max(per_rep),
                "n": len(per_rep)}

    def summary(self) -> list[dict]:
        out = []
        for wl, case in self.cases():
            primary = next(r.primary for r in self.runs if r.workload == wl and r.case == case)
            row: dict = {"workload": wl, "case": case, "primary": primary, "targets": {}, "ratios": {},
                         "cpu_ratios": {}}
            for t in self.targets(wl):
                v = list(self._values(wl, case, t).values())
                if v:
                    row["targets"][t] = {"median": statistics.median(v), "min": min(v), "max": max(v),
                                         "n": len(v)}
                    for k in ("daemon_cpu_%", "daemon_cpu_s_per_GB", "daemon_nic_cpu_s_per_GB",
                              "daemon_main_cpu_s_per_GB", *map(role_key, ROLE_THREADS),
                              "daemon_cpu_us_per_op", "daemon_main_cpu_us_per_op",
                              "host_cpu_s_per_GB", "peers_nic_cpu_s_per_GB"):
                        cpu = [r.figures[k] for r in self.runs if r.workload == wl
                               and r.case == case and r.target == t and k in r.figures]
                        if cpu:
                            row["targets"][t][k] = statistics.median(cpu)
            for a, b in self.ratio_pairs.get(wl, []):
                va, vb = self._values(wl, case, a), self._values(wl, case, b)
                per_rep = [va[k] / vb[k] for k in va if k in vb and vb[k] > 0]
                if per_rep:
                    row["ratios"][f"{a} / {b}"] = self._spread(per_rep)
                # the peer-read figure: a's CPU per GB without the emulated NIC against
                # b's, per rep (only where a reports its NIC threads: the cluster targets)
                if any("daemon_nic_cpu_s_per_GB" in r.figures for r in self.runs
                       if r.workload == wl and r.case == case and r.target == a):
                    ca, cb = self._cpu_without_nic(wl, case, a), self._cpu_without_nic(wl, case, b)
                    per_rep = [ca[k] / cb[k] for k in ca if k in cb and cb[k] > 0]
                    if per_rep:
                        row["cpu_ratios"][f"{a} / {b}"] = self._spread(per_rep)
            out.append(row)
        return out

    # -- writers ---------------------------------------------------------------------------

    def table(self) -> str:
        lines = []
        for row in self.summary():
            head = f"{row['workload']} / {row['case']}  ({row['primary']}, median of {_n(row)})"
            lines.append(head)
            for t, s in row["targets"].items():
                cpu = f"   daemon CPU {s['daemon_cpu_%']:.0f}%" if "daemon_cpu_%" in s else ""
                if "daemon_cpu_s_per_GB" in s:
                    cpu += f", {s['daemon_cpu_s_per_GB']:.2f} s/GB"
                    parts = [f"{label} {s[k]:.2f}" for label, k in (
                        ("soft NIC", "daemon_nic_cpu_s_per_GB"), ("main thread", "daemon_main_cpu_s_per_GB"),
                        *((role, role_key(role)) for role in ROLE_THREADS)) if k in s]
                    cpu += f" ({', '.join(parts)})" if parts else ""
                if "daemon_cpu_us_per_op" in s:
                    cpu += f", {s['daemon_cpu_us_per_op']:.1f} µs/op"
                    if "daemon_main_cpu_us_per_op" in s:
                        cpu += f" (main thread {s['daemon_main_cpu_us_per_op']:.1f})"
                if "host_cpu_s_per_GB" in s:
                    cpu += f"   machine {s['host_cpu_s_per_GB']:.2f} CPU-s/GB"
                if "peers_nic_cpu_s_per_GB" in s:
                    cpu += f" (the peers' soft NIC {s['peers_nic_cpu_s_per_GB']:.2f})"
                lines.append(f"    {t:<34} {_fmt(s['median']):>10}   "
                             f"[{_fmt(s['min'])} .. {_fmt(s['max'])}]{cpu}")
            for name, s in row["ratios"].items():
                lines.append(f"    ratio {name:<40} {s['median']:6.2f}   [{s['min']:.2f} .. {s['max']:.2f}]")
            for name, s in row["cpu_ratios"].items():
                lines.append(f"    CPU-s/GB without NIC threads, {name:<18} {s['median']:6.2f}   "
                             f"[{s['min']:.2f} .. {s['max']:.2f}]")
        return "\n".join(lines)

    def markdown(self) -> str:
        """One line per case: the standard ratios as columns (docs/benchmarks.md)."""
        rows = self.summary()
        names: list[str] = []
        for r in rows:
            for k in r["ratios"]:
                if k not in names:
                    names.append(k)
        out = ["| workload / case | " + " | ".join(names) + " |",
               "|---|" + "---|" * len(names)]
        for r in rows:
            cells = []
            for k in names:
                s = r["ratios"].get(k)
                cells.append(f"{s['median']:.2f} ({s['min']:.2f}–{s['max']:.2f})" if s else "")
            out.append(f"| {r['workload']} / {r['case']} ({r['primary']}) | " + " | ".join(cells) + " |")
        return "\n".join(out)

    def write(self, out: Path) -> list[Path]:
        out.mkdir(parents=True, exist_ok=True)
        data = {"meta": self.meta, "summary": self.summary(), "errors": self.errors,
                "runs": [r.__dict__ for r in self.runs]}
        files = [out / "results.json", out / "results.txt", out / "ratios.md"]
        files[0].write_text(json.dumps(data, indent=1, default=str))
        files[1].write_text(self.table() + "\n")
        files[2].write_text(self.markdown() + "\n")
        files += self.plot(out)
        return files

    def plot(self, out: Path) -> list[Path]:
        """One PNG per workload: primary figure per target per case, relative to the
        first ceiling present (ramfs-c, else ramfs-py, else the sweep's default)."""
        try:
            import matplotlib
            matplotlib.use("Agg")
            import matplotlib.pyplot as plt
        except ImportError:
            return []
        made = []
        rows = self.summary()
        for wl in dict.fromkeys(r["workload"] for r in rows):
            wrows = [r for r in rows if r["workload"] == wl]
            targets = self.targets(wl)
            ref = next((t for t in ("ramfs-c", "ramfs-py") if t in targets),
                       next((t for t in targets if t.endswith(("(default)", "(reference)"))), targets[0]))
            fig, ax = plt.subplots(figsize=(max(6, 1.6 * len(wrows) * len(targets) / 3), 4))
            width = 0.8 / len(targets)
            for i, t in enumerate(targets):
                ys = []
                for r in wrows:
                    a, b = r["targets"].get(t), r["targets"].get(ref)
                    ys.append(a["median"] / b["median"] if a and b and b["median"] else 0)
                ax.bar([j + i * width for j in range(len(wrows))], ys, width, label=t)
            ax.set_xticks([j + 0.4 - width / 2 for j in range(len(wrows))])
            ax.set_xticklabels([f"{r['case']}\n({r['primary']})" for r in wrows], fontsize=8)
            ax.set_ylabel(f"relative to {ref}")
            ax.axhline(1.0, color="grey", linewidth=0.5)
            ax.set_title(f"{wl} ({self.meta.get('scale', '')}, median of {self.meta.get('reps', '?')})")
            ax.legend(fontsize=7, loc="best")
            fig.tight_layout()
            path = out / f"{wl}.png"
            fig.savefig(path, dpi=110)
            plt.close(fig)
            made.append(path)
        return made


def _n(row: dict) -> int:
    return max((s["n"] for s in row["targets"].values()), default=0)


def _fmt(v: float) -> str:
    if v >= 100:
        return f"{v:,.0f}"
    return f"{v:.2f}"
