"""Ansible host patterns: which of an inventory's hosts a pattern such as `gpu:&h100:!gpu-03` selects.

The grammar is Ansible's (ansible/inventory/manager.py): host and group names, `all`, globs,
`~regex`, subscripts, joined by `:`/`,` (union), `:&` (intersection) and `:!` (exclusion). Where
Ansible only warns (a part that matches nothing), fleetctl refuses the pattern.
"""

from __future__ import annotations

import fnmatch
import re
from pathlib import Path
from typing import Mapping

from ..errors import PatternError

# One part of a ':'-separated host pattern, keeping [x:y] brackets whole (ansible/inventory/manager.py).
_PATTERN_PART = re.compile(r"(?:[^\s:\[\]]|\[[^\]]*\])+")
# `pattern[i]`, `pattern[i:j]`, `pattern[i:]` (ansible/inventory/manager.py, PATTERN_WITH_SUBSCRIPT).
_SUBSCRIPT = re.compile(r"(.+)\[(?:(-?[0-9]+)|([0-9]+)[:-]([0-9]*))\]")


def select(pattern: str, hosts: Mapping[str, object], groups: Mapping[str, tuple[str, ...]],
           source: Path) -> list[str]:
    """The names of the hosts an Ansible host pattern selects, in inventory order.

    `hosts`: host name -> anything, in inventory order; `groups`: group -> host names,
    transitively, in the inventory's group order; `source`: the inventory, named in errors.
    `pattern`: names of hosts or groups, `all`, `*`, globs (`gpu-*`, fnmatch), `~regex`
    (re.match), subscripts (`gpu[0]`, `gpu[1:3]`, `gpu[2:]`), joined by `:` or `,` (union),
    `:&` (intersection) and `:!` (exclusion). As in ansible/inventory/manager.py, unions are
    applied first, then intersections, then exclusions; a pattern of only `&`/`!` parts
    starts from `all`. A pattern that is exactly a host or group name is taken whole, so
    names containing ':' can be selected.
    Raises PatternError (exit 5) when nothing matches, when any one part matches nothing
    (Ansible only warns; here a typo must not change which hosts a run touches), or when a
    regex, subscript or bracket is invalid.
    """
    parts = _split(pattern, hosts, groups)
    if not parts:
        raise PatternError(f"empty host pattern {pattern!r}")
    regular = [p for p in parts if p[0] not in "&!"] or ["all"]
    ordered = regular + [p for p in parts if p[0] == "&"] + [p for p in parts if p[0] == "!"]
    selected: dict[str, None] = {}
    for part in ordered:
        if part in hosts:
            selected[part] = None
            continue
        matched = _match(part, hosts, groups)
        if not matched:  # stricter than Ansible's warning: a typo must not widen or narrow a run
            raise PatternError(f"{part!r} in host pattern {pattern!r} matches no host in {source}; "
                               f"groups: {', '.join(groups)}")
        if part[0] == "!":
            selected = {n: None for n in selected if n not in matched}
        elif part[0] == "&":
            selected = {n: None for n in selected if n in matched}
        else:
            selected.update(dict.fromkeys(matched))
    if not selected:
        raise PatternError(f"host pattern {pattern!r} matches no host in {source}; "
                           f"groups: {', '.join(groups)}")
    return [name for name in hosts if name in selected]


def _split(pattern: str, hosts: Mapping[str, object], groups: Mapping[str, tuple[str, ...]]) -> list[str]:
    """Split a pattern on ',' then ':' and whitespace, keeping whole names and [x:y] intact."""
    pattern = pattern.strip()
    if pattern in hosts or pattern in groups:
        return [pattern]
    parts: list[str] = []
    for chunk in pattern.split(","):
        chunk = chunk.strip()
        if chunk in hosts or chunk in groups:
            parts.append(chunk)
            continue
        found = _PATTERN_PART.findall(chunk)
        if _PATTERN_PART.sub("", chunk).strip(" \t:"):  # a stray '[' or ']' is a typo
            raise PatternError(f"invalid host pattern {chunk!r}: unbalanced brackets")
        parts += found
    return parts


def _match(part: str, hosts: Mapping[str, object], groups: Mapping[str, tuple[str, ...]]) -> list[str]:
    """Host names one pattern part (without its &/! prefix) matches, in inventory order."""
    expr = part[1:] if part[0] in "&!" else part
    if not expr:
        raise PatternError(f"empty host pattern after {part!r}")
    if expr == "~":
        raise PatternError(f"empty regular expression in host pattern {part!r}")
    subscript = None if expr[0] == "~" else _SUBSCRIPT.fullmatch(expr)
    if subscript:
        expr = subscript[1]
    try:
        regex = re.compile(expr[1:] if expr[0] == "~" else fnmatch.translate(expr))
    except re.error as e:
        raise PatternError(f"invalid host pattern {part!r}: {e}") from None
    matched: set[str] = set()
    matching_groups = [g for g in groups if regex.match(g)]
    for group in matching_groups:
        matched.update(groups[group])
    if not matching_groups or expr[0] == "~" or any(c in expr for c in ".?*["):
        matched.update(h for h in hosts if regex.match(h))
    names = [h for h in hosts if h in matched]
    if subscript:
        index, start, end = subscript[2], subscript[3], subscript[4]
        try:
            if index is not None:
                names = [names[int(index)]]
            else:
                names = names[int(start):int(end) + 1] if end else names[int(start):]
        except IndexError:
            raise PatternError(f"no host matches the subscripted pattern {part!r}") from None
    return names
