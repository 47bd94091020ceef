"""``gossamer launch``: option checks, local workers, and emulated networks (root, ip, tc).

The emulated tests build real network namespaces; they skip, saying why, without root or
iproute2. The byte test compares the library's counters with the kernel's interface counters:
see ``test_emulated_run_moves_the_bytes_the_library_counts``.
"""

from __future__ import annotations

import io
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

import gossamer.launch.netem as netem
from gossamer.cli import build_parser, main
from gossamer.launch import LinkSpec, Network, cleanup, launch, leftovers, parse_link_spec
from gossamer.launch.cli import links_from_args
from gossamer.launch.netem import EmulationUnavailable, check_prerequisites


def _why_no_emulation() -> str | None:
    try:
        check_prerequisites()
    except EmulationUnavailable as exc:
        return str(exc)
    return None


_NO_EMULATION = _why_no_emulation()
emulated = pytest.mark.skipif(_NO_EMULATION is not None,
                              reason=f"network emulation unavailable: {_NO_EMULATION}")

HEADERS = 66  # bytes per frame: Ethernet 14 + IPv4 20 + TCP 20 + TCP timestamps option 12


# --------------------------------------------------------------------------------------------
# Options
# --------------------------------------------------------------------------------------------


def test_link_spec_reads_every_key():
    spec = parse_link_spec("bandwidth=1gbit, delay=1ms,jitter=100us,loss=0.5%,mtu=9000")
    assert spec == LinkSpec(bandwidth="1gbit", delay=1e-3, jitter=1e-4, loss=0.005, mtu=9000)
    assert parse_link_spec("loss=0.01").loss == 0.01  # without %, a fraction
    assert parse_link_spec("") == LinkSpec()
    assert parse_link_spec(spec.describe()) == spec


@pytest.mark.parametrize("text, message", [
    ("bandwidth=fast", "bandwidth='fast' is not a rate"),
    ("bandwidth=10mbps", "is not a rate"),  # tc's mbps means megabytes: refused, not guessed
    ("delay=5", "delay='5' is not a time"),
    ("loss=100%", "loss must be"),
    ("speed=1gbit", "unknown key 'speed'"),
    ("bandwidth", "is not KEY=VALUE"),
    ("jitter=1ms", "jitter needs a delay"),
    ("mtu=70000", "mtu must be between"),
    ("delay=1ms,delay=2ms", "delay is given twice"),
])
def test_bad_emulate_strings_name_the_option_and_key(text, message):
    with pytest.raises(ValueError, match="--emulate") as info:
        parse_link_spec(text)
    assert message in str(info.value)


def test_link_bandwidth_is_a_rate_kept_in_bytes_per_second():
    assert LinkSpec(bandwidth="1gbit").bandwidth == 125e6
    assert LinkSpec(bandwidth="1gbit") == LinkSpec(bandwidth="125MB/s") == \
        LinkSpec(bandwidth=125e6) == parse_link_spec("bandwidth=1 Gbit/s")
    assert parse_link_spec("bandwidth=12.5e6").bandwidth == 12.5e6  # a bare number: bytes/s
    assert LinkSpec(bandwidth="250mbit").describe() == "bandwidth=250mbit"  # as tc writes it
    with pytest.raises(ValueError, match="at least 1kbit"):
        LinkSpec(bandwidth="500bit")
    with pytest.raises(ValueError, match="bandwidth"):
        LinkSpec(bandwidth="fast")


def test_rank_override_makes_one_slow_link():
    args = build_parser().parse_args(
        ["launch", "--nproc", "4", "--emulate", "bandwidth=1gbit,delay=1ms",
         "--emulate-rank", "3:bandwidth=250mbit", "--", "--steps", "5"])
    links = links_from_args(args)
    assert [link.bandwidth for link in links] == [125e6, 125e6, 125e6, 31.25e6]  # bytes/s
    assert all(link.delay == 1e-3 for link in links)  # an override keeps the other keys
    no_emulation = build_parser().parse_args(["launch", "--nproc", "2", "--", "--steps", "5"])
    assert links_from_args(no_emulation) is None


