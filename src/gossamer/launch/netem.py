"""Emulated networks: one Linux network namespace per worker, links shaped with ``tc``.

Each worker gets a namespace (its "machine") with one interface, the worker's end of a veth
pair whose other end is plugged into a bridge (the "switch"). The switch lives in a namespace of
its own, so nothing is added to the host's network, its firewall never sees the traffic, and
the addresses (``10.77.0.0/16``) cannot clash with anything: every namespace is a separate
network stack.

What a link does to traffic (:class:`LinkSpec`):

- ``bandwidth`` (bytes per second, or a rate such as ``1gbit``; see
  :func:`gossamer.comm.rate.parse_rate`): a token bucket (tc ``tbf``) on both ends of the
  veth, so the worker's upload and download are each limited to it;
- ``delay``, ``jitter``, ``loss``: ``netem`` on the switch's end, so they act on the packets
  delivered *to* the worker. A message from worker a to worker b is thus delayed by b's delay,
  and a round trip between them takes ``delay_a + delay_b``; with one setting for every link a
  message takes ``delay`` one way. Putting netem behind the veth rather than on the sender's
  own interface keeps delayed packets out of the sender's TCP send budget (TCP small queues),
  as on a real wire, where a long delay does not cap a sender's throughput by itself.
- ``mtu``: frames on the link; TCP segmentation offload is turned off on it (``gso_max_size``
  = MTU), so packets are wire-sized frames: loss hits one frame, and the interface counters
  count every frame's headers, as a NIC's do.

Teardown is guaranteed while the process lives: :class:`Network` is a context manager, it
registers an ``atexit`` hook, and SIGINT, SIGTERM and SIGHUP raise :class:`Interrupted`, which
unwinds through the context manager; a signal that arrives during the teardown itself is held
until the teardown is done. Every namespace's name starts with ``gsm-`` followed by the id of
the process that made it, so :func:`cleanup` (``gossamer launch --cleanup``) finds and removes
what a launcher killed with SIGKILL left behind, with every process still running inside.
Needs root, ``ip`` and ``tc`` (iproute2): :func:`check_prerequisites`.

Example::

    with Network([LinkSpec(bandwidth="1gbit", delay=1e-3)] * 2) as net:
        subprocess.run([*net.exec_prefix(0), "python", "worker.py"])
        print(net.counters(0)["tx_bytes"])
"""

from __future__ import annotations

import atexit
import dataclasses
import ipaddress
import math
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from gossamer.comm.rate import parse_rate

__all__ = [
    "PREFIX",
    "EmulationUnavailable",
    "Interrupted",
    "LinkSpec",
    "Network",
    "NetworkSetupError",
    "SignalGuard",
    "check_prerequisites",
    "cleanup",
    "leftovers",
    "parse_link_spec",
]

PREFIX = "gsm-"  # every namespace gossamer makes: gsm-<launcher pid>-<tag>-<rank> / -sw
SUBNET = ipaddress.ip_network("10.77.0.0/16")  # rank r is .1 + r; private to the namespaces
BRIDGE = "gsmbr"  # the switch, in the switch namespace
# `ip netns exec NS` mounts the files of /etc/netns/NS over /etc: each node gets a hosts file
# that names every node (node0, node1, ...), so that reverse lookups of peers succeed at once
NETNS_ETC = Path("/etc/netns")
_UNSHAPED_RATE = 1.25e9  # bytes/s (10 Gbit/s) assumed for a link without a bandwidth, to size
# netem's queue
_COMMAND_TIMEOUT = 30.0  # seconds for one ip/tc command: they take milliseconds
_HANDLED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


class EmulationUnavailable(RuntimeError):
    """This machine cannot emulate a network: not root, or ``ip`` / ``tc`` missing."""


class NetworkSetupError(RuntimeError):
    """An ``ip`` or ``tc`` command failed; the message has the command and its error."""


class Interrupted(BaseException):
    """A signal (SIGINT, SIGTERM, SIGHUP) asked the process to stop.

    A BaseException, like KeyboardInterrupt, so that ``except Exception`` does not swallow it
    on its way to the context managers that clean up.
    """

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum

    @property
    def exit_code(self) -> int:
        """What a shell reports for a process killed by this signal: 128 + its number."""
        return 128 + self.signum


