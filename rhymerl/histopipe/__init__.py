"""HistoPipe: history-aware rollout scheduling (length predictor, cost model and its
calibration, planner, the scheduler state machine with its policies). The cluster simulator
(benchmarks/simulate) drives the same scheduler."""

from rhymerl.histopipe.cost import DecodeCostModel
from rhymerl.histopipe.planner import HistoPipePlanner, NoopPlanner, Plan, PromptGroup
from rhymerl.histopipe.predictor import LengthPredictor
from rhymerl.histopipe.scheduler import HistoPipePolicy, Move, Policy, PriorityPolicy, Scheduler, StaticPolicy

__all__ = ["DecodeCostModel", "HistoPipePlanner", "HistoPipePolicy", "LengthPredictor", "Move", "NoopPlanner", "Plan",
           "Policy", "PriorityPolicy", "PromptGroup", "Scheduler", "StaticPolicy"]