@pytest.mark.parametrize("argv, message", [
    (["--nproc", "0", "--", "--steps", "1"], "--nproc must be >= 1, got 0"),
    (["--", "--steps", "1"], "--nproc is required"),
    (["--nproc", "2", "--emulate", "bandwidth=fast", "--"], "--emulate 'bandwidth=fast'"),
    (["--nproc", "2", "--emulate-rank", "2:delay=1ms", "--"], "rank 2 does not exist"),
    (["--nproc", "2", "--emulate-rank", "one:delay=1ms", "--"], "expected RANK:SPEC"),
    (["--nproc", "2", "--", "--sim", "4"], "leave --sim out"),
    (["--nproc", "2", "--", "--bogus"], "unrecognized arguments: --bogus"),
    (["--cleanup", "--nproc", "2"], "--cleanup takes no --nproc"),
])
def test_launch_errors_exit_2_with_a_message(argv, message, capsys):
    assert main(["launch", *argv]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


@pytest.mark.parametrize("missing, message", [
    ("root", "needs root"),
    ("tc", "needs the `tc` command"),
    ("ip", "needs the `ip` command"),
])
def test_emulation_without_root_or_tools_says_so_and_exits_2(missing, message, monkeypatch,
                                                             capsys):
    if missing == "root":
        monkeypatch.setattr(os, "geteuid", lambda: 1000)
    else:
        real_which = netem.shutil.which
        monkeypatch.setattr(netem.shutil, "which",
                            lambda name: None if name == missing else real_which(name))
    assert main(["launch", "--nproc", "2", "--emulate", "--", "--steps", "1"]) == 2
    assert main(["launch", "--cleanup"]) == 2
    err = capsys.readouterr().err
    assert err.count(message) == 2 and "Traceback" not in err


def test_snmp_counter_reads_a_value_under_its_name_and_names_a_missing_one():
    lines = ["Ip: Forwarding DefaultTTL", "Ip: 1 64",
             "Tcp: RtoAlgorithm RtoMin InSegs OutSegs RetransSegs InErrs",
             "Tcp: 1 200 41497860 41469615 26801 0",
             "Udp: InDatagrams NoPorts", "Udp: 5 6"]
    assert netem.snmp_counter(lines, "Tcp", "RetransSegs") == 26801
    assert netem.snmp_counter(lines, "Udp", "NoPorts") == 6
    with pytest.raises(netem.NetworkSetupError, match="no Tcp counter 'Retrans'"):
        netem.snmp_counter(lines, "Tcp", "Retrans")


def test_qdiscs_netem_on_the_switch_side_tbf_on_both():
    link = LinkSpec(bandwidth="1gbit", delay=1e-3, jitter=1e-4, loss=0.01)
    switch_side = netem._qdisc_commands("sw", "gsms0", link, netem=True)
    worker_side = netem._qdisc_commands("n0", "gsmw0", link, netem=False)
    assert [" ".join(cmd) for cmd in switch_side] == [
        "tc -n sw qdisc add dev gsms0 root handle 1: netem limit 1000 delay 1000us 100us "
        "loss 1%",
        "tc -n sw qdisc add dev gsms0 parent 1:1 handle 10: tbf rate 1000000000bit "
        "burst 125000 limit 6250000",
    ]
    assert [" ".join(cmd) for cmd in worker_side] == [
        "tc -n n0 qdisc add dev gsmw0 root handle 10: tbf rate 1000000000bit burst 125000 "
        "limit 6250000",
    ]
    assert netem._qdisc_commands("sw", "gsms0", LinkSpec(), netem=True) == []


# --------------------------------------------------------------------------------------------
# Emulated networks without training: shaping, counters, teardown
# --------------------------------------------------------------------------------------------

_SINK = textwrap.dedent("""
    import socket, sys
    server = socket.create_server((sys.argv[1], 5000))
    print("ready", flush=True)
    conn, _ = server.accept()
    for _ in range(5):  # echo five bytes one at a time: round trips
        conn.sendall(conn.recv(1))
    total = 0
    while chunk := conn.recv(1 << 20):
        total += len(chunk)
    conn.sendall(b"k")
    print(total, flush=True)
""")

_SOURCE = textwrap.dedent("""
    import json, socket, sys, time
    conn = socket.create_connection((sys.argv[1], 5000))
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    rtts = []
    for _ in range(5):
        start = time.perf_counter(); conn.sendall(b"p"); conn.recv(1)
        rtts.append(time.perf_counter() - start)
    payload, start = b"x" * int(sys.argv[2]), time.perf_counter()
    conn.sendall(payload)
    conn.shutdown(socket.SHUT_WR)
    conn.recv(1)
    print(json.dumps({"rtt": min(rtts), "seconds": time.perf_counter() - start}))
""")


def _transfer(net: Network, src: int, dst: int, nbytes: int) -> dict:
    """Send ``nbytes`` over TCP from rank src's namespace to dst's; round trip and seconds."""
    sink = subprocess.Popen([*net.exec_prefix(dst), sys.executable, "-c", _SINK,
                             net.address(dst)], stdout=subprocess.PIPE, text=True)
    try:
        assert sink.stdout.readline().strip() == "ready"
        source = subprocess.run([*net.exec_prefix(src), sys.executable, "-c", _SOURCE,
                                 net.address(dst), str(nbytes)],
                                capture_output=True, text=True, timeout=60, check=True)
        assert int(sink.stdout.readline()) == nbytes
    finally:
        sink.kill()
        sink.wait()
    return json.loads(source.stdout)


def _namespaces_of(pid: int) -> list[str]:
    return [name for name in netem._namespaces() if name.startswith(f"{netem.PREFIX}{pid}-")]


def _root_links() -> list[str]:
    out = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout
    return [line.split(":")[1].strip() for line in out.splitlines()
            if line.split(":")[1].strip().startswith("gsm")]


@pytest.mark.slow
@emulated
def test_one_slow_link_is_shaped_both_ways_and_counters_count_frames():
    fast, slow = LinkSpec(), LinkSpec(bandwidth="20mbit")
    nbytes = 3_000_000
    with Network([fast, slow, fast]) as net:
        tag = net.tag
        assert len(_namespaces_of(os.getpid())) == 4  # three nodes and the switch
        before = net.counters(1)
        upload = _transfer(net, 1, 0, nbytes)  # limited on the slow node's own interface
        after = net.counters(1)
        download = _transfer(net, 0, 1, nbytes)  # limited on the switch's port to it
        unshaped = _transfer(net, 0, 2, nbytes)
    # 1448 payload bytes per 1514-byte frame: 20 Mbit/s carries 19.1 Mbit/s of payload
    for transfer in (upload, download):
        rate = 8 * nbytes / transfer["seconds"]
        assert 0.8 * 19.1e6 < rate < 1.05 * 19.1e6, rate
    assert 8 * nbytes / unshaped["seconds"] > 3 * 19.1e6
    # what TCP carried, from the interface's counters: bytes less each frame's headers
    sent = after["tx_bytes"] - before["tx_bytes"]
    assert after["tcp_retransmitted"] >= before["tcp_retransmitted"] >= 0
    frames = after["tx_packets"] - before["tx_packets"]
    assert abs(sent - HEADERS * frames - (nbytes + 5)) < 0.001 * nbytes, (sent, frames)
    assert frames >= nbytes / 1448  # wire-sized frames: no segmentation offload on the link
    assert not any(name.startswith(tag) for name in netem._namespaces())
    assert not list(netem.NETNS_ETC.glob(f"{tag}*"))


@emulated
def test_delay_sets_the_round_trip():
    try:
        net = Network([LinkSpec(delay=0.02)] * 2).__enter__()
    except EmulationUnavailable as exc:
        pytest.skip(str(exc))  # e.g. a kernel built without netem (CONFIG_NET_SCH_NETEM)
    try:
        rtt = _transfer(net, 0, 1, 1000)["rtt"]
    finally:
        net.__exit__(None, None, None)
    assert 0.038 < rtt < 0.08, rtt  # one way is the receiver's delay: 20 ms + 20 ms


_HOLD_NETWORK = textwrap.dedent("""
    import importlib.util, sys, time
    spec = importlib.util.spec_from_file_location("netem", sys.argv[1])
    netem = importlib.util.module_from_spec(spec)
    sys.modules["netem"] = netem
    spec.loader.exec_module(netem)
    with netem.Network([netem.LinkSpec(bandwidth="100mbit")] * 2) as net:
        print(net.tag, flush=True)
        time.sleep(60)
""")


def _hold_network() -> tuple[subprocess.Popen, str]:
    """A process (without torch: netem.py needs only the standard library) holding a network."""
    process = subprocess.Popen([sys.executable, "-c", _HOLD_NETWORK, netem.__file__],
                               stdout=subprocess.PIPE, text=True)
    tag = process.stdout.readline().strip()
    assert tag.startswith(f"{netem.PREFIX}{process.pid}-"), tag
    assert len(_namespaces_of(process.pid)) == 3
    return process, tag


@pytest.mark.slow
@emulated
def test_signals_tear_down_and_cleanup_removes_what_sigkill_left():
    # SIGINT and SIGTERM unwind through the teardown
    for signum in (signal.SIGINT, signal.SIGTERM):
        process, _ = _hold_network()
        process.send_signal(signum)
        process.wait(timeout=30)
        assert _namespaces_of(process.pid) == []
    # SIGKILL cannot be caught: the namespaces stay, and cleanup() finds them by their prefix
    process, tag = _hold_network()
    process.kill()
    process.wait()
    assert len(_namespaces_of(process.pid)) == 3
    with Network([LinkSpec()]) as live:  # a running launcher's network is left alone
        assert {f"{tag}-0", f"{tag}-1", f"{tag}-sw"} <= set(leftovers())
        removed = cleanup()
        assert {f"{tag}-0", f"{tag}-1", f"{tag}-sw"} <= set(removed)
        assert live.namespace(0) in netem._namespaces()
    assert _namespaces_of(process.pid) == []
    assert not list(netem.NETNS_ETC.glob(f"{tag}*"))
    assert _root_links() == []


# --------------------------------------------------------------------------------------------
# Training under the launcher
# --------------------------------------------------------------------------------------------

# a run that lasts until it is killed; one train record per step, so it is seen to run
_ENDLESS = ["--steps", "100000", "--log-every", "1", "--eval-every", "0", "--quiet"]


def _start_launcher(run_dir: Path, *options: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "gossamer", "launch", "--nproc", "2", "--grace", "2",
         *options, "--", *_ENDLESS, "--run-dir", str(run_dir)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )


def _wait_for_training(launcher: subprocess.Popen, run_dir: Path, timeout: float = 60) -> None:
    metrics = run_dir / "metrics.jsonl"
    deadline = time.monotonic() + timeout
    while not (metrics.is_file() and metrics.read_text().strip()):
        if launcher.poll() is not None:
            pytest.fail(f"the launcher exited early:\n{launcher.stdout.read()}")
        if time.monotonic() > deadline:
            launcher.kill()
            pytest.fail(f"no training step within {timeout} s")
        time.sleep(0.2)


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def _gone(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] == "Z"
    except OSError:
        return True


@pytest.mark.slow
@pytest.mark.gloo
def test_local_workers_stop_when_one_dies_and_the_exit_code_is_forwarded(tmp_path):
    launcher = _start_launcher(tmp_path)
    _wait_for_training(launcher, tmp_path)
    children = [int(p.name) for p in Path("/proc").iterdir() if p.name.isdigit()
                and Path(f"/proc/{p.name}/stat").exists()
                and _ppid(int(p.name)) == launcher.pid]
    ranks = {pid: _env(pid).get("RANK") for pid in children}
    assert sorted(ranks.values()) == ["0", "1"], ranks
    victim = next(pid for pid, rank in ranks.items() if rank == "1")
    os.kill(victim, signal.SIGKILL)
    out = launcher.communicate(timeout=60)[0]
    assert launcher.returncode == 128 + signal.SIGKILL
    assert "rank 1 was killed by SIGKILL; stopping the other workers" in out
    assert all(_gone(pid) for pid in children)


def _ppid(pid: int) -> int | None:
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[1])
    except (OSError, IndexError, ValueError):
        return None