# --------------------------------------------------------------------------------------------
# Link settings
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class LinkSpec:
    """How one worker's link to the switch treats traffic. The defaults change nothing.

    Args:
        bandwidth: bytes per second each way (tbf on both ends), or a rate such as
            ``"1gbit"`` or ``"125MB/s"`` (:func:`gossamer.comm.rate.parse_rate`), at least
            1kbit; kept in bytes per second. None: as fast as the veth goes (default None).
            Lower: slower link.
        delay: seconds added to every packet delivered to the worker (netem; default 0.0).
        jitter: seconds; each packet's delay is drawn uniformly from ``delay +- jitter``
            (default 0.0). Jitter reorders packets, as netem does.
        loss: fraction in [0, 1) of the packets delivered to the worker that are dropped
            (default 0.0); TCP retransmits them, and the retransmissions are traffic too.
        mtu: bytes per frame on the link (default 1500; 9000 for jumbo frames).
    """

    bandwidth: float | None = None
    delay: float = 0.0
    jitter: float = 0.0
    loss: float = 0.0
    mtu: int = 1500

    def __post_init__(self) -> None:
        if self.bandwidth is not None:
            rate = parse_rate(self.bandwidth, arg="bandwidth")
            if rate < _MIN_RATE:
                raise ValueError(f"bandwidth must be at least 1kbit ({_MIN_RATE:g} bytes/s), "
                                 f"got {self.bandwidth!r}")
            object.__setattr__(self, "bandwidth", rate)
        for name in ("delay", "jitter"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value >= 0):
                raise ValueError(f"{name} must be >= 0 seconds, got {value!r}")
        if self.jitter > 0 and self.delay == 0:
            raise ValueError("jitter needs a delay (netem spreads the delay by the jitter)")
        if not 0 <= self.loss < 1:
            raise ValueError(f"loss must be a fraction in [0, 1) or a percentage below 100%, "
                             f"got {self.loss!r}")
        if not 576 <= self.mtu <= 65535:
            raise ValueError(f"mtu must be between 576 and 65535 bytes, got {self.mtu}")

    @property
    def shaped(self) -> bool:
        """Whether anything but the MTU differs from a plain veth."""
        return bool(self.bandwidth or self.delay or self.loss)

    def describe(self) -> str:
        """``bandwidth=1gbit,delay=1ms,...``, the way :func:`parse_link_spec` reads it."""
        parts = []
        if self.bandwidth:
            parts.append(f"bandwidth={_tc_rate(self.bandwidth)}")
        if self.delay:
            parts.append(f"delay={_format_time(self.delay)}")
        if self.jitter:
            parts.append(f"jitter={_format_time(self.jitter)}")
        if self.loss:
            parts.append(f"loss={100 * self.loss:g}%")
        if self.mtu != 1500:
            parts.append(f"mtu={self.mtu}")
        return ",".join(parts) or "unshaped"


_MIN_RATE = 125.0  # bytes/s: 1kbit, tc's smallest unit
_TIME_UNITS = {"us": 1e6, "ms": 1e3, "s": 1.0}  # divisors: 100us is exactly 1e-4
_NUMBER = r"(\d+(?:\.\d*)?|\.\d+)"


def _parse_time(key: str, value: str) -> float:
    match = re.fullmatch(_NUMBER + r"\s*([a-z]*)", value.strip().lower())
    if match is None or match.group(2) not in _TIME_UNITS:
        raise ValueError(f"{key}={value!r} is not a time such as 500us, 1ms or 0.1s (units: "
                         f"{', '.join(_TIME_UNITS)})")
    return float(match.group(1)) / _TIME_UNITS[match.group(2)]


def _parse_loss(value: str) -> float:
    text = value.strip()
    percent = text.endswith("%")
    match = re.fullmatch(_NUMBER, text[:-1].strip() if percent else text)
    if match is None:
        raise ValueError(f"loss={value!r} is not a percentage such as 0.1% or a fraction "
                         "such as 0.001")
    return float(match.group(1)) / (100 if percent else 1)


