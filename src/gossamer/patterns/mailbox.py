"""Point-to-point channels for the asynchronous methods (WAGMA, AD-PSGD): receives posted ahead
of the messages, sends kept until they are known complete, and, for a method whose messages
carry their own stamps, acknowledgements and a closing handshake.

Three pieces, from the bottom:

- :class:`Outbox`: sends in flight. gloo reports a send complete only once it is waited for,
  and waiting for a send whose receiver has no receive posted could wait for ever; so a send is
  waited for only once it is known to be matched (the caller says how it knows), and dropped
  as soon as it reports itself complete.
- :class:`Inbox`: a window of receives kept posted for each peer, so that a message never waits
  for its receive: taking the oldest posts the next one.
- :class:`StampedMailbox`: both, over fixed partners, for messages of one flat tensor followed
  by a trailer of int64 values: an acknowledgement (how many messages the sender has taken from
  the receiver: the sends it makes known matched), a kind (the method's own kinds are 0 and
  up; :data:`CLOSE` closes the channel) and the method's fields (e.g. a round stamp).

Example (two workers, each the other's partner)::

    box = StampedMailbox(comm, partners=[1 - comm.rank], like=flat, fields=1, window=2)
    box.send(flat, kind=0, fields=(step,), peers=[1 - comm.rank])
    for peer, kind, fields, x in box.drain():  # what has arrived; never blocks
        ...
    box.close(flat, fields=(step,))  # collective between the partners: nothing in flight
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Iterator, Sequence

import torch

from gossamer.comm.base import Communicator, Handle, control_device

__all__ = ["CLOSE", "Inbox", "Outbox", "StampedMailbox"]

#: the kind of a closing message (the methods' own kinds are 0 and up)
CLOSE = -1

#: a message taken: (sender, kind, fields, tensor)
Message = tuple[int, int, tuple[int, ...], torch.Tensor]


class Outbox:
    """Sends in flight, numbered from 1 in the order they were made, kept until known
    complete."""

    def __init__(self) -> None:
        self._sends: deque[tuple[int, Handle]] = deque()
        self.count = 0  # sends made

    def __len__(self) -> int:
        return len(self._sends)

    def add(self, handle: Handle) -> int:
        """Keep ``handle``; returns its number."""
        self.count += 1
        self._sends.append((self.count, handle))
        return self.count

    def release(self, matched: int = 0) -> None:
        """Forget the oldest sends that are complete: those numbered up to ``matched`` (known
        to have their receive posted, so that waiting returns), and those that report
        themselves complete."""
        sends = self._sends
        while sends and (sends[0][0] <= matched or sends[0][1].ready()):
            sends.popleft()[1].wait()

    def keep_at_most(self, n: int) -> None:
        """Forget every send that reports itself complete, then wait for the oldest ones until
        at most ``n`` are left (the caller knows that all but the newest ``n`` are matched)."""
        self._sends = deque(s for s in self._sends if not s[1].ready())
        while len(self._sends) > n:
            self._sends.popleft()[1].wait()

    def wait_all(self) -> None:
        """Wait for every send kept (each must be matched, or this waits for ever)."""
        while self._sends:
            self._sends.popleft()[1].wait()

    def drop(self) -> None:
        """Forget every send without waiting (its communicator is dead)."""
        self._sends.clear()


class Inbox:
    """``window`` receives posted for each of ``peers``, oldest first, each shaped as
    ``like``; taking the oldest posts the next, unless told not to."""

    def __init__(self, comm: Communicator, peers: Iterable[int], like: torch.Tensor,
                 window: int = 1) -> None:
        self.comm, self.like = comm, like
        self._posted = {p: deque(self._post(p) for _ in range(window)) for p in peers}

    def _post(self, peer: int) -> Handle:
        return self.comm.exchange({}, [peer], recv_like=self.like)

    def post(self, peer: int) -> None:
        """Post one more receive for ``peer``."""
        self._posted[peer].append(self._post(peer))

    def __contains__(self, peer: int) -> bool:
        return peer in self._posted

    @property
    def peers(self) -> list[int]:
        """The peers receives are posted for."""
        return list(self._posted)

    def ready(self, peer: int) -> bool:
        """Whether the oldest receive from ``peer`` has its message (never blocks)."""
        return self._posted[peer][0].ready()

    def take(self, peer: int, repost: bool = True) -> torch.Tensor:
        """The oldest message from ``peer`` (waits for it); with ``repost`` a receive is posted
        in its place."""
        message = self._posted[peer].popleft().wait()[peer]
        if repost:
            self.post(peer)
        return message

    def close(self, peer: int) -> None:
        """Wait for every receive still posted for ``peer`` (each must get a message) and post
        no more."""
        for handle in self._posted.pop(peer):
            handle.wait()

    def drop(self) -> None:
        """Forget every receive without waiting (its communicator is dead)."""
        self._posted.clear()


class StampedMailbox:
    """Channels to fixed ``partners``: messages of one flat tensor shaped as ``like`` plus a
    trailer (an acknowledgement, a kind and ``fields`` int64 values), ``window`` receives kept
    posted per partner, sends kept per partner until known complete.

    A partner keeps ``window`` receives posted beyond the messages it has acknowledged, so a
    send numbered up to its acknowledgement plus ``window`` is matched and can be waited for.
    :meth:`close` ends the channels: each side sends ``window`` closing messages (one for each
    receive the partner has posted) and takes everything until the partner's first one.
    """

    def __init__(self, comm: Communicator, partners: Sequence[int], like: torch.Tensor,
                 fields: int, window: int) -> None:
        self.comm, self.partners, self.window = comm, list(partners), window
        self.fields = fields
        self._dtype, self._numel = like.dtype, like.numel()
        self._trailer = 8 * (2 + fields)
        # the receive template on the payload's device: a message lands there (a CPU template
        # put every message of a GPU run, or of a timing-only one, in host memory)
        self._like = torch.empty(self._numel * like.element_size() + self._trailer,
                                 dtype=torch.uint8, device=like.device)
        self.inbox = Inbox(comm, self.partners, self._like, window)
        self.outbox = {m: Outbox() for m in self.partners}
        self.taken = dict.fromkeys(self.partners, 0)  # messages taken from each partner
        self.acked = dict.fromkeys(self.partners, 0)  # of ours, the most each said it took

    @property
    def sent(self) -> dict[int, int]:
        """Messages sent to each partner."""
        return {m: box.count for m, box in self.outbox.items()}

    def is_open(self, peer: int) -> bool:
        """Whether receives are still posted for ``peer`` (it has not closed its channel)."""
        return peer in self.inbox

    def send(self, x: torch.Tensor, kind: int, fields: Sequence[int],
             peers: Iterable[int]) -> None:
        """Send ``x`` with ``kind`` and ``fields`` to each of ``peers`` (this worker left
        out), in rank order."""
        payload = x.view(torch.uint8)
        for m in sorted(set(peers) - {self.comm.rank}):
            trailer = torch.tensor([self.taken[m], kind, *fields],
                                   device=control_device(x.device)).view(torch.uint8)
            self.outbox[m].add(self.comm.exchange({m: torch.cat([payload, trailer])}, []))
            self.outbox[m].release(self.acked[m] + self.window)

    def ready(self, peer: int) -> bool:
        """Whether a message from ``peer`` has arrived (never blocks)."""
        return peer in self.inbox and self.inbox.ready(peer)

    def take(self, peer: int) -> tuple[int, tuple[int, ...], torch.Tensor]:
        """The oldest message from ``peer`` (waits for it): its kind, its fields and its
        tensor (a copy). A closing message closes the channel: every receive posted for
        ``peer`` is completed and none is posted again."""
        message = self.inbox.take(peer, repost=False)
        # one read of the trailer (one device synchronisation, not one per value)
        acked, kind, *fields = message[-self._trailer:].view(torch.int64).tolist()
        x = message[:-self._trailer].view(self._dtype).clone()
        self.taken[peer] += 1
        self.acked[peer] = max(self.acked[peer], acked)
        if kind == CLOSE:
            self.inbox.close(peer)
        else:
            self.inbox.post(peer)
        self.outbox[peer].release(self.acked[peer] + self.window)
        return kind, tuple(fields), x

    def drain(self) -> Iterator[Message]:
        """Take every message that has arrived, as ``(peer, kind, fields, tensor)``; never
        blocks."""
        for peer in self.partners:
            while self.ready(peer):
                yield peer, *self.take(peer)

    def close(self, x: torch.Tensor, fields: Sequence[int]) -> list[Message]:
        """End the channels (collective between the partners): send ``window`` closing
        messages carrying ``x`` and ``fields`` to every partner, take every message until each
        partner's first closing one, and wait for every send. Returns the messages taken that
        were not closing ones, as ``(peer, kind, fields, tensor)``."""
        for _ in range(self.window):  # one for each receive a partner has posted
            self.send(x, CLOSE, fields, self.partners)
        taken = []
        for peer in self.partners:
            while peer in self.inbox:  # until its closing message
                kind, values, y = self.take(peer)
                if kind != CLOSE:
                    taken.append((peer, kind, values, y))
        for box in self.outbox.values():  # every partner took everything
            box.wait_all()
        return taken

    def drop(self) -> None:
        """Forget everything in flight without waiting (the communicator is dead)."""
        self.inbox.drop()
        for box in self.outbox.values():
            box.drop()