def _env(pid: int) -> dict[str, str]:
    try:
        data = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return {}
    return dict(item.decode().partition("=")[::2] for item in data.split(b"\0") if item)


@pytest.mark.slow
@pytest.mark.gloo
@emulated
def test_emulated_run_moves_the_bytes_the_library_counts(tmp_path, record_property):
    """Method: one run of 200 AllReduce steps of the digits MLP (38 kB of gradients a step)
    on two nodes over 1 Gbit/s links. The library's bytes per worker: rank 0's own count is
    its last train record; the summary's is the mean over workers, so rank 1's is
    2 * mean - rank 0's (they differ by the initial broadcast, which rank 0 sends). The wire:
    each namespace's interface counters over the whole run (read by the launcher before the
    workers start and after they end, in network.json), less 66 bytes of headers per frame,
    which leaves what TCP carried. That includes, beyond the library's count, what it does
    not count as the algorithm's: the rendezvous, the heartbeats, the final evaluation's
    collectives, and gloo's own framing of each message; the raw counters also carry every
    frame's headers and the ACKs of what the worker received."""
    out, err = io.StringIO(), io.StringIO()
    code = launch(["--steps", "200", "--model", "mlp", "--eval-every", "0", "--quiet",
                   "--run-dir", str(tmp_path)], 2,
                  links=[LinkSpec(bandwidth="1gbit")] * 2, stdout=out, stderr=err)
    assert code == 0, err.getvalue()
    assert "[rank 0] bytes sent per worker" in out.getvalue()
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").open()]
    rank0 = [r for r in records if r["kind"] == "train"][-1]["bytes_sent"]
    mean = [r for r in records if r["kind"] == "summary"][-1]["bytes_sent"]
    library = [rank0, 2 * mean - rank0]
    wire = json.loads((tmp_path / "network.json").read_text())["ranks"]
    for rank, (counted, link) in enumerate(zip(library, wire, strict=True)):
        payload = link["tx_bytes"] - HEADERS * link["tx_packets"]
        ratio, raw = payload / counted, link["tx_bytes"] / counted
        record_property(f"rank{rank}", f"library {counted:.0f} B, interface {link['tx_bytes']} "
                        f"B in {link['tx_packets']} frames: payload/library {ratio:.4f}, "
                        f"raw/library {raw:.4f}")
        print(f"rank {rank}: payload/library {ratio:.4f}, raw/library {raw:.4f}")
        assert 1.0 <= ratio < 1.05, (rank, ratio)
        assert ratio < raw < 1.15, (rank, raw)  # headers on top