def parse_link_spec(text: str, base: LinkSpec | None = None,
                    option: str = "--emulate") -> LinkSpec:
    """Read ``bandwidth=1gbit,delay=1ms,jitter=100us,loss=0.1%,mtu=9000`` onto ``base``.

    The bandwidth is any rate :func:`gossamer.comm.rate.parse_rate` reads (``1gbit``,
    ``100mbit``, ``125MB/s``; a bare number is bytes per second). Keys may be left out (they
    keep ``base``'s value); an empty string gives ``base``. Loss is a percentage with ``%``, a
    fraction without. Raises ValueError naming ``option`` and the key that is wrong.
    """
    spec = base if base is not None else LinkSpec()
    changes: dict[str, float | int | None] = {}
    try:
        for item in filter(None, (part.strip() for part in text.split(","))):
            key, sep, value = item.partition("=")
            key = key.strip().lower()
            if not sep or not value.strip():
                raise ValueError(f"{item!r} is not KEY=VALUE")
            if key in changes:
                raise ValueError(f"{key} is given twice")
            if key == "bandwidth":
                changes[key] = parse_rate(value.strip(), arg=key)
            elif key in ("delay", "jitter"):
                changes[key] = _parse_time(key, value)
            elif key == "loss":
                changes[key] = _parse_loss(value)
            elif key == "mtu":
                if not value.strip().isdigit():
                    raise ValueError(f"mtu={value!r} is not a number of bytes")
                changes[key] = int(value)
            else:
                raise ValueError(f"unknown key {key!r} (known: bandwidth, delay, jitter, "
                                 "loss, mtu)")
        return dataclasses.replace(spec, **changes)
    except ValueError as exc:
        raise ValueError(f"{option} {text!r}: {exc}") from None


def _tc_rate(bytes_per_s: float) -> str:
    """A rate as tc and ``--emulate`` write it: ``1gbit``."""
    bits = bytes_per_s * 8
    for unit, scale in (("gbit", 1e9), ("mbit", 1e6), ("kbit", 1e3)):
        if bits >= scale:
            return f"{bits / scale:g}{unit}"
    return f"{bits:g}bit"


def _format_time(seconds: float) -> str:
    if seconds >= 1:
        return f"{seconds:g}s"
    if seconds >= 1e-3:
        return f"{seconds * 1e3:g}ms"
    return f"{seconds * 1e6:g}us"


# --------------------------------------------------------------------------------------------
# Signals
# --------------------------------------------------------------------------------------------


class SignalGuard:
    """While entered, SIGINT, SIGTERM and SIGHUP raise :class:`Interrupted` in the main thread.

    Inside :meth:`shielded` they are held instead, and the first one is raised when the
    shielded block ends: cleanup is not cut short by a second Ctrl-C. Outside the main thread
    (where Python cannot install handlers) it does nothing.
    """

    def __init__(self) -> None:
        self._previous: dict[int, object] = {}
        self._shield = 0
        self._pending: int | None = None

    def __enter__(self) -> SignalGuard:
        if threading.current_thread() is threading.main_thread():
            for signum in _HANDLED:
                self._previous[signum] = signal.signal(signum, self._handle)
        return self

    def __exit__(self, *exc: object) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)  # type: ignore[arg-type]
        self._previous.clear()

    def _handle(self, signum: int, frame: object) -> None:
        if self._shield:
            if self._pending is None:
                self._pending = signum
            return
        raise Interrupted(signum)

    @contextmanager
    def shielded(self, reraise: bool = True) -> Iterator[None]:
        """Hold the signals until the block is done, then raise the first that came (with
        ``reraise=False``, drop it: the process is stopping already)."""
        self._shield += 1
        try:
            yield
        finally:
            self._shield -= 1
            if not self._shield and self._pending is not None:
                signum, self._pending = self._pending, None
                if reraise:
                    raise Interrupted(signum)


# --------------------------------------------------------------------------------------------
# Commands
# --------------------------------------------------------------------------------------------


