"""The side-by-side table from a driver.sh result folder: each row's prompt / decode tok/s and nvidia-smi peak,
and the ratios the acceptance of issue #24 names (SharpI's default at 12 GiB against llama.cpp's best
--n-cpu-moe split whose peak stays within 12 GiB; experts all on the CPU; everything on the GPU).

  python3 packaging/gpu_sidebyside/summ.py /tmp/sbs
"""

import json
import re
import sys
from pathlib import Path

GIB_MIB = 1024


def peaks(folder: Path) -> dict[str, int]:
    out = {}
    for line in (folder / "summary.txt").read_text().splitlines() if (folder / "summary.txt").exists() else []:
        m = re.match(r"(\S+) peak MiB: (\d+)", line)
        if m:
            out[m.group(1)] = int(m.group(2))
    return out


def kinds(folder: Path) -> dict[str, str]:
    """Each row's kind (S, R, L, X) from the driver's "=== KIND NAME: command" lines."""
    out = {}
    for line in (folder / "summary.txt").read_text().splitlines() if (folder / "summary.txt").exists() else []:
        m = re.match(r"=== (\S+) ([^:\s]+)", line)
        if m:
            out[m.group(2)] = m.group(1)
    return out


def sharpi(path: Path) -> dict | None:
    try:
        r = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return {"prompt": r.get("prompt_tok_s"), "decode": r.get("decode_tok_s"), "what": r.get("placement", "")}


def llama(path: Path) -> dict | None:
    got = {}
    for line in path.read_text().splitlines() if path.exists() else []:
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) < 2:
            continue
        m = re.match(r"([\d.]+) ± ", cells[-1])
        if m and cells[-2].startswith(("pp", "tg")):
            got["prompt" if cells[-2].startswith("pp") else "decode"] = float(m.group(1))
    return got or None


def main(folder: str) -> None:
    d = Path(folder)
    pk, kind = peaks(d), kinds(d)
    rows = {}
    for f in sorted(d.glob("*.out")):
        name = f.stem
        k = kind.get(name, name[0])
        if k == "X":  # a command's own output (a lab), not a benchmark row
            continue
        rows[name] = (llama if k == "L" else sharpi)(f)
    print("| run | prompt tok/s | decode tok/s | nvidia-smi peak MiB | placement |")
    print("|---|---|---|---|---|")
    for name, r in rows.items():
        if r is None:
            print(f"| {name} | failed | | {pk.get(name, '')} | |")
            continue
        print(
            f"| {name} | {r.get('prompt') or 0:.1f} | {r.get('decode') or 0:.2f} | {pk.get(name, '')} | {r.get('what', '')[:160]} |"
        )

    def best_split(limit_mib: int):
        ok = [(n, r) for n, r in rows.items() if n.startswith("L_ncmoe") and r and pk.get(n, 1 << 30) <= limit_mib]
        return max(ok, key=lambda nr: nr[1].get("decode", 0), default=(None, None))

    def ratio(a: str, b: str | None, rb=None) -> None:
        ra, rb = rows.get(a), rb or rows.get(b or "")
        if not ra or not rb:
            print(f"- {a} vs {b}: missing")
            return
        print(
            f"- {a} ÷ {b}: decode {ra['decode'] / rb['decode']:.2f}×, prompt {ra['prompt'] / rb['prompt']:.2f}× "
            f"(peaks {pk.get(a)} vs {pk.get(b)} MiB)"
        )

    print()
    b12, r12 = best_split(12 * GIB_MIB)
    for a in ("S_auto12", "R_auto12", "S_cache12", "R_cache12"):
        ratio(a, b12, r12)
    ratio("S_cpu", "L_cpumoe48")
    ratio("S_resident", "L_gpu")
    for a, lim in (("S_auto12", 12), ("S_auto8", 8)):
        if a in pk:
            print(
                f"- {a}: peak {pk[a]} MiB vs budget {lim * GIB_MIB} MiB ({'within' if pk[a] <= lim * GIB_MIB else 'OVER'})"
            )


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "/tmp/sbs")
