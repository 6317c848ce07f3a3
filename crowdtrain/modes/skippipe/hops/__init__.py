"""SkipPipe's hops: the pipeline hops a node serves and makes, the stage-0 driver, the device clock.

stage_service      StageService: the hops a node serves for its stage (forward, backward, done, ping, gradient,
                   state), bounded and checked
stage_ledger       what a stage node keeps of its iterations: forwards held for their backward, done messages,
                   gradients
hop_callers        who may call a stage node: hops only from the iteration's sources, done messages only from
                   the roster, losses bounded
stage_calls        the calls a node makes on other nodes' stages: hops, done messages, pings, gradients, states
hop_wire           a tensor as a stream of proto.StageHop frames: wire dtypes, bounds checked on receipt, pacing
driver             PipelineDriver: a stage-0 node runs its microbatches along their routes and back, rerouting a
                   failed hop to another replica of its stage or skipping the stage
device_clock       DeviceClock: the seconds a node's device takes per microbatch it computes, which it declares
"""

from crowdtrain.modes.skippipe.hops.driver import MicrobatchOutcome, PipelineDriver
from crowdtrain.modes.skippipe.hops.hop_wire import HopFailedError, HopLimits, HopRefusedError
from crowdtrain.modes.skippipe.hops.stage_service import StageService

__all__ = ["HopFailedError", "HopLimits", "HopRefusedError", "MicrobatchOutcome", "PipelineDriver", "StageService"]
