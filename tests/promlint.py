"""Prometheus's naming rules for an exposition, the ones ``promtool check metrics`` applies, in
Python on ``prometheus_client``'s own parser (so they run where promtool is not installed), and
promtool itself where it is (Debian: ``apt-get install prometheus``)."""

from __future__ import annotations

import re
import shutil
import subprocess

from prometheus_client.parser import text_string_to_metric_families

ABBREVIATED = ("s", "ms", "us", "ns", "sec", "b", "kb", "mb", "gb", "tb", "pb", "m", "h", "d")  # promtool's list
BASE_UNITS = ("seconds", "bytes", "meters", "metres", "grams", "joules", "volts", "amperes", "celsius", "kelvin")
NOT_BASE = {"minutes": "seconds", "hours": "seconds", "days": "seconds", "weeks": "seconds", "bits": "bytes"}
PREFIXES = ("pico", "nano", "micro", "milli", "centi", "deci", "deca", "hecto", "kilo", "kibi", "mega", "mebi",
            "giga", "gibi", "tera", "tebi", "peta", "pebi")
TYPES = ("counter", "gauge", "histogram", "summary")


def _unit_problem(word: str) -> str | None:
    """What is wrong with one ``_``-separated word of a name as a unit, or None."""
    if word in ABBREVIATED:
        return f"abbreviated unit {word!r}"
    if word in NOT_BASE:
        return f"{word!r}: use the base unit {NOT_BASE[word]!r}"
    for prefix in PREFIXES:
        unit = word.removeprefix(prefix)
        if unit != word and (unit in BASE_UNITS or unit in NOT_BASE):
            return f"{word!r}: use the base unit {NOT_BASE.get(unit, unit)!r}"
    return None


def lint(text: str) -> list[str]:
    """``family: problem`` for each rule an exposition breaks: HELP text, counters (and only they)
    ending in ``_total``, base units and no abbreviated unit (so no ``_s``, ``_ms``, ``_per_s``),
    no type in a name, histogram/summary suffixes on no other type."""
    # the parser names a counter's family without _total, whether it was exposed with one or not
    # (it adds _total to its samples if not): the TYPE lines keep the names exposed
    declared = set(re.findall(r"^# TYPE (\S+) ", text, re.M))
    problems = []
    for fam in text_string_to_metric_families(text):
        name = f"{fam.name}_total" if fam.type == "counter" and f"{fam.name}_total" in declared else fam.name
        found = []
        if not fam.documentation.strip():
            found.append("no HELP text")
        if fam.type == "counter" and not name.endswith("_total"):
            found.append("a counter's name ends in _total")
        if fam.type != "counter" and name.endswith("_total"):
            found.append("only a counter's name ends in _total")
        if fam.type not in ("histogram", "summary") and name.endswith(("_bucket", "_count", "_sum")):
            found.append("_bucket, _count and _sum are a histogram's or a summary's")
        words = name.split("_")
        found += [p for p in map(_unit_problem, words) if p is not None]
        found += [f"the type {kind!r} in the name" for kind in TYPES if kind in words[1:]]
        problems += [f"{name} ({fam.type}): {what}" for what in found]
    return problems


def promtool(text: str) -> list[str] | None:
    """``promtool check metrics``'s complaints about an exposition ([] when clean), None when promtool is not installed."""
    exe = shutil.which("promtool")
    if exe is None:
        return None
    proc = subprocess.run([exe, "check", "metrics"], input=text, capture_output=True, text=True, timeout=60)
    return [] if proc.returncode == 0 else (proc.stdout + proc.stderr).splitlines() or [f"exit {proc.returncode}"]
