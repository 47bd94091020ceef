"""DDP comm hooks for the gradient-level algorithms, for people who already use DDP.

``ddp.register_comm_hook(state, hook)``; each state object has ``state_dict()`` /
``load_state_dict()`` and a step counter that advances once per optimizer step. Under a
``torch.amp.GradScaler`` give it to the state (``scaler=``), so that an overflow on one worker
makes every worker skip the step (:mod:`gossamer.hooks.agreement`).
"""

from gossamer.hooks.compression import (  # noqa: F401
    CompressionState,
    DGCState,
    PowerSGDState,
    QSGDState,
    TopKState,
    compression_hook,
    dgc_hook,
    powersgd_hook,
    qsgd_hook,
    topk_hook,
)
from gossamer.hooks.gossipgrad import GossipGraDState, gossipgrad_hook  # noqa: F401
