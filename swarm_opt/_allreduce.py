"""hivemind's butterfly all-reduce with all-or-nothing reducers.

In hivemind, a reducer that loses a sender (its stream broke, or it never started sending) goes on without it: the
parts it reduces afterwards are averaged over the remaining senders and returned to them as if nothing happened.
Only the reducer itself knows (``banned_senders``); its groupmates combine these parts with complete parts from the
other reducers and end up with a mixture that is nobody's average. Since a swarm_opt round commits only if it is
complete, the reducer here stops instead: once a sender has failed it returns no more parts, so every sender either
gets complete averages or sees the reducer fail (and its round fails too). Parts completed before the failure
are complete averages and are delivered as usual.
"""

from __future__ import annotations

from typing import Any

import torch
from hivemind.averaging.allreduce import AllreduceException, AllReduceRunner
from hivemind.averaging.partition import TensorPartReducer


class AllOrNothingReducer(TensorPartReducer):
    """A ``TensorPartReducer`` that never completes a part without every sender."""

    def on_sender_failed(self, sender_index: int) -> None:
        self.sender_failed_after[sender_index] = self.num_parts_received[sender_index]
        self.finalize()  # waiting senders get an error instead of an average that lacks this sender

    async def accumulate_part(self, sender_index: int, part_index: int, tensor_part: torch.Tensor,
                              weight: float = 1.0) -> torch.Tensor:
        if self.finished.is_set():  # checked here: hivemind only checks after waiting for earlier parts
            raise AllreduceException("the reduction was abandoned: a member of the group failed")
        return await super().accumulate_part(sender_index, part_index, tensor_part, weight=weight)


class AllOrNothingRunner(AllReduceRunner):
    """hivemind's ``AllReduceRunner`` whose reducer is an ``AllOrNothingReducer``."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        reducer = self.tensor_part_reducer  # replaced before anything could use it
        self.tensor_part_reducer = AllOrNothingReducer(reducer.part_shapes, reducer.num_senders)
