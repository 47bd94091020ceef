"""The channels of the asynchronous methods (gossamer.patterns.mailbox) and the store of
published models behind a bounded-staleness average (gossamer.patterns.staleness): each piece
alone, then the stamped mailbox's whole life (messages with fields, drained without blocking,
acknowledgements that release sends, the closing handshake) in the simulator and on gloo, with
the same bytes and messages counted in both."""

import pytest
import torch

from gossamer.comm import SimWorld
from gossamer.patterns.mailbox import CLOSE, Inbox, Outbox, StampedMailbox
from gossamer.patterns.staleness import PublishedModels
from gossamer.testing import spawn_gloo


class _Send:
    """A send that reports itself complete once ``done`` is set, and counts its waits."""

    def __init__(self, done: bool = False) -> None:
        self.done, self.waited = done, 0

    def ready(self) -> bool:
        return self.done

    def wait(self) -> dict:
        self.waited += 1
        return {}


def test_the_outbox_waits_only_for_sends_known_matched():
    box = Outbox()
    sends = [_Send() for _ in range(4)]
    assert [box.add(s) for s in sends] == [1, 2, 3, 4]
    box.release(matched=2)  # 1 and 2 have their receives posted: waited for, forgotten
    assert [s.waited for s in sends] == [1, 1, 0, 0] and len(box) == 2
    sends[3].done = True
    box.release()  # 3 is neither matched nor complete: it blocks the queue, 4 stays too
    assert len(box) == 2 and sends[3].waited == 0
    sends[2].done = True
    box.release()
    assert len(box) == 0 and sends[2].waited == 1


def test_keep_at_most_drops_complete_sends_then_waits_the_oldest():
    box = Outbox()
    sends = [_Send(done=i == 1) for i in range(5)]
    for s in sends:
        box.add(s)
    box.keep_at_most(2)  # 1 reported complete (dropped unwaited); 0 and 2 waited; 3, 4 kept
    assert [s.waited for s in sends] == [1, 0, 1, 0, 0] and len(box) == 2
    box.drop()
    assert len(box) == 0 and sends[3].waited == 0


def _inbox(comm):
    peer = 1 - comm.rank
    inbox = Inbox(comm, [peer], torch.zeros(3), window=2)
    for k in range(3):
        comm.exchange({peer: torch.full((3,), 10.0 * comm.rank + k)}, []).wait()
    got = [inbox.take(peer)[0].item() for _ in range(3)]  # the third on the reposted receive
    comm.exchange({peer: torch.zeros(3)}, []).wait()
    comm.exchange({peer: torch.zeros(3)}, []).wait()
    inbox.close(peer)  # both receives still posted get their messages
    return got, peer in inbox


def test_an_inbox_keeps_its_window_posted():
    assert SimWorld(2).run(_inbox) == [([10.0, 11.0, 12.0], False), ([0.0, 1.0, 2.0], False)]


def _mailbox_life(comm) -> dict:
    """Each worker sends rounds 0..5 to every other with its rank as a field, drains what has
    arrived after each (never blocking), takes what it needs to stay within the window, then
    all close: what each kept, the counts, and its traffic."""
    partners = [m for m in range(comm.world_size) if m != comm.rank]
    x = torch.full((8,), float(comm.rank))
    box = StampedMailbox(comm, partners, x, fields=2, window=2)
    kept: dict[int, list[tuple[int, int]]] = {m: [] for m in partners}

    def keep(message):
        peer, kind, (stamp, owner), y = message
        assert kind == 0 and owner == peer and torch.equal(y, torch.full((8,), float(peer))), (
            peer, kind, stamp, owner, y)
        kept[peer].append(stamp)

    for stamp in range(6):
        box.send(x, 0, (stamp, comm.rank), partners)
        for message in box.drain():
            keep(message)
        for peer in partners:  # at most window rounds ahead of every partner
            while len(kept[peer]) < stamp - 1:
                keep((peer, *box.take(peer)))
    comm.barrier()  # closing is collective: no partner closes while another still sends
    for message in box.close(x, (99, comm.rank)):
        keep(message)
    return {"kept": kept, "sent": box.sent, "taken": box.taken, "open": any(
        box.is_open(m) for m in partners),
        "bytes": comm.stats.total_bytes_sent, "messages": sum(comm.stats.messages_sent.values())}