@pytest.mark.slow
@pytest.mark.gloo
@emulated
@pytest.mark.parametrize("kill", ["worker", "launcher"])
def test_killed_emulated_run_leaves_no_namespace_veth_or_process(kill, tmp_path):
    launcher = _start_launcher(tmp_path, "--emulate", "bandwidth=1gbit")
    _wait_for_training(launcher, tmp_path)
    names = _namespaces_of(launcher.pid)
    assert len(names) == 3
    # per node: its torchrun agent and, under it, the training process
    trainers, inside = {}, {}
    for name in names:
        for pid in map(int, subprocess.run(["ip", "netns", "pids", name], capture_output=True,
                                           text=True).stdout.split()):
            inside[pid] = _cmdline(pid)
            if "gossamer train" in inside[pid] and "torch.distributed.run" not in inside[pid]:
                trainers[name.rsplit("-", 1)[1]] = pid
    assert sorted(trainers) == ["0", "1"], inside
    if kill == "worker":
        os.kill(trainers["1"], signal.SIGKILL)
    else:
        launcher.send_signal(signal.SIGTERM)
    out = launcher.communicate(timeout=60)[0]
    assert launcher.returncode == (1 if kill == "worker" else 128 + signal.SIGTERM), out
    assert _namespaces_of(launcher.pid) == []
    assert not list(netem.NETNS_ETC.glob(f"{netem.PREFIX}{launcher.pid}-*"))
    assert _root_links() == []
    assert all(_gone(pid) for pid in inside)