def check_prerequisites() -> None:
    """Raise :class:`EmulationUnavailable`, saying what is missing, unless this process can
    make namespaces and shape links: Linux, root, and iproute2's ``ip`` and ``tc``."""
    if not sys.platform.startswith("linux"):
        raise EmulationUnavailable("network emulation needs Linux (network namespaces and tc)")
    if os.geteuid() != 0:
        raise EmulationUnavailable(
            "network emulation needs root: it creates network namespaces, veth pairs and tc "
            "qdiscs (run as root, e.g. with sudo, or launch without --emulate)"
        )
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            raise EmulationUnavailable(
                f"network emulation needs the `{tool}` command (iproute2), which is not on "
                "PATH (e.g. apt-get install iproute2)"
            )


def _run(cmd: Sequence[str], check: bool = True) -> subprocess.CompletedProcess[str]:
    try:
        result = subprocess.run(list(cmd), capture_output=True, text=True,
                                timeout=_COMMAND_TIMEOUT)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise NetworkSetupError(f"`{' '.join(cmd)}` failed: {exc}") from exc
    if check and result.returncode != 0:
        raise NetworkSetupError(
            f"`{' '.join(cmd)}` failed (exit code {result.returncode}): "
            f"{result.stderr.strip() or result.stdout.strip()}"
        )
    return result


def _namespaces() -> list[str]:
    """The names of the network namespaces (``ip netns list``); none without ``ip``."""
    if shutil.which("ip") is None:
        return []
    result = _run(["ip", "netns", "list"], check=False)
    return [line.split()[0] for line in result.stdout.splitlines() if line.strip()]


def _kill_inside(namespace: str) -> None:
    """SIGKILL every process in ``namespace`` and wait (up to 5 s) until none is left."""
    deadline = time.monotonic() + 5.0
    while True:
        result = _run(["ip", "netns", "pids", namespace], check=False)
        pids = [int(p) for p in result.stdout.split() if p.isdigit()]
        if not pids or time.monotonic() > deadline:
            return
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        time.sleep(0.05)


def _delete(namespace: str) -> None:
    _kill_inside(namespace)
    shutil.rmtree(NETNS_ETC / namespace, ignore_errors=True)
    for attempt in range(20):
        result = _run(["ip", "netns", "delete", namespace], check=False)
        if result.returncode == 0 or namespace not in _namespaces():
            return
        time.sleep(0.05 * (attempt + 1))
    raise NetworkSetupError(f"cannot delete namespace {namespace}: {result.stderr.strip()}")


def _launcher_pid(namespace: str) -> int | None:
    match = re.match(re.escape(PREFIX) + r"(\d+)-", namespace)
    return int(match.group(1)) if match else None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def leftovers(include_live: bool = False) -> list[str]:
    """Namespaces made by gossamer whose launcher process is gone (with ``include_live``,
    also those of launchers still running), and their /etc/netns files."""
    names = []
    files = [p.name for p in NETNS_ETC.glob(PREFIX + "*")] if NETNS_ETC.is_dir() else []
    for name in sorted(set(_namespaces()) | set(files)):
        if not name.startswith(PREFIX):
            continue
        pid = _launcher_pid(name)
        if include_live or pid is None or not _alive(pid):
            names.append(name)
    return names


def cleanup(include_live: bool = False) -> list[str]:
    """Remove :func:`leftovers`: kill the processes in them, delete the namespaces (their
    veth pairs and bridge go with them). Returns the names removed."""
    names = leftovers(include_live)
    # workers first: their processes hold the links the switch namespace's bridge serves
    for name in sorted(names, key=lambda n: n.endswith("-sw")):
        _delete(name)
    return names


# --------------------------------------------------------------------------------------------
# The network
# --------------------------------------------------------------------------------------------


