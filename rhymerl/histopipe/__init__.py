"""HistoPipe: history-aware two-tier rollout scheduling (length predictor, cost model,
planner, runtime dispatcher) and the cluster simulator that measures it."""

from rhymerl.histopipe.cost import DecodeCostModel
from rhymerl.histopipe.dispatch import PlanDispatcher, is_straggler
from rhymerl.histopipe.planner import HistoPipePlanner, NoopPlanner, Plan, PromptGroup
from rhymerl.histopipe.predictor import LengthPredictor

__all__ = ["DecodeCostModel", "HistoPipePlanner", "LengthPredictor", "NoopPlanner", "Plan", "PlanDispatcher",
           "PromptGroup", "is_straggler"]
