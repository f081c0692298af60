"""Reading what a guest run left in its run directory: junit outcomes, JSON result lines."""
from __future__ import annotations

import json
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any


def junit_outcomes(path: Path) -> dict[str, tuple[str, str]]:
    """``{test name with params: (outcome, message)}``; outcome passed/failed/skipped."""
    out: dict[str, tuple[str, str]] = {}
    if not path.exists():
        return out
    for case in ET.parse(path).getroot().iter("testcase"):
        outcome, msg = "passed", ""
        for tag in ("failure", "error", "skipped"):
            el = case.find(tag)
            if el is not None:
                outcome = "skipped" if tag == "skipped" else "failed"
                msg = (el.get("message") or "") + "\n" + (el.text or "")
                break
        out[case.get("name", "?")] = (outcome, msg.strip())
    return out


def result_lines(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
