"""Which hosts and slots a multi-node launch uses: DeepSpeed's hostfile and its filters.

A hostfile lists one host per line as ``host slots=N`` (``#`` starts a comment line, blank
lines are skipped), in the order that decides node ranks. ``--include``/``--exclude`` take
DeepSpeed's ``NODE_SPEC[@NODE_SPEC...]`` syntax, ``NODE_SPEC = host[:slot[,slot...]]``
(``worker-0@worker-1:0,2``: every slot of worker-0, slots 0 and 2 of worker-1). Then
``--num_nodes K`` keeps the first K hosts and ``--num_gpus``/``--num_procs N`` the first N
selected slots of each.

Everything here is a pure function and runs before any process starts: a bad line, an unknown
host or slot, or more nodes or slots than the hostfile lists is a `HostfileError` naming the
file and line, or the host. DeepSpeed silently accepts some of these (``--num_gpus`` larger
than a host's slots, for one); a launch that cannot be placed must not start half of itself.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

from partita.launcher.launch import LaunchError

__all__ = ["HostfileError", "Resources", "parse_filter", "parse_hostfile", "resolve_resources"]

#: host -> the slot indices used on it, in hostfile order.
Resources = dict[str, list[int]]

_LINE = re.compile(r"(\S+)\s+slots=(\d+)")
_HOST = re.compile(r"[^\s:@,]+")


class HostfileError(LaunchError):
    """The hostfile or a host filter cannot be used; the message names the line or host."""


def parse_hostfile(lines: Iterable[str], path: str = "<hostfile>") -> dict[str, int]:
    """``host -> slots`` from the lines of a hostfile, in file order.

    Raises `HostfileError` naming ``path`` and the line number for a line that is not
    ``host slots=N`` (N >= 1), for a host listed twice (both line numbers), and for a file
    with no host at all.
    """
    pool: dict[str, int] = {}
    first_line: dict[str, int] = {}
    for number, raw in enumerate(lines, start=1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        match = _LINE.fullmatch(line)
        if match is None:
            raise HostfileError(f"{path}:{number}: expected 'HOST slots=N', got {line!r}")
        host, slots = match.group(1), int(match.group(2))
        if slots < 1:
            raise HostfileError(f"{path}:{number}: host {host!r} has slots={slots}; need >= 1")
        if host in pool:
            raise HostfileError(
                f"{path}:{number}: host {host!r} is listed again (first on line {first_line[host]})"
            )
        pool[host], first_line[host] = slots, number
    if not pool:
        raise HostfileError(f"{path}: lists no host (expected lines 'HOST slots=N')")
    return pool


def parse_filter(spec: str, flag: str) -> dict[str, list[int]]:
    """``host -> slots`` from an ``--include``/``--exclude`` value (an empty list: every slot).

    Raises `HostfileError` naming ``flag`` for an empty entry, a bad host or slot index.
    """
    result: dict[str, list[int]] = {}
    for entry in spec.split("@"):
        host, colon, slot_text = entry.partition(":")
        if not _HOST.fullmatch(host):
            raise HostfileError(
                f"{flag} {spec!r}: bad host entry {entry!r} (expected HOST[:SLOT,...])"
            )
        slots: list[int] = []
        if colon:
            for item in slot_text.split(","):
                if not item.strip().isdigit():
                    raise HostfileError(
                        f"{flag} {spec!r}: bad slot index {item!r} for host {host!r}"
                    )
                slots.append(int(item))
        if host in result and (not slots or not result[host]):
            result[host] = []  # the whole host, once named without slots
        else:
            result[host] = sorted(set(result.get(host, []) + slots))
    return result


def _check_known(pool: dict[str, int], wanted: dict[str, list[int]], flag: str) -> None:
    for host, slots in wanted.items():
        if host not in pool:
            raise HostfileError(f"{flag}: host {host!r} is not in the hostfile")
        for slot in slots:
            if slot >= pool[host]:
                raise HostfileError(
                    f"{flag}: host {host!r} has no slot {slot} (the hostfile lists "
                    f"slots={pool[host]}: 0..{pool[host] - 1})"
                )


def _filtered(pool: dict[str, int], include: str | None, exclude: str | None) -> Resources:
    everything = {host: list(range(slots)) for host, slots in pool.items()}
    if include is not None:
        wanted = parse_filter(include, "--include")
        _check_known(pool, wanted, "--include")
        return {h: (wanted[h] or everything[h]) for h in pool if h in wanted}
    if exclude is not None:
        dropped = parse_filter(exclude, "--exclude")
        _check_known(pool, dropped, "--exclude")
        kept = {
            h: [s for s in slots if h not in dropped or (dropped[h] and s not in dropped[h])]
            for h, slots in everything.items()
        }
        return {h: slots for h, slots in kept.items() if slots}
    return everything


def resolve_resources(
    pool: dict[str, int],
    include: str | None = None,
    exclude: str | None = None,
    num_nodes: int | None = None,
    slots_per_node: int | None = None,
    slots_flag: str = "--num_gpus",
    min_nodes: int | None = None,
) -> Resources:
    """The hosts and slots a launch uses: ``pool`` filtered by ``include`` or ``exclude``,
    then its first ``num_nodes`` hosts, then the first ``slots_per_node`` slots of each.
    With ``min_nodes`` (elastic ``--nnodes MIN:MAX``) ``num_nodes`` is the most hosts to
    take: fewer will do, down to ``min_nodes``.

    Raises `HostfileError` when include and exclude are both given, a filter names an unknown
    host or slot, nothing is left, or more nodes or slots are asked than are left (naming the
    host that is short).
    """
    if include is not None and exclude is not None:
        raise HostfileError("--include and --exclude cannot be used together")
    resources = _filtered(pool, include, exclude)
    if not resources:
        raise HostfileError(f"--exclude {exclude!r} leaves no slot on any host")
    if num_nodes is not None:
        needed, flag = (num_nodes, "--num_nodes") if min_nodes is None else (min_nodes, "--nnodes")
        if needed > len(resources):
            asked = num_nodes if min_nodes is None else f"{min_nodes}:{num_nodes}"
            raise HostfileError(
                f"{flag} {asked} asks for more nodes than the {len(resources)} "
                f"selected from the hostfile ({', '.join(resources)})"
            )
        resources = dict(list(resources.items())[:num_nodes])
    if slots_per_node is not None:
        for host, slots in resources.items():
            if slots_per_node > len(slots):
                raise HostfileError(
                    f"{slots_flag} {slots_per_node} asks for more slots than host {host!r} "
                    f"has selected ({len(slots)}: {','.join(map(str, slots))})"
                )
        resources = {host: slots[:slots_per_node] for host, slots in resources.items()}
    return resources