def _check_life(results, n):
    for rank, r in enumerate(results):
        partners = [m for m in range(n) if m != rank]
        # every round of every partner, in order; the closing messages are not kept
        assert r["kept"] == {m: list(range(6)) for m in partners}
        assert r["sent"] == dict.fromkeys(partners, 6 + 2)  # and window closing messages
        assert not r["open"]
        # each takes up to a partner's first closing message: the second one fills the
        # receive posted after it, which close() completes uncounted
        assert r["taken"] == dict.fromkeys(partners, 6 + 1)
        # a message: 8 floats and a trailer of 4 int64 (acknowledgement, kind, 2 fields)
        assert r["bytes"] == (6 + 2) * (n - 1) * (8 * 4 + 4 * 8)


def test_a_stamped_mailbox_carries_fields_and_closes_in_the_simulator():
    _check_life(SimWorld(3).run(_mailbox_life), 3)


def test_the_closing_kind_is_apart_from_the_methods_kinds():
    assert CLOSE < 0  # a method's own kinds are 0 and up


def _mailbox_life_on_gloo() -> dict:
    from gossamer.comm import TorchCommunicator

    with TorchCommunicator.from_env(timeout=30) as comm:
        return _mailbox_life(comm)


@pytest.mark.slow
@pytest.mark.gloo
def test_a_stamped_mailbox_on_gloo_counts_what_the_simulator_counts():
    """Backend parity: the same life on 3 gloo processes keeps the same messages, sends the
    same bytes and messages, and ends with nothing in flight (close() returned)."""
    real = spawn_gloo(_mailbox_life_on_gloo, 3, timeout=120)
    _check_life(real, 3)
    sim = SimWorld(3).run(_mailbox_life)
    assert [(r["bytes"], r["messages"]) for r in real] == [
        (s["bytes"], s["messages"]) for s in sim]


def test_published_models_by_age_and_stamp():
    x0, x1, x3 = torch.zeros(2), torch.ones(2), torch.full((2,), 3.0)
    store = PublishedModels([1, 2], x0)
    assert store.model_for(1, 0)[:2] == (0, 0)
    assert store.model_for(1, 2)[:2] == (2, 0)  # round 0's model, two rounds old
    store.keep(1, 1, 1, x1)
    store.keep(1, 3, 5, x3)  # published for rounds 3 to 5 (its owner skipped 4 and 5)
    assert store.model_for(1, 4)[:2] == (0, 3)  # its model of round 4
    assert store.model_for(1, 2)[:2] == (1, 1)  # round 1's, one round old; not round 3's
    assert store.newest(1)[0] == 5 and torch.equal(store.newest(1)[1], x3)
    store.keep(1, 3, 4, x0)  # overtaken: a model for fewer rounds from the same stamp
    assert torch.equal(store.model_for(1, 5)[2], x3)
    store.forget(4)  # rounds before 4 no longer used: round 0 and 1's models go
    assert sorted(store.by_peer[1]) == [3] and sorted(store.by_peer[2]) == [0]  # newest kept
    state = store.state_dict()
    other = PublishedModels([1, 2], x1)
    other.load_state_dict(state, torch.float64)
    assert other.model_for(1, 5)[2].dtype == torch.float64 and other.model_for(2, 0)[:2] == (0, 0)
    store.reset([1, 2], 7, x1)
    assert store.model_for(2, 7)[:2] == (0, 7) and store.model_for(1, 6) is None
