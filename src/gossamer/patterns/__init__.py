"""The communication patterns that methods share, below the methods themselves: each is
written once, used by every method that needs it, and tested on SimWorld and on gloo.

- :mod:`~gossamer.patterns.overlap`: gradient buckets reduced during backward, as DDP's
  reducer (a schedule, flat or compressed buckets, a communication thread);
- :mod:`~gossamer.patterns.nonfinite`: the workers' agreement on non-finite values, riding on
  the method's own messages;
- :mod:`~gossamer.patterns.scattered`: the mean of a vector as a reduce-scatter and an
  all-gather over point-to-point exchanges, low-precision with error feedback, never blocking;
- :mod:`~gossamer.patterns.fragments`: a model split into fragments of whole layers;
- :mod:`~gossamer.patterns.parts`: where a tensor lies in the whole one it is a part of (a
  sharded model's local shard), for the methods that draw or group by whole tensors;
- :mod:`~gossamer.patterns.mailbox`: point-to-point channels with receives posted ahead, sends
  kept until known complete, and stamped messages with acknowledgements and a closing
  handshake (the asynchronous methods, WAGMA and AD-PSGD);
- :mod:`~gossamer.patterns.staleness`: the models partners published for rounds, looked up by
  age, behind a bounded-staleness average;
- :mod:`~gossamer.patterns.pairwise`: GossipGraD's gradient exchange, a local group's exact
  mean and then one rotating partner node's (1/2 each), exact or compressed (the algorithm and
  its DDP comm hook).

A method's module then holds its configuration, its schedule and its arithmetic.
"""
