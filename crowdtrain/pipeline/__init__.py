"""SkipPipe's pipeline: nodes serve their stage's layers to the stage-0 nodes that drive microbatches along paths.

stage_service  StageService: the forward and backward hops a node serves for its stage and calls on others',
               bounded and checked (proto.StageHop)
driver         PipelineDriver: a stage-0 node runs its microbatches along their routes and back, rerouting a
               failed hop to another replica of its stage or skipping the stage
device_clock   DeviceClock: the seconds a node's device takes per microbatch it computes, which it declares
"""

from crowdtrain.pipeline.driver import MicrobatchOutcome, PipelineDriver
from crowdtrain.pipeline.stage_service import HopFailedError, HopLimits, HopRefusedError, StageService

__all__ = ["HopFailedError", "HopLimits", "HopRefusedError", "MicrobatchOutcome", "PipelineDriver", "StageService"]