class Network:
    """N worker namespaces joined by shaped veth links to a bridge; see the module docstring.

    ``links[r]`` is rank r's link. Rank r's namespace is :meth:`namespace` (r), its address
    :meth:`address` (r) on interface :meth:`interface` (r). Entering builds everything (and
    removes what it built if that fails or is interrupted); leaving removes everything.

    Args:
        links: one :class:`LinkSpec` per worker, in rank order (at least one).
        guard_signals: install a :class:`SignalGuard` while the network exists (default True),
            so that SIGINT, SIGTERM and SIGHUP unwind through the teardown.
    """

    def __init__(self, links: Sequence[LinkSpec], *, guard_signals: bool = True) -> None:
        if not links:
            raise ValueError("links must name at least one worker's link")
        if len(links) > SUBNET.num_addresses - 2:
            raise ValueError(f"at most {SUBNET.num_addresses - 2} workers, got {len(links)}")
        self.links = tuple(links)
        self.tag = f"{PREFIX}{os.getpid()}-{secrets.token_hex(2)}"
        self._created: list[str] = []  # namespaces made so far, in order
        self._guard = SignalGuard() if guard_signals else None
        self._atexit: Callable[[], None] | None = None

    @property
    def world_size(self) -> int:
        return len(self.links)

    @property
    def switch(self) -> str:
        """The namespace holding the bridge."""
        return f"{self.tag}-sw"

    def namespace(self, rank: int) -> str:
        return f"{self.tag}-{rank}"

    def address(self, rank: int) -> str:
        return str(SUBNET.network_address + rank + 1)

    def interface(self, rank: int) -> str:
        """The worker's end of its link, inside its namespace (for GLOO_SOCKET_IFNAME)."""
        return f"gsmw{rank}"

    def exec_prefix(self, rank: int) -> list[str]:
        """Prefix a command with this to run it in rank ``rank``'s namespace."""
        return ["ip", "netns", "exec", self.namespace(rank)]

    def counters(self, rank: int) -> dict[str, int]:
        """The kernel's counters of rank's interface: tx/rx bytes and packets (frames, with
        their Ethernet, IP and TCP headers); and the TCP segments that rank's namespace sent
        again (``tcp_retransmitted``: after a frame was dropped, or a timeout)."""
        names = ("tx_bytes", "tx_packets", "rx_bytes", "rx_packets")
        base = f"/sys/class/net/{self.interface(rank)}/statistics"
        result = _run([*self.exec_prefix(rank), "cat", *(f"{base}/{n}" for n in names),
                       "/proc/net/snmp"])
        lines = result.stdout.splitlines()
        found = dict(zip(names, map(int, lines[:len(names)]), strict=True))
        found["tcp_retransmitted"] = snmp_counter(lines[len(names):], "Tcp", "RetransSegs")
        return found

    # -- lifetime ---------------------------------------------------------------------------

    def __enter__(self) -> Network:
        if self._guard is not None:
            self._guard.__enter__()
        self._atexit = self.teardown
        atexit.register(self._atexit)
        try:
            self._build()
        except BaseException:
            try:
                self.teardown()
            except NetworkSetupError:
                pass  # the error that stopped the build says more
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.teardown()

    def teardown(self) -> None:
        """Kill every process in the namespaces and delete them; safe to call twice."""
        shield = self._guard.shielded() if self._guard is not None else _nothing()
        try:
            with shield:
                errors = []
                # worker namespaces first, the switch last; each one even if another fails
                for name in [n for n in self._created if n != self.switch] + \
                        [n for n in self._created if n == self.switch]:
                    try:
                        _delete(name)
                    except NetworkSetupError as exc:
                        errors.append(str(exc))
                    self._created.remove(name)
                if errors:
                    raise NetworkSetupError("; ".join(errors))
        finally:
            if self._atexit is not None:
                atexit.unregister(self._atexit)
                self._atexit = None
            if self._guard is not None:
                self._guard.__exit__()

    def _add_namespace(self, name: str) -> None:
        _run(["ip", "netns", "add", name])
        self._created.append(name)
        _run(["ip", "-n", name, "link", "set", "lo", "up"])

    def _build(self) -> None:
        check_prerequisites()
        sw = self.switch
        self._add_namespace(sw)
        _run(["ip", "-n", sw, "link", "add", BRIDGE, "type", "bridge"])
        _run(["ip", "-n", sw, "link", "set", BRIDGE, "up"])
        for rank, link in enumerate(self.links):
            ns, here, there = self.namespace(rank), self.interface(rank), f"gsms{rank}"
            self._add_namespace(ns)
            # Created directly inside the two namespaces: the host's network never sees it.
            _run(["ip", "link", "add", here, "netns", ns, "type", "veth",
                  "peer", "name", there, "netns", sw])
            for space, dev in ((ns, here), (sw, there)):
                # wire-sized frames: no segmentation offload, so loss and counters see frames
                _run(["ip", "-n", space, "link", "set", dev, "mtu", str(link.mtu),
                      "gso_max_size", str(link.mtu)])
            _run(["ip", "-n", sw, "link", "set", there, "master", BRIDGE, "up"])
            _run(["ip", "-n", ns, "addr", "add", f"{self.address(rank)}/{SUBNET.prefixlen}",
                  "dev", here])
            _run(["ip", "-n", ns, "link", "set", here, "up"])
            self._write_hosts(ns)
            for cmd in (_qdisc_commands(ns, here, link, netem=False)
                        + _qdisc_commands(sw, there, link, netem=True)):
                _run_qdisc(cmd)

    def _write_hosts(self, namespace: str) -> None:
        try:
            hosts = Path("/etc/hosts").read_text()
        except OSError:
            hosts = "127.0.0.1 localhost\n"
        # also the IPv4-mapped IPv6 form, in which a dual-stack listener (the c10d store)
        # sees its peers
        names = "".join(f"{self.address(r)} node{r}\n::ffff:{self.address(r)} node{r}\n"
                        for r in range(self.world_size))
        folder = NETNS_ETC / namespace
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "hosts").write_text(hosts.rstrip("\n") + "\n# gossamer launch\n" + names)


