"""`gossamer plan`: every method's predicted step time, bytes, idle time and speed-up over
AllReduce on a cluster, from the timing-only simulator (see docs/plan.md)."""

from gossamer.plan.models import MODELS, model_builder, parameter_count, resnet50, transformer
from gossamer.plan.predict import Prediction, cycle, predict, step_worker

__all__ = ["MODELS", "Prediction", "cycle", "model_builder", "parameter_count", "predict",
           "resnet50", "step_worker", "transformer"]