def snmp_counter(lines: list[str], group: str, name: str) -> int:
    """One counter of ``/proc/net/snmp``'s lines: each group is a line of names
    (``Tcp: RtoAlgorithm ... RetransSegs ...``) followed by a line of their values."""
    for head, values in zip(lines, lines[1:], strict=False):  # each line and the next
        if head.startswith(f"{group}:") and values.startswith(f"{group}:"):
            keys, numbers = head.split()[1:], values.split()[1:]
            if name in keys:
                return int(numbers[keys.index(name)])
    raise NetworkSetupError(f"/proc/net/snmp has no {group} counter {name!r}")


@contextmanager
def _nothing() -> Iterator[None]:
    yield


def _run_qdisc(cmd: list[str]) -> None:
    try:
        _run(cmd)
    except NetworkSetupError as exc:
        kind = "netem" if "netem" in cmd else "tbf"
        if "unknown" in str(exc).lower():
            what = ("delay, jitter and loss need" if kind == "netem" else "bandwidth needs")
            raise EmulationUnavailable(
                f"{what} the kernel's {kind} qdisc (sch_{kind}), which this kernel does not "
                f"have (tc: {str(exc).rsplit(': ', 1)[-1]}); load it (modprobe sch_{kind}) "
                f"or emulate without {'delay, jitter and loss' if kind == 'netem' else 'it'}"
            ) from None
        raise


def _qdisc_commands(ns: str, dev: str, link: LinkSpec, netem: bool) -> list[list[str]]:
    """tc commands for one end of a link: netem (if asked, and set) with tbf (if a bandwidth
    is set) below it."""
    tc = ["tc", "-n", ns, "qdisc", "add", "dev", dev]
    commands = []
    parent = ["root"]
    if netem and (link.delay or link.loss):
        rate = link.bandwidth or _UNSHAPED_RATE
        # queue enough packets for the delay at the link's rate, so netem itself drops none
        in_flight = rate * (link.delay + link.jitter) / link.mtu
        limit = max(1000, math.ceil(2 * in_flight) + 100)
        args = ["netem", "limit", str(limit)]
        if link.delay:
            args += ["delay", f"{link.delay * 1e6:.0f}us"]
            if link.jitter:
                args.append(f"{link.jitter * 1e6:.0f}us")
        if link.loss:
            args += ["loss", f"{100 * link.loss:.6g}%"]
        commands.append([*tc, "root", "handle", "1:", *args])
        parent = ["parent", "1:1"]
    if link.bandwidth:
        # a bucket of 1 ms at the rate (at least a few frames); a queue of ~50 ms
        burst = max(4 * link.mtu, math.ceil(link.bandwidth * 1e-3))
        limit = max(burst + 64 * link.mtu, math.ceil(link.bandwidth * 0.05))
        commands.append([*tc, *parent, "handle", "10:", "tbf", "rate",
                         f"{link.bandwidth * 8:.0f}bit", "burst", str(burst), "limit", str(limit)])
    return commands
